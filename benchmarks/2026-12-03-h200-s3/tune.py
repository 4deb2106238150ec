"""Tile-config sweep of the skinny decode GEMMs (bf16 gemv, FP8 per channel / 128x128 blocks,
w4a16) at Llama-8B decode shapes, M = 1, each call timed inside a CUDA graph over enough weight
copies to defeat L2 (launch gaps included, as in a decode step). Prints the best configs per
shape with GB/s against the 4.8 TB/s floor, and writes $OUT/tune.json (CUDA only):

    python benchmarks/2026-12-03-h200-s3/tune.py base fp8chan w4sym fp8blk bf16 w4zp

`tc` (about a minute): the tensor-core skinny kernels (kernels/quant_tc.py) against the current
ones. First a correctness table (every kernel against the plain-torch reference, relative error,
OK below 1e-2), then per shape the time of the old op path (RANKSERVE_QUANT_TC_MAX_M=0: the
CUDA-core skinny kernel at M <= 2, else torch._scaled_mm / the tl.dot GEMM) and of the tc
kernel with the table's config and a few variants (split-K, BLOCK_N), in us and TB/s beside the
HBM floor, at M = 1 and the rows listed in TC_M (e.g. TC_M="2 8"; compiled CUDA graphs pad decode to 2); Llama-8B shapes for FP8 per channel, FP8 128x128 blocks,
w4a16 sym / zero point, and DeepSeek-V3 shapes for the blocks; then the per-layer sums, and a
Llama-8B layer's four projections with their prologues (as the model runs them) with the knob off
and on, beside bf16:

    python benchmarks/2026-12-03-h200-s3/tune.py tc
"""
import itertools
import json
import math
import os
import sys
import time

import torch
import triton

from rankserve.kernels import gemv, quant as Q
DT = torch.bfloat16
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
L2 = torch.cuda.get_device_properties(0).L2_cache_size
res = {}

def gtime(fns, reps=3):
    """median per-call us of fns (list of thunks, one per weight copy) inside one CUDA graph"""
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns: f()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns: f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2] * 1000 / (reps * len(fns))

def copies(nbytes):
    return max(2, math.ceil(3 * L2 / nbytes))

def sweep(tag, make_w, call, cfgs, M, nbytes_fn, setcfg):
    for name, N, K in SHAPES:
        x = torch.randn(M, K, dtype=DT, device="cuda")
        ws = [make_w(N, K) for _ in range(copies(nbytes_fn(N, K)))]
        out = torch.empty(M, N, dtype=DT, device="cuda")
        best = []
        for cfg in cfgs:
            setcfg(cfg)
            try:
                t = gtime([lambda w=w: call(x, w, out) for w in ws])
            except Exception:  # a config that does not compile / fit
                continue
            best.append((t, cfg))
        best.sort(key=lambda r: r[0])
        nb = nbytes_fn(N, K)
        print(f"{tag} M={M} {name} {N}x{K}: floor {nb/4.8e6:.1f}us", flush=True)
        for t, cfg in best[:4]:
            print(f"    {t:7.1f} us {nb / t / 1e3:6.0f} GB/s  {cfg}", flush=True)
        res[f"{tag} M={M} {name}"] = [(t, cfg) for t, cfg in best[:8]]
        del ws

def fp8_sweep(M, block):
    bs = [128, 128] if block else None
    orig = Q._skinny_fp8_config
    cfgs = []
    for bn, bk, st, nw in itertools.product([8, 16, 32, 64], [128] if block else [256, 512, 1024],
                                            [3, 6] if block else [3, 5], [4, 8]):
        if bn * bk * triton.next_power_of_2(M) > 32768:
            continue
        cfgs.append(dict(BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=nw))
    def setcfg(c):
        Q._skinny_fp8_config = lambda *a, c=c: dict(c)
    sweep(f"fp8{'blk' if block else 'chan'}", lambda N, K: Q.quant_fp8_weight(torch.randn(N, K, dtype=DT, device="cuda"), bs),
          lambda x, w, out: Q.fp8_skinny(x, w[0], w[1], None, bs, out), cfgs, M, lambda N, K: N * K, setcfg)
    Q._skinny_fp8_config = orig

