"""FP8 decode GEMMs at Llama-3.1-8B shapes, M = 1: the two-launch path (the prologue kernel of
kernels/fp8_prologue.py quantizes per token into e4m3, then the tc GEMM; o_proj: the quant kernel,
then the GEMM) against the one-launch path (the tc GEMM builds its input chunk by chunk and
quantizes it per 1 x 128 group), with a config sweep of the one-launch kernel. Each variant is
timed in a CUDA graph over weight copies that defeat L2 (launch gaps included, as in a decode
step); the layer rows time qkv, o, gate_up, down back to back. Prints per shape the table's config
and the best ones, and writes $OUT/fp8_layer.json:

    python benchmarks/2026-12-04-h200-s11/fp8_layer.py

It ran (call a) against commit 6d06a2a61d7997577cafd541c757b02c47bb5db9, whose fp8_tc took prologue= / delta= / norm_w= / h_out=;
the one-launch path lost (layer 90.6 us at its best configs against 77.4 us for two launches:
the per-step prologue and quantization inside the MMA loop stall its pipeline) and was taken out,
so this script needs that commit to run.
"""
import itertools
import json
import math
import os
import time

import torch

from rankserve.kernels import fp8_prologue as P, precompile, quant as Q, quant_tc as T
from rankserve.kernels.gemv import ADD_RMS_NORM, LINEAR, SILU_MUL

DT = torch.bfloat16
SHAPES = [("qkv", 6144, 4096, ADD_RMS_NORM), ("o", 4096, 4096, LINEAR),
          ("gate_up", 28672, 4096, ADD_RMS_NORM), ("down", 4096, 14336, SILU_MUL)]
L2 = torch.cuda.get_device_properties(0).L2_cache_size
SPACE = dict(BLOCK_N=[32, 64, 128], NUM_STAGES=[3, 4, 6, 8], num_warps=[4, 8], SPLIT=[1, 2, 4, 8])


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
    return ts[len(ts) // 2] * 1000 / reps


def main():
    out_dir = os.environ.get("OUT", ".")
    cfgs = [dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())]
    orig = T.tc_config
    res = {}
    Q.TC_MAX_M = 16
    T.reserve(torch.device("cuda"))
    for block in (None, [128, 128]):
        kind = "fp8blk" if block else "fp8chan"
        cases = []
        for name, N, K, pro in SHAPES:
            copies = max(2, math.ceil(3 * L2 / (N * K)))
            w = [Q.quant_fp8_weight(torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, block)
                 for _ in range(copies)]
            a = torch.randn(1, 2 * K if pro == SILU_MUL else K, dtype=DT, device="cuda")
            d = torch.randn(1, K, dtype=DT, device="cuda")
            nw = torch.rand(K, dtype=DT, device="cuda") + 0.5
            out, h_out = torch.empty(1, N, dtype=DT, device="cuda"), torch.empty(1, K, dtype=DT, device="cuda")
            kw = dict(delta=d, norm_w=nw, eps=1e-5, h_out=h_out) if pro == ADD_RMS_NORM else {}

            def one(wq, ws, cfg, a=a, out=out, pro=pro, kw=kw):
                T.tc_config = lambda *x, **k: dict(orig(*x, **k), **cfg)
                try:
                    if pro == LINEAR:
                        return T.fp8_tc(a, wq, ws, None, block, out)
                    return T.fp8_tc(a, wq, ws, None, block, out, prologue=pro, **kw)
                finally:
                    T.tc_config = orig

            def two(wq, ws, a=a, d=d, nw=nw, pro=pro, K=K):  # the session-10 path
                if pro == ADD_RMS_NORM:
                    q, s, _ = P.prologue_fp8(pro, a, K, block, d, nw, 1e-5)
                elif pro == SILU_MUL:
                    q, s, _ = P.prologue_fp8(pro, a, K, block)
                else:
                    q, s = Q.quant_fp8_triton(a, block[1] if block else 0)
                return P._tc_gemm(q, s, wq, ws, None, block, DT)
            cases.append((name, N, K, pro, w, one, two))
        t0 = time.time()
        with precompile.compile_only(torch.device("cuda")) as pool:
            for case, cfg in itertools.product(cases, cfgs):
                try:
                    case[5](*case[4][0], cfg)
                except Exception:
                    pass
        print(f"{kind}: compiled {pool.submitted} variants in {time.time() - t0:.1f} s", flush=True)
        layer_one, layer_two, layer_best = [], [], []
        for name, N, K, pro, w, one, two in cases:
            nbytes = N * K
            ref = two(*w[0]).float()
            t_two = gtime([lambda wq=wq, ws=ws: two(wq, ws) for wq, ws in w]) / len(w)
            t_one = gtime([lambda wq=wq, ws=ws: one(wq, ws, {}) for wq, ws in w]) / len(w)
            rows = []
            for cfg in cfgs:
                try:
                    got = one(*w[0], cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 6e-2:
                        print(f"  {kind} {name} {cfg}: error {err:.2e}", flush=True)
                        continue
                    rows.append((gtime([lambda wq=wq, ws=ws, cfg=cfg: one(wq, ws, cfg) for wq, ws in w]) / len(w), cfg))
                except Exception as e:  # does not compile / fit
                    print(f"  {kind} {name} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
            rows.sort(key=lambda r: r[0])
            table_cfg = orig("fp8blk" if block else "fp8", 1, N, K, True, prologue=True)
            print(f"{kind} {name} {N}x{K}: floor {nbytes / 4.25e6:.1f} us | two launches {t_two:.1f} us | "
                  f"one launch, table {t_one:.1f} us ({nbytes / t_one / 1e6:.2f} TB/s) {table_cfg}", flush=True)
            for t, cfg in rows[:6]:
                print(f"    {t:6.1f} us {nbytes / t / 1e6:.2f} TB/s {cfg}", flush=True)
            res[f"{kind} {name}"] = dict(two_us=t_two, table_us=t_one, best=rows[:12])
            layer_two.append(lambda i, two=two, w=w: two(*w[i % len(w)]))
            layer_one.append(lambda i, one=one, w=w: one(*w[i % len(w)], {}))
            if rows:
                layer_best.append(lambda i, one=one, w=w, c=rows[0][1]: one(*w[i % len(w)], c))
        for label, fns in (("two launches", layer_two), ("one launch, table", layer_one),
                           ("one launch, best", layer_best)):
            t = gtime([lambda i=i, f=f: f(i) for i in range(4) for f in fns]) / 4
            print(f"{kind} layer (qkv, o, gate_up, down), {label}: {t:.1f} us", flush=True)
            res[f"{kind} layer {label}"] = t
    json.dump(res, open(os.path.join(out_dir, "fp8_layer.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
