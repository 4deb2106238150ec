"""Why programmatic dependent launch (PDL) made W2 slower, and whether a persistent GEMV with PDL
wins: a chain of Llama-3.1-8B decode GEMVs (qkv, o, gate_up, down) x 32 layers, M = 1, bf16, each
reading the previous one's output, captured in one CUDA graph and replayed.

Variants:
  prod         kernels/gemv.py's _skinny_kernel (one program per 16/32-column tile), plain launches
  prod_pdl     the same with PDL (first weight tile before the wait, release at the start)
  pers{c}      persistent: c programs per SM, each walking its column tiles in one flattened
               (tile, k) loop; plain launches
  pers{c}_pdl  the same with PDL (first tile before the wait)
  streamk{c}   persistent, the (tile, k) iterations split evenly over the programs (split tiles
               summed with fp32 atomics; the last program of a tile casts it), plain / _pdl

Prints µs per layer, the chain's HBM GB/s and the fraction of the copy ceiling; --check compares
every variant's output with torch on small shapes (TRITON_INTERPRET=1 on CPU works too).
--mode layers: whole decode layers' GEMMs with their prologues (bf16 skinny GEMVs; FP8 prologue
kernels + tensor-core GEMMs). --mode fp8sweep: per shape, FP8 tensor-core vs CUDA-core kernels.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from rankserve.kernels import gemv, pdl

LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down


@triton.jit
def _tile_product(x_ptr, w_ptr, offs_n, n_mask, kk, offs_k, K):
    """w[offs_n, kk + offs_k] * x[kk + offs_k] elementwise in fp32 (the GEMV's one step)."""
    k_mask = kk + offs_k < K
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + kk + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    x = tl.load(x_ptr + kk + offs_k, mask=k_mask, other=0.0)
    return w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _pers_kernel(x_ptr, w_ptr, y_ptr, N, K, NUM_TILES, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    my_tiles = tl.cdiv(NUM_TILES - pid, nprog)
    total = my_tiles * k_tiles
    offs_k = tl.arange(0, BLOCK_K)
    ar_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    start = 0
    if USE_PDL:
        offs_n = pid * BLOCK_N + ar_n
        w0 = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
                     mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        x0 = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
        start = 1
        if k_tiles == 1:
            tl.store(y_ptr + offs_n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=offs_n < N)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for it in tl.range(start, total, num_stages=NUM_STAGES):
        t = pid + (it // k_tiles) * nprog
        kk = (it % k_tiles) * BLOCK_K
        offs_n = t * BLOCK_N + ar_n
        n_mask = offs_n < N
        acc += _tile_product(x_ptr, w_ptr, offs_n, n_mask, kk, offs_k, K)
        if it % k_tiles == k_tiles - 1:
            tl.store(y_ptr + offs_n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_mask)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


@triton.jit
def _streamk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, NUM_TILES, ITERS_PER,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """Program p owns iterations [p * ITERS_PER, (p + 1) * ITERS_PER) of the (tile, k) space. Each
    tile's partial sums go to the fp32 workspace with atomics; the program that adds the last
    k-chunks count casts the tile to y and zeroes the workspace and counter for the next replay."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = NUM_TILES * k_tiles
    lo = pid * ITERS_PER
    hi = tl.minimum(lo + ITERS_PER, total)
    offs_k = tl.arange(0, BLOCK_K)
    ar_n = tl.arange(0, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    n_done = 0
    for it in tl.range(lo, hi, num_stages=NUM_STAGES):
        t = it // k_tiles
        kk = (it % k_tiles) * BLOCK_K
        offs_n = t * BLOCK_N + ar_n
        n_mask = offs_n < N
        acc += _tile_product(x_ptr, w_ptr, offs_n, n_mask, kk, offs_k, K)
        n_done += 1
        if (it % k_tiles == k_tiles - 1) | (it == hi - 1):
            part = tl.sum(acc, 1)
            if n_done == k_tiles:  # the whole tile in this program
                tl.store(y_ptr + offs_n, part.to(y_ptr.dtype.element_ty), mask=n_mask)
            else:
                tl.atomic_add(ws_ptr + offs_n, part, mask=n_mask, sem="relaxed")
                tl.debug_barrier()
                seen = tl.atomic_add(cnt_ptr + t, n_done, sem="acq_rel", scope="gpu")
                if seen + n_done == k_tiles:
                    tot = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + offs_n, tot.to(y_ptr.dtype.element_ty), mask=n_mask)
                    tl.store(ws_ptr + offs_n, tl.zeros([BLOCK_N], tl.float32), mask=n_mask)
                    tl.atomic_xchg(cnt_ptr + t, 0)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            n_done = 0


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


class Variant:
    def __init__(self, name: str, kind: str, cps: int = 1, use_pdl: bool = False,
                 block_n: int = 16, block_k: int = 256, stages: int = 4, warps: int = 4):
        self.name, self.kind, self.cps, self.use_pdl = name, kind, cps, use_pdl
        self.block_n, self.block_k, self.stages, self.warps = block_n, block_k, stages, warps
        self.ws = {}

    def __call__(self, x, w, y):
        N, K = w.shape
        on_gpu = x.is_cuda
        bk = self.block_k if on_gpu else 32
        if self.kind == "prod":
            pdl.ENABLED = self.use_pdl
            try:
                cfg = gemv._config(N, on_gpu)
                gemv._skinny_kernel[(1, triton.cdiv(N, cfg["BLOCK_N"]))](
                    x, None, None, w, None, y, None, N, K, 0.0, PROLOGUE=gemv.LINEAR,
                    HAS_BIAS=False, RSTD_BLOCK=cfg["BLOCK_K"], PRELOAD=False, SWIGLU=False, **cfg,
                    **pdl.launch(x))
            finally:
                pdl.ENABLED = False
            return
        extra = {"launch_pdl": True} if self.use_pdl else {}
        bn = self.block_n if N < 16384 else 2 * self.block_n
        tiles = triton.cdiv(N, bn)
        grid = min(tiles, _num_sms() * self.cps)
        if self.kind == "pers":
            _pers_kernel[(grid,)](x, w, y, N, K, tiles, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=self.stages,
                                  USE_PDL=self.use_pdl, num_warps=self.warps, **extra)
        else:
            key = (N, K)
            if key not in self.ws:
                self.ws[key] = (torch.zeros(N, dtype=torch.float32, device=x.device),
                                torch.zeros(tiles, dtype=torch.int32, device=x.device))
            ws, cnt = self.ws[key]
            total = tiles * triton.cdiv(K, bk)
            per = triton.cdiv(total, _num_sms() * self.cps)
            _streamk_kernel[(triton.cdiv(total, per),)](
                x, w, y, ws, cnt, N, K, tiles, per, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=self.stages,
                USE_PDL=self.use_pdl, num_warps=self.warps, **extra)


def variants(pdl_ok: bool) -> list[Variant]:
    vs = [Variant("prod", "prod")]
    for c in (1, 2, 3):
        vs.append(Variant(f"pers{c}", "pers", c))
    for c in (1, 2):
        vs.append(Variant(f"streamk{c}", "streamk", c))
    if pdl_ok:
        vs += [Variant(v.name + "_pdl", v.kind, v.cps, True) for v in list(vs)]
    return vs


def check(device: str) -> set[str]:
    """The names of the variants that failed (an error or a wrong result)."""
    bad = set()
    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for N, K in [(96, 200), (40, 64), (300, 1000)] + (LLAMA8B if device == "cuda" else []):
        x = torch.randn(1, K, device=device, dtype=dt)
        w = torch.randn(N, K, device=device, dtype=dt) / K ** 0.5
        ref = (x.float() @ w.float().T)
        for v in variants(device == "cuda" and torch.cuda.get_device_capability()[0] >= 9):
            try:
                for _ in range(2):  # the second call checks the stream-K workspace was reset
                    y = torch.empty(1, N, device=device, dtype=dt)
                    v(x, w, y)
                err = (y.float() - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                print(f"check {v.name}: {type(e).__name__}: {str(e)[:300]}")
                err = float("inf")
            if not err < 3e-2:
                bad.add(v.name)
            print(f"check {v.name:14s} N={N:5d} K={K:5d} max err {err:.2e} {'ok' if err < 3e-2 else 'FAIL'}")
    return bad


def bench(layers: int, reps: int, out: str | None, skip: set[str]):
    from rankserve.runtime.bench.common import measure_ceilings
    ceil = measure_ceilings(torch.device("cuda"))
    dt = torch.bfloat16
    ws = [[torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for N, K in LLAMA8B] for _ in range(layers)]
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw)
    x0 = torch.randn(1, 4096, device="cuda", dtype=dt)
    ys = [[torch.empty(1, N, device="cuda", dtype=dt) for N, _ in LLAMA8B] for _ in range(layers)]
    rows = []
    for v in variants(torch.cuda.get_device_capability()[0] >= 9):
        if v.name in skip:
            continue

        def chain():
            x = x0
            for lw, ly in zip(ws, ys):
                for w, y in zip(lw, ly):
                    v(x[:, :w.shape[1]], w, y)
                    x = y
        _row(rows, v.name, _timed_graph(chain, reps), layers, nbytes, ceil)
    if out:
        with open(out, "w") as f:
            json.dump(dict(ceilings=ceil, layers=layers, rows=rows, time=time.time()), f, indent=1)


def _timed_graph(fn, reps: int) -> float:
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    return sorted(ts)[len(ts) // 2]


def layers_bench(layers: int, reps: int, rows: list, ceil: dict):
    """Whole decode layers' GEMMs as the model runs them at M = 1: qkv = add_rms_norm_linear(h,
    down_out), o = skinny_linear(attn_out), gate_up = add_rms_norm_linear(h, o_out), down =
    silu_mul_linear(gu); bf16 with the A/B switches of kernels/gemv.py, then FP8 per channel
    (kernels/fp8_prologue.py + quant_tc.py) with and without its prologue kernels."""
    from rankserve.kernels import fp8_prologue, quant
    dt = torch.bfloat16
    gemv.MAX_M = 1
    quant.TC_MAX_M = 16
    ws = [[torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5 for N, K in LLAMA8B] for _ in range(layers)]
    nw = torch.ones(4096, device="cuda", dtype=dt)
    h0 = torch.randn(1, 4096, device="cuda", dtype=dt)
    d0 = torch.randn(1, 4096, device="cuda", dtype=dt)

    def bf16_chain():
        h, d = h0, d0
        for wq, wo, wgu, wd in ws:
            qkv, h = gemv.add_rms_norm_linear_triton(h, d, nw, 1e-5, wq)
            o = gemv.skinny_linear_triton(qkv[:, :4096], wo)
            gu, h = gemv.add_rms_norm_linear_triton(h, o, nw, 1e-5, wgu)
            d = gemv.silu_mul_linear_triton(gu, wd)
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw)
    # calls b, c ran A/B switches of commit a463ce4 (layer_old / _rstd1 / _preload / _rstd1_preload)
    for name, rmax in [("layer_rstd_chunked", 256), ("layer_rstd_one_load", 8192)]:
        gemv.RSTD_MAX = rmax
        t = _timed_graph(bf16_chain, reps)
        _row(rows, name, t, layers, nbytes, ceil)
    gemv.RSTD_MAX = 8192

    def swiglu_chain():  # RANKSERVE_SWIGLU_EPILOGUE: silu * up in gate_up's epilogue, down plain
        h, d = h0, d0
        for wq, wo, wgu, wd in ws:
            qkv, h = gemv.add_rms_norm_linear_triton(h, d, nw, 1e-5, wq)
            o = gemv.skinny_linear_triton(qkv[:, :4096], wo)
            act, h = gemv.add_rms_norm_swiglu_triton(h, o, nw, 1e-5, wgu)
            d = gemv.skinny_linear_triton(act, wd)
    _row(rows, "layer_swiglu_epilogue", _timed_graph(swiglu_chain, reps), layers, nbytes, ceil)
    qs = [[quant.quant_fp8_weight(w) for w in lw] for lw in ws]
    ws.clear()
    torch.cuda.empty_cache()
    nbytes = sum(q.numel() for lw in qs for q, _ in lw)

    def fp8_chain():
        h, d = h0, d0
        for (wq, sq), (wo, so), (wgu, sgu), (wd, sd) in qs:
            qkv, h = fp8_prologue.fp8_add_rms_norm_linear_triton(h, d, nw, 1e-5, wq, sq)
            o = quant.fp8_linear_triton(qkv[:, :4096], wo, so)
            gu, h = fp8_prologue.fp8_add_rms_norm_linear_triton(h, o, nw, 1e-5, wgu, sgu)
            d = fp8_prologue.fp8_silu_mul_linear_triton(gu, wd, sd)

    def fp8_lin_chain():  # the tc GEMMs alone (each quantizing its input in its own prologue)
        x = h0
        for lw in qs:
            for w, sc in lw:
                x = quant.fp8_linear_triton(x[:, :w.shape[1]], w, sc)
    for skinny_m in (0, 1):
        quant.FP8_SKINNY_M = skinny_m
        _row(rows, f"fp8_layer_skinny{skinny_m}", _timed_graph(fp8_chain, reps), layers, nbytes, ceil)
        _row(rows, f"fp8_lin_skinny{skinny_m}", _timed_graph(fp8_lin_chain, reps), layers, nbytes, ceil)


def fp8_sweep(reps: int, rows: list, ceil: dict):
    """(Runs against commit a463ce4's kernels/quant.py, the reverted word-based skinny kernel.)
    Per Llama-8B shape, M = 1, activations prequantized (the FP8 prologue kernels' output): the
    tensor-core kernel (quant_tc.fp8_tc) against the CUDA-core skinny kernel over a config grid.
    Each timing: a CUDA graph of 24 launches over rotating weight copies (> L2)."""
    from rankserve.kernels import quant as Q
    from rankserve.kernels.quant_tc import fp8_tc
    Q.TC_MAX_M = 16
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=nw)
            for bn in (8, 16, 32) for bk in (512, 1024) for st in (3, 4, 6) for nw in (4, 8)]
    for N, K in LLAMA8B:
        copies = max(3, (3 * 50 * 2**20) // (N * K) + 1)
        ws = [Q.quant_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5) for _ in range(copies)]
        xq, xs = Q.quant_fp8_per_token(torch.randn(1, K, device="cuda", dtype=torch.bfloat16))
        out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        n_launch = 24

        def timed(fn):
            def many():
                for i in range(n_launch):
                    fn(*ws[i % copies])
            return _timed_graph(many, reps) / n_launch

        res = {"tc": timed(lambda q, sc: fp8_tc(xq, q, sc, None, None, out, prequant=xs))}
        res["skinny_default"] = timed(lambda q, sc: Q.fp8_skinny(xq, q, sc, None, None, out, prequant=xs))
        for cfg in grid:
            name = "skinny_n{BLOCK_N}_k{BLOCK_K}_s{NUM_STAGES}_w{num_warps}".format(**cfg)
            try:
                res[name] = timed(lambda q, sc, cfg=cfg: Q._fp8_skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
                    xq.view(torch.int32), xs, q.view(torch.int32), sc, None, out, 1, N, K, K // 4, 1,
                    N, 0, GROUP_N=1, GROUP_K=0, HAS_BIAS=False, PREQUANT=True, EMULATE=False,
                    BLOCK_M=1, **cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                print(f"  {name}: {type(e).__name__} {str(e)[:120]}")
        best = sorted((v, k) for k, v in res.items())
        ideal = N * K / (ceil["hbm_GBps"] * 1e9)
        print(f"N={N} K={K}: ideal {ideal * 1e6:.2f} us; tc {res['tc'] * 1e6:.2f} us; "
              f"skinny default {res['skinny_default'] * 1e6:.2f} us; best: "
              + ", ".join(f"{k} {v * 1e6:.2f}" for v, k in best[:5]), flush=True)
        rows.append(dict(N=N, K=K, ideal_us=ideal * 1e6, us={k: v * 1e6 for k, v in res.items()}))
        ws.clear()


def _row(rows, name, t, layers, nbytes, ceil):
    gbps = nbytes / t / 1e9
    rows.append(dict(variant=name, us_per_layer=t / layers * 1e6, GBps=gbps,
                     frac_ceiling=gbps / ceil["hbm_GBps"]))
    print(f"{name:20s} {t / layers * 1e6:8.2f} us/layer  {gbps:8.1f} GB/s  "
          f"{100 * gbps / ceil['hbm_GBps']:5.1f} % of {ceil['hbm_GBps']:.0f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out")
    p.add_argument("--mode", choices=["gemv", "layers", "fp8sweep"], default="gemv")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    failed = check(dev)
    print("failed:", sorted(failed) or "none")
    if a.check or dev == "cpu":
        raise SystemExit(1 if failed else 0)
    if a.mode == "gemv":
        bench(a.layers, a.reps, a.out, failed)
    else:
        from rankserve.runtime.bench.common import measure_ceilings
        ceil, rows = measure_ceilings(torch.device("cuda")), []
        (layers_bench(a.layers, a.reps, rows, ceil) if a.mode == "layers"
         else fp8_sweep(a.reps, rows, ceil))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(dict(ceilings=ceil, layers=a.layers, rows=rows), f, indent=1)
