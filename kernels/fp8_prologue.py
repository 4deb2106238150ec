"""The decode-layer prologues of FP8 linear layers, with the activation quantization fused in:

  fp8_add_rms_norm_linear(h, delta, norm_w, eps, w, w_scale, bias, block_size)
        -> (fp8_linear(rmsnorm(h + delta), w, ...), h + delta)                   (qkv, gate_up)
  fp8_silu_mul_linear(gu, w, w_scale, bias, block_size)
        -> fp8_linear(silu(gu[:, :I]) * gu[:, I:], w, ...)                        (down)

the FP8 counterparts of kernels/gemv.py's add_rms_norm_linear / silu_mul_linear. At M <=
quant.TC_MAX_M rows: one prologue kernel (a program per row, the row in registers) computes the
layer's input exactly as the model code rounds it (gemv.py's helpers) and quantizes it to e4m3
(per token, or per 1 x bk group for block weights) in the same pass, then the tensor-core GEMM
(kernels/quant_tc.py) reads the fp8 activations: two launches for add + norm + quant + GEMM.
Larger M, or a group the kernel cannot split (bk not a power of 2 or K not a multiple of it):
the 16-bit prologue kernel, then fp8_linear (which quantizes itself).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import quant as Q
from .attention import rms_norm
from .gemv import (ADD_RMS_NORM, SILU_MUL, _add, _rms_scale, _silu_mul, add_rms_norm_triton,
                   silu_mul_ref, silu_mul_triton)
from .custom_op import custom_op


@triton.jit
def _prologue_fp8_kernel(a_ptr, b_ptr, nw_ptr, h_out_ptr, q_ptr, s_ptr, K, eps, stride_sm,
                         PROLOGUE: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                         EMULATE: tl.constexpr):
    # one program per row: x = the prologue's output (rounded to the activation dtype, as the
    # model code does), then q = fp8(x / scale) with scale per row (GROUP 0) or per GROUP columns
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if PROLOGUE == 1:  # ADD_RMS_NORM: a = h, b = delta
        hn = _add(tl.load(a_ptr + row * K + offs, mask=mask, other=0.0),
                  tl.load(b_ptr + row * K + offs, mask=mask, other=0.0))
        tl.store(h_out_ptr + row * K + offs, hn, mask=mask)
        hf = hn.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(hf * hf, 0) / K + eps)
        x = _rms_scale(hn, rstd, tl.load(nw_ptr + offs, mask=mask, other=0.0))
    else:  # SILU_MUL: a = gu [M, 2K]
        x = _silu_mul(tl.load(a_ptr + row * 2 * K + offs, mask=mask, other=0.0),
                      tl.load(a_ptr + row * 2 * K + K + offs, mask=mask, other=0.0))
    xf = x.to(tl.float32)
    if GROUP == 0:
        scale, inv = Q._act_scale(tl.max(tl.abs(xf), 0))
        tl.store(q_ptr + row * K + offs, Q._to_fp8(xf * inv, EMULATE), mask=mask)
        tl.store(s_ptr + row * stride_sm, scale)
    else:
        xg = tl.reshape(xf, [BLOCK // GROUP, GROUP])
        scale, inv = Q._act_scale(tl.max(tl.abs(xg), 1))
        qg = Q._to_fp8(xg * inv[:, None], EMULATE)
        tl.store(q_ptr + row * K + tl.reshape(offs, [BLOCK // GROUP, GROUP]), qg,
                 mask=tl.reshape(mask, [BLOCK // GROUP, GROUP]))
        gi = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + row * stride_sm + gi, scale, mask=gi < K // GROUP)


def _group(block_size) -> int:
    return 0 if block_size is None else block_size[1]


def _fused_ok(M: int, K: int, block_size) -> bool:
    """The fused prologue + tensor-core GEMM serves this call."""
    if not 0 < M <= Q.TC_MAX_M:
        return False
    g = _group(block_size)
    return g == 0 or (g % 32 == 0 and g & (g - 1) == 0 and K % g == 0)


def prologue_fp8(prologue: int, a, K: int, block_size, b=None, norm_w=None, eps=0.0):
    """-> (q fp8 [M, K], scale fp32 [M, 1 or K / bk], h + delta or None): one launch."""
    M = a.shape[0]
    g = _group(block_size)
    q = torch.empty(M, K, dtype=Q.FP8, device=a.device)
    s = torch.empty(M, K // g if g else 1, dtype=torch.float32, device=a.device)
    h_new = torch.empty_like(a) if prologue == ADD_RMS_NORM else None
    block = triton.next_power_of_2(K)
    _prologue_fp8_kernel[(M,)](a, b, norm_w, h_new, q, s, K, eps, s.stride(0), PROLOGUE=prologue,
                               GROUP=g, BLOCK=block, EMULATE=Q._INTERPRET,
                               num_warps=min(max(block // 512, 1), 16))
    return q, s, h_new


def _tc_gemm(q, s, w, w_scale, bias, block_size, dtype):
    from .quant_tc import fp8_tc
    out = torch.empty(q.shape[0], w.shape[0], dtype=dtype, device=q.device)
    return fp8_tc(q, w.contiguous(), w_scale.float().contiguous(), bias, block_size, out, prequant=s)


def fp8_add_rms_norm_linear_triton(h, delta, norm_w, eps, w, w_scale, bias=None,
                                   block_size=None):
    h, delta = h.contiguous(), delta.contiguous()
    M, K = h.shape
    if not _fused_ok(M, K, block_size):
        x, h_new = add_rms_norm_triton(h, delta, norm_w, eps)
        return Q.fp8_linear_triton(x, w, w_scale, bias, block_size), h_new
    q, s, h_new = prologue_fp8(ADD_RMS_NORM, h, K, block_size, delta, norm_w, eps)
    return _tc_gemm(q, s, w, w_scale, bias, block_size, h.dtype), h_new


def fp8_silu_mul_linear_triton(gu, w, w_scale, bias=None, block_size=None):
    gu = gu.contiguous()
    M, K = gu.shape[0], gu.shape[1] // 2
    if not _fused_ok(M, K, block_size):
        return Q.fp8_linear_triton(silu_mul_triton(gu), w, w_scale, bias, block_size)
    q, s, _ = prologue_fp8(SILU_MUL, gu, K, block_size)
    return _tc_gemm(q, s, w, w_scale, bias, block_size, gu.dtype)


# ----------------------------------------------------------------------------------------------
# ops (the references: the unfused model code, then fp8_linear's reference)
# ----------------------------------------------------------------------------------------------

@custom_op("rankserve::fp8_add_rms_norm_linear", mutates_args=())
def fp8_add_rms_norm_linear(h: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor,
                            eps: float, w: torch.Tensor, w_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, block_size: list[int] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [M, K], w [N, K] fp8 with its scales -> (fp8_linear(rmsnorm(h + delta)), h + delta)."""
    if Q._use_triton(h):
        return fp8_add_rms_norm_linear_triton(h, delta, norm_w, eps, w, w_scale, bias, block_size)
    h_new = h + delta
    return Q.fp8_linear_ref(rms_norm(h_new, norm_w, eps), w, w_scale, bias, block_size), h_new


@fp8_add_rms_norm_linear.register_fake
def _(h, delta, norm_w, eps, w, w_scale, bias=None, block_size=None):
    return h.new_empty(h.shape[0], w.shape[0]), torch.empty_like(h)


@custom_op("rankserve::fp8_silu_mul_linear", mutates_args=())
def fp8_silu_mul_linear(gu: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, block_size: list[int] | None = None
                        ) -> torch.Tensor:
    """gu [M, 2I] (gate | up), w [N, I] fp8 with its scales -> fp8_linear(silu(gate) * up)."""
    if Q._use_triton(gu):
        return fp8_silu_mul_linear_triton(gu, w, w_scale, bias, block_size)
    return Q.fp8_linear_ref(silu_mul_ref(gu), w, w_scale, bias, block_size)


@fp8_silu_mul_linear.register_fake
def _(gu, w, w_scale, bias=None, block_size=None):
    return gu.new_empty(gu.shape[0], w.shape[0])
