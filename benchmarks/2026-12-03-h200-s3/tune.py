"""Tile-config sweep of the skinny decode GEMMs (bf16 gemv, FP8 per channel / 128x128 blocks,
w4a16) at Llama-8B decode shapes, M = 1, each call timed inside a CUDA graph over enough weight
copies to defeat L2 (launch gaps included, as in a decode step). Prints the best configs per
shape with GB/s against the 4.8 TB/s floor, and writes $OUT/tune.json (CUDA only):

    python benchmarks/2026-12-03-h200-s3/tune.py base fp8chan w4sym fp8blk bf16 w4zp
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

if __name__ == "__main__":
    t0 = time.time()
    which = sys.argv[1:] or ["base", "fp8chan", "fp8blk", "w4sym", "w4zp"]
    fns = {"base": baselines, "bf16": bf16_sweep, "fp8chan": lambda M: fp8_sweep(M, False),
           "fp8blk": lambda M: fp8_sweep(M, True), "w4sym": lambda M: w4_sweep(M, False), "w4zp": lambda M: w4_sweep(M, True)}
    for w in which:
        fns[w](1)
        print(f"[{time.time() - t0:.0f}s] {w} done", flush=True)
    json.dump({k: [(t, c) for t, c in v] for k, v in res.items()}, open(os.environ.get("OUT", "/tmp") + "/tune.json", "w"), indent=1)
