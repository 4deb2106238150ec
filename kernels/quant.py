"""Quantized GEMMs (issue #14): FP8 W8A8 (per-channel and DeepSeek-style block scales) and 4-bit
weight-only (GPTQ / AWQ, one internal layout), each a registered custom op with a plain-torch
reference beside it.

FP8 (float8_e4m3fn, FP8_MAX 448):
  quant_fp8_per_token(x)            -> q [M, K] fp8, scale [M, 1] fp32
  quant_fp8_per_group(x, g)         -> q [M, K] fp8, scale [M, ceil(K/g)] fp32   (1 x g groups)
  quant_fp8_weight(w, block_size)   -> q [N, K] fp8, scale [N] or [ceil(N/bn), ceil(K/bk)] fp32
  fp8_linear(x, w, w_scale, bias, block_size)  y = x @ (q * scale).T + bias, activations quantized
                                    dynamically inside (per token, or per 1 x bk group)
  scale = max(amax, AMAX_FLOOR) / FP8_MAX; q = clamp(x * (1 / scale), +-FP8_MAX) rounded to
  nearest even (torch's cast). w ~= q * scale ("weight_scale_inv" semantics).

4-bit weight-only: qweight int32 [K//8, N], nibble j (bits 4j..4j+3) of qweight[i, n] is the
unsigned value of row k = 8i + j; scales [G, N] (x's dtype), zeros uint8 [G, N] or None (8),
g_idx int32 [K] or None (k // group_size). w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n].
  w4a16_linear(x, qweight, scales, zeros, g_idx, group_size, bias)
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row gets scale AMAX_FLOOR / FP8_MAX (its q is 0 anyway)


# ----------------------------------------------------------------------------------------------
# FP8 quantization (plain torch)
# ----------------------------------------------------------------------------------------------

def _quant_rows(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xf [..., G] fp32 -> (q fp8, scale [..., 1]) with one scale per last-dim row."""
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quant_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _quant_rows(x.float())
    return q, scale


def quant_fp8_per_group_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    groups = -(-K // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - K))  # ragged last group
    q, scale = _quant_rows(xf.view(M, groups, group_size))
    return q.view(M, -1)[:, :K], scale.view(M, groups)


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, 1] fp32): x ~= q * scale."""
    return quant_fp8_per_token_ref(x)


def quant_fp8_per_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, K // group_size] fp32), one scale per 1 x group_size
    group (a ragged last group is allowed: ceil(K / group_size) scales)."""
    return quant_fp8_per_group_ref(x, group_size)


