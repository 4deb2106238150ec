"""Wide tile sweep of the tensor-core FP8 skinny GEMM (kernels/quant_tc.py) at Llama-3.1-8B decode
shapes, M = 1, as the model runs them (qkv / gate_up / down read e4m3 activations quantized by
their prologue kernel, o_proj quantizes its input in its own prologue), per-channel and 128 x 128
block weights. Every config is compiled first, all at once on a thread pool
(kernels/precompile.py), then timed inside a CUDA graph over weight copies that defeat L2 (launch
gaps included, as in a decode step). Prints per shape the table's config and the 6 best, with
TB/s, and writes $OUT/tune_tc.json:

    python benchmarks/2026-12-04-h200-s8/tune_tc.py
"""
import itertools
import json
import math
import os
import time

import torch

from rankserve.kernels import precompile, quant as Q, quant_tc as T

DT = torch.bfloat16
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
L2 = torch.cuda.get_device_properties(0).L2_cache_size
SPACE = dict(BLOCK_N=[32, 64, 128], BLOCK_K=[128, 256, 512], NUM_STAGES=[3, 4, 6], num_warps=[4, 8],
             SPLIT=[1, 2, 4, 8])


def gtime(fns, reps=3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(11):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] * 1000 / (reps * len(fns))


def main():
    out_dir = os.environ.get("OUT", ".")
    cfgs = [dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())]
    orig = T.tc_config
    res = {}
    for block in (None, [128, 128]):
        kind = "fp8blk" if block else "fp8chan"
        cases = []
        for name, N, K in SHAPES:
            nbytes = N * K
            w = [Q.quant_fp8_weight(torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, block)
                 for _ in range(max(2, math.ceil(3 * L2 / nbytes)))]
            x = torch.randn(1, K, dtype=DT, device="cuda")
            fuse = name == "o"
            xq, xs = Q.quant_fp8_triton(x, 128 if block else 0)
            out = torch.empty(1, N, dtype=DT, device="cuda")

            def call(wq, ws, cfg, x=x, xq=xq, xs=xs, out=out, fuse=fuse):
                T.tc_config = lambda *a, **k: dict(orig(*a, **k), **cfg)
                try:
                    if fuse:
                        return T.fp8_tc(x, wq, ws, None, block, out, fuse_quant=True)
                    return T.fp8_tc(xq, wq, ws, None, block, out, prequant=xs)
                finally:
                    T.tc_config = orig
            cases.append((name, N, K, nbytes, w, x, call))
        space = [c for c in cfgs if not block or c["BLOCK_K"] <= 128]  # block: BLOCK_K divides 128
        t0 = time.time()
        with precompile.compile_only(torch.device("cuda")) as pool:
            for case, cfg in itertools.product(cases, space):
                try:
                    case[6](*case[4][0], cfg)
                except Exception:
                    pass
        print(f"{kind}: compiled {pool.submitted} variants in {time.time() - t0:.1f} s", flush=True)
        for name, N, K, nbytes, w, x, call in cases:
            ref = Q.fp8_linear_ref(x, *w[0], None, block).float()
            table = gtime([lambda wq=wq, ws=ws: call(wq, ws, {}) for wq, ws in w])
            rows = []
            for cfg in space:
                try:
                    got = call(*w[0], cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print(f"  {kind} {name} {cfg}: error {err:.2e}", flush=True)
                        continue
                    rows.append((gtime([lambda wq=wq, ws=ws, cfg=cfg: call(wq, ws, cfg) for wq, ws in w]), cfg))
                except Exception as e:  # does not compile / fit
                    print(f"  {kind} {name} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
            rows.sort(key=lambda r: r[0])
            table_cfg = orig("fp8blk" if block else "fp8", 1, N, K, True, prologue=name == "o")
            print(f"{kind} {name} {N}x{K}: floor {nbytes / 4.8e6:.1f} us | table {table:.1f} us "
                  f"({nbytes / table / 1e6:.2f} TB/s) {table_cfg}",
                  flush=True)
            for t, cfg in rows[:6]:
                print(f"    {t:6.1f} us {nbytes / t / 1e6:.2f} TB/s {cfg}", flush=True)
            res[f"{kind} {name}"] = dict(table_us=table, best=[(t, c) for t, c in rows[:12]])
            del w
    json.dump(res, open(os.path.join(out_dir, "tune_tc.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
