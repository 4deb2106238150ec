"""Why the block-FP8 fused MoE fails its GPU test at T = 64 / 1024 (session 16, H100: 2 of 3
`test_gpu_fused_moe_fp8[block_size1-*]` failed; per-channel and T = 1 passed). For each scale
kind x tile config, the kernel against the fp32 reference at Qwen3-30B-A3B sizes (128 experts,
top 8, H 2048, I 768): relative error of the whole output, of the gate-up activation alone, and
where the bad elements sit (row within the BLOCK_M tile, column within BLOCK_N): an error
spread evenly is precision, one confined to some rows / columns is indexing.

    python benchmarks/2026-12-05-s16/moe_fp8_diag.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import test_quant_kernels as tq  # noqa: E402

from rankserve.kernels import moe  # noqa: E402

CONFIGS = [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2),
           dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
           # one K step per 128 x 128 scale block (vLLM's block-FP8 MoE tiles)
           dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{'T':>5} {'scales':>9} {'config':>22} {'rel err':>8} {'err / row-in-tile (max 4 worst)':>40}")
    for T in (1, 64, 1024) if dev == "cuda" else (64,):
        for bs in (None, [128, 128]):
            args, kw, _ = tq.make_moe_fp8(T, 128, 8, 2048, 768, bs, drop=0.2, dtype=torch.bfloat16,
                                          device=dev, seed=T)
            ref = moe.fused_moe_ref(*args, **kw)
            base = moe._moe_config
            a_err, d_err = tq.moe_fp8_stage_errors(args, kw)  # (the GPU test's check)
            print(f"{T:>5} {'block' if bs else 'channel':>9} {'(table config)':>22} gate-up act "
                  f"{a_err:.4f}, output on its own act {d_err:.4f}", flush=True)
            for cfg in CONFIGS:
                moe._moe_config = lambda n, g, c=cfg: dict(c)
                out = moe.fused_moe_triton(*args, **kw)
                err = (out.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1).clamp_min(1e-6)
                worst = err.topk(min(4, T)).indices.tolist()
                name = f"{cfg['BLOCK_M']},{cfg['BLOCK_N']},{cfg['BLOCK_K']},{cfg['num_warps']}w,{cfg['num_stages']}s"
                print(f"{T:>5} {'block' if bs else 'channel':>9} {name:>22} {rel(out, ref):8.4f} "
                      f"worst tokens {worst} {[round(err[i].item(), 3) for i in worst]}", flush=True)
            moe._moe_config = base


if __name__ == "__main__":
    main()
