"""Registers, spills and shared memory of the split-KV decode kernel per tile config, compiled on a
CPU machine for sm_90 with Triton's bundled ptxas (no GPU needed). The kernel's integer strides
and pointers get Triton's divisibility-by-16 specialisation, as at a real launch (without it the
K/V loads come out scalar: 272 `ld.global.b16`, and the numbers mean nothing).

    python benchmarks/2026-12-05-s13-ptxas/ptxas_decode.py [BLOCK_N,STAGES,WARPS[,fp8][,prep][,lpt][,sN] ...]

(fp8: an fp8 KV cache; prep: the fused q/k RoPE + KV store; lpt: RANKSERVE_DECODE_LPT's grid and
order; sN: N splits, W2's shape, so partials and the early exit of empty segments)
"""
from __future__ import annotations

import glob
import inspect
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rankserve.kernels import triton_attention as ta

DEFAULT = ["128,2,4", "128,2,8", "64,2,4", "64,2,8", "32,4,4", "128,2,4,fp8", "128,2,8,fp8",
           "128,2,4,prep", "128,2,4,fp8,prep", "128,2,4,lpt", "128,2,4,s64", "128,2,4,prep,s64"]


def compile_one(cfg: str) -> str:
    parts = cfg.split(",")
    bn, stages, warps = map(int, parts[:3])
    fp8, prep, lpt = "fp8" in parts, "prep" in parts, "lpt" in parts
    splits = next((int(p[1:]) for p in parts if p.startswith("s")), 1)
    fn = ta._decode_split_kernel
    names = list(inspect.signature(fn.fn).parameters)
    # W1's shape (Qwen3-0.6B: 16 q / 8 kv heads, head_dim 128, 16-token blocks)
    const = dict(NUM_HEADS=16, HEAD_DIM=128, GROUP=2, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_N=bn,
                 BLOCK_D=128, NUM_SPLITS=splits, ONLY_DECODE=False, KV_FP8=fp8, SOFTCAP=False,
                 IEEE=False, USE_PDL=False, PREPARE=prep, HAS_NORM=prep, NUM_KV_HEADS=8,
                 LPT=lpt, HAS_ORDER=lpt)
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ("k_cache_ptr", "v_cache_ptr"):
            sig[n] = "*fp8e4nv" if fp8 else "*bf16"
        elif n in ("part_out_ptr", "part_lse_ptr", "k_scale_ptr", "v_scale_ptr", "cos_sin_ptr"):
            sig[n] = "*fp32"
        elif n in ("qsl_ptr", "seq_lens_ptr", "bt_ptr", "order_ptr"):
            sig[n] = "*i32"
        elif n in ("pos_ptr", "slot_ptr"):
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        elif n in ("scale_log2e", "softcap_log2e", "eps"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in const and (n.endswith("_ptr") or n.startswith("stride"))}
    k = triton.compile(ASTSource(fn, signature=sig, attrs=attrs,
                                 constexprs={(names.index(n),): v for n, v in const.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*"))[0]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    info = "; ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                     if "registers" in line or "spill" in line)
    return f"{cfg:>18}  smem {k.metadata.shared:>6} B  {info}"


if __name__ == "__main__":
    for cfg in sys.argv[1:] or DEFAULT:
        print(compile_one(cfg), flush=True)