def w4_sweep(M, zero):
    orig = Q._skinny_w4_config
    cfgs = [dict(BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=nw, SPLIT=sp)
            for bn, bk, st, nw, sp in itertools.product([16, 32, 64, 128], [128, 256], [2, 4], [4, 8], [1, 2])
            if bn * bk // 8 <= 8192]
    cur = {}
    def setcfg(c):
        cur.clear(); cur.update(c)
        Q._skinny_w4_config = lambda *a, c=c: {k: v for k, v in c.items() if k != "SPLIT"}
    def make(N, K):
        qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
        sc = torch.rand(K // 128, N, dtype=DT, device="cuda") * 0.01
        z = torch.randint(0, 16, (K // 128, N), dtype=torch.uint8, device="cuda") if zero else None
        return qw, sc, z
    sweep(f"w4{'zp' if zero else 'sym'}", make,
          lambda x, w, out: Q.w4_skinny(x, w[0], w[1], w[2], None, 128, None, out, split=cur["SPLIT"]),
          cfgs, M, lambda N, K: N * K // 2 + (K // 128) * N * 3, setcfg)
    Q._skinny_w4_config = orig

def baselines(M):
    for name, N, K in SHAPES:
        x = torch.randn(M, K, dtype=DT, device="cuda")
        ws = [torch.randn(N, K, dtype=DT, device="cuda") for _ in range(copies(N * K * 2))]
        out = torch.empty(M, N, dtype=DT, device="cuda")
        t1 = gtime([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
        t2 = gtime([lambda w=w: gemv.skinny_linear(x, w) for w in ws]) if hasattr(gemv, "skinny_linear") else float("nan")
        print(f"bf16 M={M} {name}: cublas {t1:.1f}us {N*K*2/t1/1e3:.0f} GB/s | skinny {t2:.1f}us {N*K*2/t2/1e3:.0f} GB/s", flush=True)
        del ws

def bf16_sweep(M):
    orig = gemv._config
    cfgs = [dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=nw)
            for bn, bk, st, nw in itertools.product([8, 16, 32, 64], [256, 512], [4, 6], [4, 8])
            if bn * bk <= 16384]
    def setcfg(c):
        gemv._config = lambda *a, c=c: dict(c)
    sweep("bf16", lambda N, K: torch.randn(N, K, dtype=DT, device="cuda"),
          lambda x, w, out: gemv._skinny(gemv.LINEAR, x, w, None, x.shape[1]), cfgs, M, lambda N, K: N * K * 2, setcfg)
    gemv._config = orig

DS_SHAPES = [("ds_q_b", 24576, 1536), ("ds_o", 7168, 16384), ("ds_qkv_a", 2112, 7168),
             ("ds_down", 7168, 2048)]


def tc_compare():
    """old op path vs the tensor-core skinny kernels (see the module doc)."""
    from rankserve.kernels import quant_tc as T
    Ms = [1] + [int(m) for m in os.environ.get("TC_M", "").split()]
    HBM = 4.8e12

    def fp8(bs):
        def make(N, K):
            q, s = Q.quant_fp8_weight(torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, bs)
            return q, s
        old = lambda x, w, out: Q.fp8_linear(x, w[0], w[1], None, bs)  # noqa: E731
        tc = lambda x, w, out, **kw: T.fp8_tc(x, w[0], w[1], None, bs, out, **kw)  # noqa: E731
        ref = lambda x, w: Q.fp8_linear_ref(x, w[0], w[1], None, bs)  # noqa: E731
        nbytes = lambda N, K: N * K + (math.ceil(N / 128) * math.ceil(K / 128) if bs else N) * 4  # noqa: E731
        return make, old, tc, ref, nbytes

    def w4(zero):
        def make(N, K):
            qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
            sc = (torch.rand(K // 128, N, device="cuda") * 0.01).to(DT)
            z = torch.randint(0, 16, (K // 128, N), dtype=torch.uint8, device="cuda") if zero else None
            return qw, sc, z
        old = lambda x, w, out: Q.w4a16_linear(x, w[0], w[1], w[2], None, 128)  # noqa: E731
        tc = lambda x, w, out, **kw: T.w4_tc(x, w[0], w[1], w[2], None, 128, None, out, **kw)  # noqa: E731
        ref = lambda x, w: Q.w4a16_linear_ref(x, w[0], w[1], w[2], None, 128)  # noqa: E731
        nbytes = lambda N, K: N * K // 2 + (K // 128) * N * (3 if zero else 2)  # noqa: E731
        return make, old, tc, ref, nbytes

    kinds = [("fp8chan", fp8(None), SHAPES), ("fp8blk", fp8([128, 128]), SHAPES + DS_SHAPES),
             ("w4sym", w4(False), SHAPES), ("w4zp", w4(True), SHAPES)]
    Q.TC_MAX_M = 0  # "old" = the op as it runs without the knob
    print("== correctness (relative error vs the plain-torch reference; OK < 1e-2)", flush=True)
    bad = 0
    for tag, (make, old, tc, ref, _), shapes in kinds:
        for name, N, K in shapes:
            w = make(N, K)
            for M in Ms:
                x = torch.randn(M, K, dtype=DT, device="cuda")
                r = ref(x, w).float()
                out = torch.empty(M, N, dtype=DT, device="cuda")
                calls = {"old": lambda: old(x, w, out), "tc": lambda: tc(x, w, out.clone()),
                         "tc_split1": lambda: tc(x, w, out.clone(), split=1),
                         "tc_split4": lambda: tc(x, w, out.clone(), split=4)}
                errs = {}
                for k, f in calls.items():
                    try:  # a kernel that fails to build is a failure here, not the end of the run
                        errs[k] = ((f().float() - r).norm() / r.norm()).item()
                    except Exception as e:
                        errs[k] = float("inf")
                        print(f"    {k} raised {type(e).__name__}: {str(e)[:300]}", flush=True)
                T.SPLITK_IN_KERNEL = False
                try:
                    errs["tc_split4_sumk"] = ((tc(x, w, out.clone(), split=4).float() - r).norm() / r.norm()).item()
                except Exception as e:
                    errs["tc_split4_sumk"] = float("inf")
                    print(f"    tc_split4_sumk raised {type(e).__name__}: {str(e)[:300]}", flush=True)
                T.SPLITK_IN_KERNEL = True
                ok = all(e < 1e-2 for e in errs.values())
                bad += not ok
                print(f"  {tag:8s} M={M:<2d} {name:8s} " + " ".join(f"{k} {e:.1e}" for k, e in errs.items())
                      + ("  OK" if ok else "  FAIL"), flush=True)
    bad += tc_layer(Ms, check_only=True)
    print(f"== correctness: {'all OK' if not bad else f'{bad} FAILED'}", flush=True)

    orig = T.tc_config
    variants = {"tc": {}, "tc_sumk": {}, "tc_s1": {"SPLIT": 1}, "tc_n32s1": {"BLOCK_N": 32, "SPLIT": 1},
                "tc_n128": {"BLOCK_N": 128}, "tc_st6": {"NUM_STAGES": 6}}
    totals = {}
    print("== timings (per call, inside a CUDA graph, weights > L2)", flush=True)
    for tag, (make, old, tc, ref, nbytes), shapes in kinds:
        for name, N, K in shapes:
            ws = [make(N, K) for _ in range(copies(nbytes(N, K)))]
            floor_us = nbytes(N, K) / HBM * 1e6
            for M in Ms:
                x = torch.randn(M, K, dtype=DT, device="cuda")
                out = torch.empty(M, N, dtype=DT, device="cuda")
                row = {}
                row["old"] = gtime([lambda w=w: old(x, w, out) for w in ws])
                for vname, over in variants.items():
                    T.tc_config = lambda *a, over=over: {**orig(*a), **over}
                    T.SPLITK_IN_KERNEL = vname != "tc_sumk"  # tc_sumk: split-K by a second kernel
                    try:
                        row[vname] = gtime([lambda w=w: tc(x, w, out) for w in ws])
                    except Exception as e:  # a variant that does not compile / fit
                        row[vname] = float("nan")
                        print(f"    {vname} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    T.tc_config = orig
                    T.SPLITK_IN_KERNEL = True
                best = min((v, k) for k, v in row.items() if k != "old" and v == v)
                print(f"  {tag:8s} M={M:<2d} {name:8s} {N}x{K} floor {floor_us:5.1f}us | "
                      + " ".join(f"{k} {v:5.1f}us {nbytes(N, K) / v / 1e6:4.2f}TB/s" for k, v in row.items())
                      + f" | best {best[1]} {row['old'] / best[0]:.2f}x old", flush=True)
                if (name, N, K) in SHAPES:
                    t = totals.setdefault((tag, M), {"floor": 0.0, "old": 0.0, "tc": 0.0, "best": 0.0})
                    t["floor"] += floor_us
                    t["old"] += row["old"]
                    t["tc"] += row["tc"]
                    t["best"] += best[0]
            del ws
    bf = {}
    for M in Ms:  # the bf16 skinny GEMV (what W2 bf16 runs) on the same shapes
        bf[M] = 0.0
        for name, N, K in SHAPES:
            ws = [torch.randn(N, K, dtype=DT, device="cuda") for _ in range(copies(N * K * 2))]
            x = torch.randn(M, K, dtype=DT, device="cuda")
            bf[M] += gtime([lambda w=w: gemv.skinny_linear(x, w) for w in ws])
            del ws
    print("== Llama-8B layer (qkv + o + gate_up + down), us: floor / old / tc (table) / best variant;"
          " bf16 skinny for comparison", flush=True)
    for (tag, M), t in totals.items():
        print(f"  {tag:8s} M={M:<2d} floor {t['floor']:6.1f} old {t['old']:6.1f} tc {t['tc']:6.1f} "
              f"best {t['best']:6.1f} | bf16 skinny {bf[M]:6.1f} -> tc {bf[M] / t['tc']:.2f}x bf16, "
              f"{100 * t['floor'] / t['tc']:.0f}% of its floor", flush=True)
    tc_layer(Ms)


def tc_layer(Ms, check_only=False):
    """A Llama-8B decoder layer's four projections with their prologues, as the model runs them
    (qkv, gate_up: add + RMSNorm in front; down: SiLU * up; o: plain): bf16 (the fused skinny
    ops), and FP8 per channel / 128x128 blocks / w4a16 with the knob off (TC_MAX_M 0) and on (16).
    check_only: compare each quantized variant with its reference and return the failures."""
    from rankserve.kernels import fp8_prologue as P
    from rankserve.kernels.attention import rms_norm
    from rankserve.models.quantization import silu_mul
    eps, H, I = 1e-5, 4096, 14336

    def fp8_layer(bs):
        ws = [Q.quant_fp8_weight(torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, bs)
              for _, N, K in SHAPES]
        def run(h, d, nw, a, gu):
            (q0, s0), (q1, s1), (q2, s2), (q3, s3) = ws
            y0, _ = P.fp8_add_rms_norm_linear(h, d, nw, eps, q0, s0, None, bs)
            y1 = Q.fp8_linear(a, q1, s1, None, bs)
            y2, _ = P.fp8_add_rms_norm_linear(h, d, nw, eps, q2, s2, None, bs)
            return y0, y1, y2, P.fp8_silu_mul_linear(gu, q3, s3, None, bs)
        def ref(h, d, nw, a, gu):
            x = rms_norm(h + d, nw, eps)
            return tuple(Q.fp8_linear_ref(v, q, s, None, bs) for v, (q, s) in
                         zip((x, a, x, silu_mul(gu)), ws))
        return run, ref, sum(N * K for _, N, K in SHAPES)

    def w4_layer(zero):
        def make(N, K):
            qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
            sc = (torch.rand(K // 128, N, device="cuda") * 0.01).to(DT)
            z = torch.randint(0, 16, (K // 128, N), dtype=torch.uint8, device="cuda") if zero else None
            return qw, sc, z
        ws = [make(N, K) for _, N, K in SHAPES]
        lin = lambda x, w: Q.w4a16_linear(x, w[0], w[1], w[2], None, 128)  # noqa: E731
        def run(h, d, nw, a, gu):
            x, _ = gemv.add_rms_norm(h, d, nw, eps)
            return lin(x, ws[0]), lin(a, ws[1]), lin(x, ws[2]), lin(silu_mul(gu), ws[3])
        def ref(h, d, nw, a, gu):
            x = rms_norm(h + d, nw, eps)
            return tuple(Q.w4a16_linear_ref(v, w[0], w[1], w[2], None, 128) for v, w in
                         zip((x, a, x, silu_mul(gu)), ws))
        return run, ref, sum(N * K // 2 + (K // 128) * N * (3 if zero else 2) for _, N, K in SHAPES)

    def bf16_layer():
        ws = [torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5 for _, N, K in SHAPES]
        def run(h, d, nw, a, gu):
            y0, _ = gemv.add_rms_norm_linear(h, d, nw, eps, ws[0])
            y2, _ = gemv.add_rms_norm_linear(h, d, nw, eps, ws[2])
            return y0, gemv.skinny_linear(a, ws[1]), y2, gemv.silu_mul_linear(gu, ws[3])
        return run, None, sum(N * K * 2 for _, N, K in SHAPES)

    kinds = {"fp8chan": lambda: fp8_layer(None), "fp8blk": lambda: fp8_layer([128, 128]),
             "w4sym": lambda: w4_layer(False), "w4zp": lambda: w4_layer(True)}
    if not check_only:
        kinds = {"bf16": bf16_layer, **kinds}
        print("== Llama-8B layer, 4 projections + their prologues (per layer, inside a CUDA graph):"
              " knob off (TC_MAX_M 0) / on (16)", flush=True)
    bad, base = 0, {}
    for tag, make in kinds.items():
        layers = [make() for _ in range(1 if check_only else 2)]  # 2 copies: weights > L2
        nbytes = layers[0][2]
        for M in Ms:
            inp = (torch.randn(M, H, dtype=DT, device="cuda"), torch.randn(M, H, dtype=DT, device="cuda"),
                   torch.rand(H, dtype=DT, device="cuda") + 0.5, torch.randn(M, H, dtype=DT, device="cuda"),
                   torch.randn(M, 2 * I, dtype=DT, device="cuda"))
            t = {}
            for knob in ((0,) if tag == "bf16" else (0, 16)):
                Q.TC_MAX_M = knob
                if check_only:
                    run, ref, _ = layers[0]
                    try:
                        errs = [((o.float() - r.float()).norm() / r.float().norm()).item()
                                for o, r in zip(run(*inp), ref(*inp))]
                    except Exception as e:
                        errs = [float("inf")]
                        print(f"    layer {tag} raised {type(e).__name__}: {str(e)[:300]}", flush=True)
                    ok = max(errs) < 1e-2
                    bad += not ok
                    print(f"  layer {tag:8s} M={M:<2d} TC_MAX_M={knob:<2d} qkv/o/gate_up/down "
                          + " ".join(f"{e:.1e}" for e in errs) + ("  OK" if ok else "  FAIL"), flush=True)
                else:
                    try:
                        t[knob] = gtime([lambda lay=lay: lay[0](*inp) for lay in layers])
                    except Exception as e:
                        t[knob] = float("nan")
                        print(f"    layer {tag} TC_MAX_M={knob} raised {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
            Q.TC_MAX_M = 0
            if check_only:
                continue
            floor_us = nbytes / 4.8e12 * 1e6
            if tag == "bf16":
                base[M] = t[0]
                print(f"  bf16     M={M:<2d} {t[0]:6.1f}us ({nbytes / t[0] / 1e6:.2f} TB/s, floor {floor_us:.1f}us)",
                      flush=True)
            else:
                print(f"  {tag:8s} M={M:<2d} off {t[0]:6.1f}us on {t[16]:6.1f}us ({nbytes / t[16] / 1e6:.2f} TB/s,"
                      f" floor {floor_us:.1f}us = {100 * floor_us / t[16]:.0f}%) | bf16/on {base[M] / t[16]:.2f}x,"
                      f" bf16/off {base[M] / t[0]:.2f}x", flush=True)
        del layers
    return bad


if __name__ == "__main__":
    t0 = time.time()
    which = sys.argv[1:] or ["base", "fp8chan", "fp8blk", "w4sym", "w4zp"]
    fns = {"base": baselines, "bf16": bf16_sweep, "fp8chan": lambda M: fp8_sweep(M, False),
           "fp8blk": lambda M: fp8_sweep(M, True), "w4sym": lambda M: w4_sweep(M, False), "w4zp": lambda M: w4_sweep(M, True),
           "tc": lambda M: tc_compare()}
    for w in which:
        fns[w](1)
        print(f"[{time.time() - t0:.0f}s] {w} done", flush=True)
    json.dump({k: [(t, c) for t, c in v] for k, v in res.items()}, open(os.environ.get("OUT", "/tmp") + "/tune.json", "w"), indent=1)