def quant_fp8_weight(w: torch.Tensor, block_size: list[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline weight quantization (`--quantization fp8` of a bf16 checkpoint): w [N, K] ->
    (q [N, K] fp8, scale fp32) with w ~= q * scale; scale [N] per output channel (block_size None)
    or [ceil(N/bn), ceil(K/bk)] per bn x bk block. Computed in fp32 on w's device."""
    N, K = w.shape
    wf = w.float()
    if block_size is None:
        amax = wf.abs().amax(1).clamp_min(AMAX_FLOOR)
        scale = amax / FP8_MAX
        return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    bn, bk = block_size
    nb, kb = -(-N // bn), -(-K // bk)
    wp = torch.nn.functional.pad(wf, (0, kb * bk - K, 0, nb * bn - N))
    blocks = wp.view(nb, bn, kb, bk)
    scale = blocks.abs().amax((1, 3)).clamp_min(AMAX_FLOOR) / FP8_MAX  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale


def dequant_fp8_weight(q: torch.Tensor, scale: torch.Tensor, block_size: list[int] | None = None
                       ) -> torch.Tensor:
    """q [N, K] fp8, scale [N] or [ceil(N/bn), ceil(K/bk)] -> fp32 [N, K] = q * scale."""
    N, K = q.shape
    if block_size is None:
        return q.float() * scale.float().reshape(N, 1)
    bn, bk = block_size
    s = scale.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return q.float() * s


# ----------------------------------------------------------------------------------------------
# FP8 linear
# ----------------------------------------------------------------------------------------------

def _check_fp8_args(x, w, w_scale, block_size):
    N, K = w.shape
    assert x.shape[-1] == K, f"fp8_linear: x [..., {x.shape[-1]}] vs w [{N}, {K}]"
    assert w.dtype == FP8, f"fp8_linear: w must be float8_e4m3fn, got {w.dtype}"
    if block_size is None:
        assert w_scale.numel() == N, f"fp8_linear: per-channel w_scale must have {N} entries"
    else:
        bn, bk = block_size
        assert tuple(w_scale.shape) == (-(-N // bn), -(-K // bk)), \
            f"fp8_linear: block w_scale {tuple(w_scale.shape)} vs w [{N}, {K}], block {block_size}"


def _quant_act_ref(x2: torch.Tensor, block_size) -> torch.Tensor:
    """The dynamic activation quantization of fp8_linear, dequantized again (fp32)."""
    if block_size is None:
        q, s = quant_fp8_per_token_ref(x2)
        return q.float() * s
    bk = block_size[1]
    q, s = quant_fp8_per_group_ref(x2, bk)
    return q.float() * s.repeat_interleave(bk, 1)[:, :x2.shape[1]]


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, block_size: list[int] | None = None
                   ) -> torch.Tensor:
    """Plain torch: the same activation quantization as the kernels, then fp32 math on the
    dequantized operands; result in x.dtype."""
    _check_fp8_args(x, w, w_scale, block_size)
    N, K = w.shape
    x2 = x.reshape(-1, K)
    y = _quant_act_ref(x2, block_size) @ dequant_fp8_weight(w, w_scale, block_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def _fp8_linear_impl(x, w, w_scale, bias, block_size):
    return fp8_linear_ref(x, w, w_scale, bias, block_size)


@torch.library.custom_op("rankserve::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, block_size: list[int] | None = None
               ) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32), w [N, K] float8_e4m3fn, w_scale fp32 [N] (per channel)
    or [ceil(N/bn), ceil(K/bk)] (block_size [bn, bk]) -> y [..., N] in x.dtype."""
    return _fp8_linear_impl(x, w, w_scale, bias, block_size)


@fp8_linear.register_fake
def _(x, w, w_scale, bias=None, block_size=None):
    return x.new_empty(*x.shape[:-1], w.shape[0])


# ----------------------------------------------------------------------------------------------
# 4-bit weight-only
# ----------------------------------------------------------------------------------------------

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j at bits 4j..4j+3


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers in 0..15 -> qweight int32 [K // 8, N] (rows 8i..8i+7 in nibbles 0..7)."""
    K, N = q.shape
    assert K % 8 == 0, f"pack_int4: K={K} must be a multiple of 8"
    v = q.to(torch.int64).view(K // 8, 8, N) & 0xF
    packed = (v << _SHIFTS.to(device=q.device, dtype=torch.int64)[None, :, None]).sum(1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)  # two's complement int32
    return packed.to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K // 8, N] -> uint8 [K, N] (values 0..15)."""
    Kp, N = qweight.shape
    shifts = _SHIFTS.to(qweight.device)[None, :, None]
    return ((qweight[:, None, :] >> shifts) & 0xF).to(torch.uint8).view(Kp * 8, N)


def _group_index(K: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(K, device=device) // group_size


def dequant_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """-> W [N, K] in fp32 (exact: (q - zero) * scale needs no rounding in fp32)."""
    q = unpack_int4(qweight)  # [K, N]
    K, N = q.shape
    g = _group_index(K, group_size, g_idx, q.device)
    z = zeros[g].float() if zeros is not None else 8.0
    return ((q.float() - z) * scales[g].float()).T


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, fp32 math on the exactly dequantized weight; result in x.dtype."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    assert x.shape[-1] == K, f"w4a16_linear: x [..., {x.shape[-1]}] vs K={K}"
    y = x.reshape(-1, K).float() @ dequant_w4(qweight, scales, zeros, g_idx, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def _w4a16_impl(x, qweight, scales, zeros, g_idx, group_size, bias):
    return w4a16_linear_ref(x, qweight, scales, zeros, g_idx, group_size, bias)


@torch.library.custom_op("rankserve::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], qweight int32 [K//8, N], scales [G, N], zeros uint8 [G, N] or None (8),
    g_idx int32 [K] or None (k // group_size), bias [N] -> y [..., N] in x.dtype."""
    return _w4a16_impl(x, qweight, scales, zeros, g_idx, group_size, bias)


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, g_idx, group_size, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])
