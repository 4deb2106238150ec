"""Quantized GEMMs (issue #14): FP8 W8A8 (per-channel and DeepSeek-style block scales) and 4-bit
weight-only (GPTQ / AWQ, one internal layout), each a registered custom op with a plain-torch
reference beside it.

FP8 (float8_e4m3fn, FP8_MAX 448):
  quant_fp8_per_token(x)            -> q [M, K] fp8, scale [M, 1] fp32
  quant_fp8_per_group(x, g)         -> q [M, K] fp8, scale [M, ceil(K/g)] fp32   (1 x g groups)
  quant_fp8_weight(w, block_size)   -> q [N, K] fp8, scale [N] or [ceil(N/bn), ceil(K/bk)] fp32
  fp8_linear(x, w, w_scale, bias, block_size)  y = x @ (q * scale).T + bias, activations quantized
                                    dynamically inside (per token, or per 1 x bk group)
  Activations: scale = max(amax, AMAX_FLOOR) / FP8_MAX (IEEE division), q = clamp(x * (1 / scale),
  +-FP8_MAX) cast with round-to-nearest-even (torch's cast). Weights: w ~= q * scale
  ("weight_scale_inv" semantics).

4-bit weight-only: qweight int32 [K//8, N], nibble j (bits 4j..4j+3) of qweight[i, n] is the
unsigned value of row k = 8i + j; scales [G, N] (x's dtype), zeros uint8 [G, N] or None (8),
g_idx int32 [K] or None (k // group_size). w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n].
  w4a16_linear(x, qweight, scales, zeros, g_idx, group_size, bias)

Kernels (CUDA, or CPU under TRITON_INTERPRET=1; otherwise the references run):
- activation quantization: one Triton kernel (per token: amax pass + quantize pass over the row;
  per group: one pass).
- fp8_linear, M <= FP8_SKINNY_M: a skinny split-N kernel, all rows in registers: each program
  streams a [BLOCK_N, K] slab of FP8 weights once, converts it in registers and multiplies it into
  every row; the activation quantization is fused into its A loads (per token: an amax pre-pass
  over the row, from L2; per group: the group's amax from the chunk itself). No padded tl.dot.
- fp8_linear, larger M: per channel on sm90+ in bf16, torch._scaled_mm (cuBLASLt, rowwise
  scales); otherwise one quant kernel + a Triton tl.dot GEMM on FP8 operands with fp32
  accumulation, block scales applied per K block (BLOCK_K divides bk), split-K for small grids.
- w4a16_linear, M <= W4_SKINNY_M: a skinny kernel dequantizing in registers (int -> float by the
  2^23 exponent trick, no int->float conversions); larger M: a tl.dot GEMM on (q - zero) in x's
  dtype (exact) with the group scale applied to the accumulator per K block (or fully dequantized
  tiles with g_idx / small groups); M >= W4_DEQUANT_M: dequantize to x's dtype, then cuBLAS.
  Both Triton paths use split-K when the grid is small.
Configs are picked from shapes, not autotuned (nothing is benchmarked under CUDA-graph capture);
the module-level thresholds are the knobs (`python -m rankserve.kernels.benchmark --only fp8 w4a16`
times the paths against each other).

Rounding: on the GPU the kernels cast fp32 -> fp8 with the hardware's round-to-nearest-even
(cvt.rn.satfinite), like torch. Triton's interpreter rounds ties away from zero and flushes fp8
subnormals, so under the interpreter the kernels first round the value onto the e4m3 grid with
integer arithmetic (RNE, subnormals kept) and cast an exact value: the quantized activations match
the torch reference bit for bit on CPU, and the tests check them exactly.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .custom_op import custom_op

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row gets scale AMAX_FLOOR / FP8_MAX (its q is 0 anyway)

# Dispatch thresholds (rows M of the GEMM); see the module doc. Guesses for an H200, to be set
# from `kernels/benchmark.py --only fp8 w4a16`.
FP8_SKINNY_M = 2      # fp8_linear rows up to which the skinny kernel runs (0: never)
USE_SCALED_MM = True  # per-channel, bf16, sm90+: torch._scaled_mm above FP8_SKINNY_M
W4_SKINNY_M = 1       # w4a16_linear rows up to which the skinny kernel runs (0: never)
W4_DEQUANT_M = 1024   # w4a16_linear rows from which it dequantizes the weight and calls cuBLAS
# rows up to which fp8_linear / w4a16_linear take the tensor-core skinny kernels of
# kernels/quant_tc.py before any path above (0: never); the runtime sets it from
# RANKSERVE_QUANT_TC_MAX_M (runtime/envs.py) at start-up
TC_MAX_M = 0


# ----------------------------------------------------------------------------------------------
# FP8 quantization, plain torch
# ----------------------------------------------------------------------------------------------

def _quant_rows(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xf [..., G] fp32 -> (q fp8, scale [..., 1]) with one scale per last-dim row."""
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quant_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_rows(x.float())


def quant_fp8_per_group_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    groups = -(-K // group_size)
    xf = F.pad(x.float(), (0, groups * group_size - K))  # a ragged last group
    q, scale = _quant_rows(xf.view(M, groups, group_size))
    return q.view(M, -1)[:, :K], scale.view(M, groups)


def quant_fp8_weight(w: torch.Tensor, block_size: list[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline weight quantization (`--quantization fp8` of a bf16 checkpoint): w [N, K] ->
    (q [N, K] fp8, scale fp32) with w ~= q * scale; scale [N] per output channel (block_size None)
    or [ceil(N/bn), ceil(K/bk)] per bn x bk block. Computed in fp32 on w's device."""
    N, K = w.shape
    wf = w.float()
    if block_size is None:
        scale = wf.abs().amax(1).clamp_min(AMAX_FLOOR) / FP8_MAX
        return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    bn, bk = block_size
    nb, kb = -(-N // bn), -(-K // bk)
    blocks = F.pad(wf, (0, kb * bk - K, 0, nb * bn - N)).view(nb, bn, kb, bk)
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
# FP8 helpers shared by the kernels (also used by kernels/moe.py)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rne_e4m3(v):
    """fp32 v, |v| <= 448 -> the nearest e4m3 value (ties to even) as fp32, in integer / exact
    arithmetic: normals keep 3 mantissa bits, subnormals (|v| < 2^-6) are multiples of 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # 0xFFF00000
    normal = rounded.to(tl.float32, bitcast=True)
    a = tl.abs(v)
    sub = (a + 16384.0) - 16384.0  # ulp(2^14) = 2^-9: the add rounds a to the subnormal grid
    sub = tl.where(bits < 0, -sub, sub)  # the sign bit: -0.0 stays -0.0, as in torch
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _fp8_grid(v, EMULATE: tl.constexpr):
    """fp32 -> fp32 values on the e4m3 grid (saturated, RNE): what .to(fp8).to(fp32) gives."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if EMULATE:
        return _rne_e4m3(v)
    return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _to_fp8(v, EMULATE: tl.constexpr):
    """fp32 -> float8e4nv, saturated, round to nearest even."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if EMULATE:
        v = _rne_e4m3(v)  # exact below: the interpreter's own rounding is not RNE
    return v.to(tl.float8e4nv)


@triton.jit
def _act_scale(amax):
    """(scale, 1 / scale) of an amax (fp32), IEEE-rounded like the torch reference."""
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.zeros_like(amax) + 448.0)
    return scale, tl.math.div_rn(tl.zeros_like(amax) + 1.0, scale)


# ----------------------------------------------------------------------------------------------
# activation quantization kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    # one program per row. GROUP 0: per token (amax pass, then quantize); else 1 x GROUP groups,
    # BLOCK = next_pow2(GROUP), one group per step.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if GROUP == 0:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            xv = tl.load(x_row + k0 + offs, mask=offs < K - k0, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xv))
        scale, inv = _act_scale(tl.max(amax, 0))
        for k0 in range(0, K, BLOCK):
            mask = offs < K - k0
            xv = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _to_fp8(xv * inv, EMULATE), mask=mask)
        tl.store(s_ptr + row * stride_sm, scale)
    else:
        for g in range(0, tl.cdiv(K, GROUP)):
            k0 = g * GROUP
            mask = (offs < GROUP) & (offs < K - k0)
            xv = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            scale, inv = _act_scale(tl.max(tl.abs(xv), 0))
            tl.store(q_row + k0 + offs, _to_fp8(xv * inv, EMULATE), mask=mask)
            tl.store(s_ptr + row * stride_sm + g, scale)


_INTERPRET = isinstance(_quant_fp8_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 at import


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def quant_fp8_triton(x: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (q fp8 [M, K], scale fp32 [M, 1] per token (group_size
    0) or [M, ceil(K / group_size)]). One launch."""
    M, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, triton.cdiv(K, group_size) if group_size else 1, dtype=torch.float32,
                    device=x.device)
    if M == 0:
        return q, s
    if group_size:
        block = triton.next_power_of_2(group_size)
    else:
        block = min(triton.next_power_of_2(K), 64 if _INTERPRET else 4096)
    _quant_fp8_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), s.stride(0), GROUP=group_size,
                            BLOCK=block, EMULATE=_INTERPRET, num_warps=4 if block >= 1024 else 1)
    return q, s


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, 1] fp32): x ~= q * scale. One Triton kernel on CUDA."""
    if _use_triton(x) and x.dim() == 2:
        return quant_fp8_triton(x)
    return quant_fp8_per_token_ref(x)


def quant_fp8_per_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, K // group_size] fp32), one scale per 1 x group_size
    group (a ragged last group is allowed: ceil(K / group_size) scales)."""
    if _use_triton(x):
        return quant_fp8_triton(x, group_size)
    return quant_fp8_per_group_ref(x, group_size)


# ----------------------------------------------------------------------------------------------
# FP8 linear: references
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


# ----------------------------------------------------------------------------------------------
# FP8 linear: kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fp8_skinny_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       stride_wsn, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE: tl.constexpr):
    # Program = BLOCK_N output columns for all M (<= BLOCK_M) rows: the FP8 weight slab is read
    # from HBM once, converted once, and multiplied into every row (elementwise partial sums,
    # reduced once after the loop). The activations are quantized on the fly from x (L2).
    # GROUP_K 0: per-token / per-channel scales, applied after the loop. Else block scales:
    # BLOCK_K = next_pow2(GROUP_K), one activation group per step, BLOCK_N divides GROUP_N so
    # the step's weight scale is one number, folded into the (quantized) activations.
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    if GROUP_K == 0:
        amax = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xa = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            amax = tl.maximum(amax, tl.abs(xa.to(tl.float32)))
        scale, inv = _act_scale(tl.max(amax, 1))
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = offs_k < K - k0
            xa = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = _fp8_grid(xa.to(tl.float32) * inv[:, None], EMULATE)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * a[:, None, :]
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        out = tl.sum(acc, 2) * scale[:, None] * ws[None, :]
    else:
        ws_row = ws_ptr + ((pid_n * BLOCK_N) // GROUP_N) * stride_wsn
        for g in tl.range(0, tl.cdiv(K, GROUP_K), num_stages=NUM_STAGES):
            k0 = g * GROUP_K
            k_mask = (offs_k < GROUP_K) & (offs_k < K - k0)
            xa = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            xa = xa.to(tl.float32)
            scale, inv = _act_scale(tl.max(tl.abs(xa), 1))
            a = _fp8_grid(xa * inv[:, None], EMULATE) * (scale * tl.load(ws_row + g))[:, None]
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * a[:, None, :]
        out = tl.sum(acc, 2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program_id(0), in GROUP_M-row bands for L2 reuse."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, k_per_split,
                     stride_am, stride_asm, stride_wsn, stride_ym, stride_ys,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    # y = (a * sa) @ (w * sw).T on FP8 operands (tl.dot, fp32 accumulation). a [M, K] fp8 with
    # sa [M, 1] (GROUP_K 0) or [M, ceil(K/GROUP_K)]; w [N, K] fp8 with sw [N] or
    # [ceil(N/GROUP_N), ceil(K/GROUP_K)]. Block scales are applied per K block (BLOCK_K divides
    # GROUP_K). program_id(1) is the split-K index: it writes fp32 partials at y + pid_k * stride_ys.
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if GROUP_K == 0:  # summed in fp32 per K step (Hopper's FP8 MMA accumulates imprecisely)
            acc += tl.dot(a, b)
        else:
            sa = tl.load(as_ptr + offs_m * stride_asm + k0 // GROUP_K, mask=m_mask, other=0.0)
            sw = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_wsn + k0 // GROUP_K, mask=n_mask,
                         other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sw[None, :]
    if GROUP_K == 0:
        sa = tl.load(as_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)
        acc *= sa[:, None] * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_k(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Split K until the grid covers the GPU about twice (at least 4 K blocks per split)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while tiles * split < 2 * sms and k_blocks // (split * 2) >= 4 and split < 16:
        split *= 2
    return split


def _gemm_config(M: int, on_gpu: bool) -> dict:
    """Tile shapes for the tl.dot GEMMs (fp8 and w4a16) from M only."""
    if not on_gpu:  # interpreter: small tiles, ragged edges on small tests
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)


def _launch_gemm(kernel, M, N, K, out, bias, cfg, split, args, strides_after, **consts):
    """Runs a split-K-capable tl.dot GEMM kernel into out [M, N] (fp32 partials + sum when
    split > 1). args: the kernel's pointer args before bias; strides_after: stride args
    between k_per_split and (stride_ym, stride_ys)."""
    bk = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)
    meta = {k: v for k, v in cfg.items()}
    if split == 1:
        kernel[grid](*args, bias, out, M, N, K, k_per_split, *strides_after, out.stride(0), 0,
                     HAS_BIAS=bias is not None, GROUP_M=8, **consts, **meta)
        return out
    part = torch.empty(split, M, N, dtype=torch.float32, device=out.device)
    kernel[grid](*args, None, part, M, N, K, k_per_split, *strides_after, N, M * N,
                 HAS_BIAS=False, GROUP_M=8, **consts, **meta)
    y = part.sum(0)
    if bias is not None:
        y += bias.float()
    out.copy_(y)
    return out


def _skinny_fp8_config(M: int, group_k: int, on_gpu: bool) -> dict:
    block_m = triton.next_power_of_2(M)
    if not on_gpu:
        return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=32 if not group_k else
                    triton.next_power_of_2(group_k), NUM_STAGES=1, num_warps=4)
    if group_k:  # one group (typically 128) a step: more steps in flight instead
        return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=triton.next_power_of_2(group_k),
                    NUM_STAGES=6, num_warps=4)
    # a [16, 512 / BLOCK_M] fp8 weight tile a step, acc of 8192 fp32 over 128 threads
    return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=max(512 // block_m, 64), NUM_STAGES=4,
                num_warps=4)


def fp8_skinny(x2, w, w_scale, bias, block_size, out):
    """The skinny kernel (fused activation quantization), M <= 16 rows."""
    M, K = x2.shape
    N = w.shape[0]
    group_n, group_k = (block_size[0], block_size[1]) if block_size is not None else (1, 0)
    cfg = _skinny_fp8_config(M, group_k, x2.is_cuda)
    if group_k:  # BLOCK_N must divide bn (one weight scale a step)
        while group_n % cfg["BLOCK_N"]:
            cfg["BLOCK_N"] //= 2
    ws = w_scale if block_size is not None else w_scale.reshape(N)
    _fp8_skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x2, w, ws, bias, out, M, N, K, x2.stride(0), out.stride(0),
        ws.stride(0) if block_size is not None else 0, GROUP_N=group_n, GROUP_K=group_k,
        HAS_BIAS=bias is not None, EMULATE=_INTERPRET, **cfg)
    return out


def fp8_gemm(x2, w, w_scale, bias, block_size, out, split=None):
    """Quant kernel, then the tl.dot GEMM on FP8 operands (split-K for small grids)."""
    M, K = x2.shape
    N = w.shape[0]
    cfg = _gemm_config(M, x2.is_cuda)
    if block_size is None:
        group_n, group_k = 1, 0
        xq, xs = quant_fp8_triton(x2)
        ws, stride_wsn = w_scale.reshape(N), 0
    else:
        group_n, group_k = block_size
        assert group_k % 16 == 0, f"fp8_linear: block bk={group_k} must be a multiple of 16"
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_k & -group_k)  # a power of 2 dividing bk
        xq, xs = quant_fp8_triton(x2, group_k)
        ws, stride_wsn = w_scale, w_scale.stride(0)
    if split is None:
        tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
        split = _split_k(tiles, triton.cdiv(K, cfg["BLOCK_K"]), x2.device)
    return _launch_gemm(_fp8_gemm_kernel, M, N, K, out, bias, cfg, split, (xq, xs, w, ws),
                        (xq.stride(0), xs.stride(0), stride_wsn), GROUP_N=group_n,
                        GROUP_K=group_k)


@functools.cache
def _has_rowwise_scaled_mm(device_index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _scaled_mm_ok(x2, w, block_size) -> bool:
    N, K = w.shape
    return (USE_SCALED_MM and x2.is_cuda and block_size is None and x2.dtype == torch.bfloat16
            and N % 16 == 0 and K % 16 == 0
            and _has_rowwise_scaled_mm(x2.device.index if x2.device.index is not None
                                       else torch.cuda.current_device()))


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, block_size: list[int] | None = None
                      ) -> torch.Tensor:
    _check_fp8_args(x, w, w_scale, block_size)
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    w = w if w.is_contiguous() else w.contiguous()
    w_scale = w_scale.float()
    if not w_scale.is_contiguous():
        w_scale = w_scale.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        pass
    elif M <= TC_MAX_M and (block_size is None or block_size[1] % 32 == 0):
        from .quant_tc import fp8_tc  # (quant_tc builds on this module's helpers)
        fp8_tc(x2, w, w_scale, bias, block_size, out)
    elif M <= FP8_SKINNY_M and (block_size is None or block_size[1] <= 256):
        fp8_skinny(x2, w, w_scale, bias, block_size, out)
    elif _scaled_mm_ok(x2, w, block_size):
        xq, xs = quant_fp8_triton(x2)
        out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, N),
                               out_dtype=torch.bfloat16)
        if bias is not None:
            out += bias
    else:
        fp8_gemm(x2, w, w_scale, bias, block_size, out)
    return out.view(*x.shape[:-1], N)


@custom_op("rankserve::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, block_size: list[int] | None = None
               ) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32), w [N, K] float8_e4m3fn, w_scale fp32 [N] (per channel)
    or [ceil(N/bn), ceil(K/bk)] (block_size [bn, bk]) -> y [..., N] in x.dtype. Activations are
    quantized inside: per token (per channel) or per 1 x bk group (block)."""
    if _use_triton(x):
        return fp8_linear_triton(x, w, w_scale, bias, block_size)
    return fp8_linear_ref(x, w, w_scale, bias, block_size)


@fp8_linear.register_fake
def _(x, w, w_scale, bias=None, block_size=None):
    return x.new_empty(*x.shape[:-1], w.shape[0])


# ----------------------------------------------------------------------------------------------
# 4-bit weight-only: layout helpers and references
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


def _check_w4_args(x, qweight, scales, zeros, g_idx, group_size):
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    assert qweight.dtype == torch.int32, f"w4a16_linear: qweight must be int32, got {qweight.dtype}"
    assert x.shape[-1] == K, f"w4a16_linear: x [..., {x.shape[-1]}] vs K={K}"
    assert scales.shape[1] == N and (zeros is None or zeros.shape == scales.shape), \
        "w4a16_linear: scales / zeros must be [groups, N]"
    assert g_idx is not None or scales.shape[0] >= -(-K // group_size), \
        f"w4a16_linear: {scales.shape[0]} groups for K={K}, group_size={group_size}"


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, fp32 math on the exactly dequantized weight; result in x.dtype."""
    _check_w4_args(x, qweight, scales, zeros, g_idx, group_size)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    y = x.reshape(-1, K).float() @ dequant_w4(qweight, scales, zeros, g_idx, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------
# 4-bit weight-only: kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _w4_scale_zero(s_ptr, z_ptr, g_ptr, rows, offs_n, mask, N, group_size,
                   HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr):
    """(scale, 2^23 + zero) as fp32 [len(rows), BLOCK_N] for input rows `rows`."""
    if HAS_GIDX:
        g = tl.load(g_ptr + rows)  # the callers clamp rows to K - 1
    else:
        g = rows // group_size
    idx = g.to(tl.int64)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + idx, mask=mask, other=0).to(tl.float32) + 8388608.0
    else:
        z = tl.zeros_like(s) + 8388616.0
    return s, z


@triton.jit
def _nibbles(p, j):
    """fp32 2^23 + nibble j of int32 p: the exponent trick instead of an int -> float convert."""
    return (((p >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _w4_skinny_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr, M, N, K, group_size,
                      k_per_split, stride_xm, stride_ym, stride_ys, HAS_ZERO: tl.constexpr,
                      HAS_GIDX: tl.constexpr, CHUNK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    # Program = (BLOCK_N columns, one K split) for all M (<= BLOCK_M) rows. Each step loads a
    # [BLOCK_K / 8, BLOCK_N] int32 tile (N contiguous), and for each nibble j dequantizes the rows
    # k0 + 8i + j and multiplies them into every row of x (elementwise partial sums, reduced once
    # after the loop). CHUNK_GROUP: the step lies in one group (one scale / zero row a step).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_i = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + 8 * offs_i[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_K // 8, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        i_mask = offs_i < (K - k0) // 8
        mask = i_mask[:, None] & n_mask[None, :]
        p = tl.load(qw_ptr + (k0 // 8 + offs_i).to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=mask, other=0)
        if CHUNK_GROUP:
            s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, k0 + tl.zeros([1], tl.int32), offs_n,
                                  n_mask[None, :], N, group_size, HAS_ZERO, False)
        elif not HAS_GIDX:  # group_size % 8 == 0: the 8 rows of a packed row share one group
            s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, tl.minimum(k0 + 8 * offs_i, K - 1),
                                  offs_n, mask, N, group_size, HAS_ZERO, False)
        for j in tl.static_range(8):
            if HAS_GIDX:
                rows = tl.minimum(k0 + 8 * offs_i + j, K - 1)
                s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, rows, offs_n, mask, N, group_size,
                                      HAS_ZERO, HAS_GIDX)
            w = (_nibbles(p, j) - z) * s
            xj = tl.load(x_ptrs + k0 + j, mask=m_mask[:, None] & i_mask[None, :], other=0.0)
            acc += w[None, :, :] * xj.to(tl.float32)[:, :, None]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w4_dot(acc, a, p, s_ptr, z_ptr, g_ptr, k0, K, N, offs_n, n_mask, group_size,
            HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr, CHUNK_GROUP: tl.constexpr,
            DOT_IEEE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ W^T[k0:k0 + BLOCK_K, offs_n], from p, the packed int32 tile
    [BLOCK_K / 8, BLOCK_N] of W^T (nibble j of row i = input row k0 + 8i + j) and the [G, N]
    scales / zeros: the int4 tile dequantized in registers. CHUNK_GROUP (the K block lies in one
    group): dot(a, q - zero) in a's dtype (exact small integers), times the group's scale row on
    the result; otherwise (g_idx, small groups) fully dequantized tiles (rounded to a's dtype).
    The w4a16 GEMM's step, and the 4-bit fused-MoE kernels' (kernels/moe.py)."""
    shifts = 4 * tl.arange(0, 8)
    q = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
    if CHUNK_GROUP:
        s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, k0 + tl.zeros([1], tl.int32), offs_n,
                              n_mask[None, :], N, group_size, HAS_ZERO, False)
        w = (qf - z).to(a.dtype)
        if DOT_IEEE:
            part = tl.dot(a, w, input_precision="ieee")
        else:
            part = tl.dot(a, w)
        acc += part * s
    else:
        rows = tl.minimum(k0 + tl.arange(0, BLOCK_K), K - 1)
        s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, rows, offs_n, n_mask[None, :], N,
                              group_size, HAS_ZERO, HAS_GIDX)
        w = ((qf - z) * s).to(a.dtype)
        if DOT_IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _w4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr, M, N, K, k_per_split,
                    group_size, stride_xm, stride_ym, stride_ys, HAS_ZERO: tl.constexpr,
                    HAS_GIDX: tl.constexpr, CHUNK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DOT_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # tl.dot GEMM dequantizing [BLOCK_K, BLOCK_N] weight tiles in registers (_w4_dot).
    # program_id(1): split-K index (fp32 partials).
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_i = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        i_mask = offs_i < (K - k0) // 8
        p = tl.load(qw_ptr + (k0 // 8 + offs_i).to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=i_mask[:, None] & n_mask[None, :], other=0)
        acc = _w4_dot(acc, a, p, s_ptr, z_ptr, g_ptr, k0, K, N, offs_n, n_mask, group_size,
                      HAS_ZERO, HAS_GIDX, CHUNK_GROUP, DOT_IEEE, BLOCK_K, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_k * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w4_dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, wt_ptr, N, K, group_size,
                       HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # W^T [K, N] in wt's dtype: program = [8 * BLOCK_I, BLOCK_N] rows of it
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_i < K // 8)[:, None] & (offs_n < N)[None, :]
    p = tl.load(qw_ptr + offs_i.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    for j in tl.static_range(8):
        rows = tl.minimum(8 * offs_i + j, K - 1)
        s, z = _w4_scale_zero(s_ptr, z_ptr, g_ptr, rows, offs_n, mask, N, group_size,
                              HAS_ZERO, HAS_GIDX)
        w = (_nibbles(p, j) - z) * s
        tl.store(wt_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :],
                 w.to(wt_ptr.dtype.element_ty), mask=mask)


def _w4_consts(zeros, g_idx, group_size, block_k) -> dict:
    """constexprs of the w4 kernels; CHUNK_GROUP: every BLOCK_K step lies in one group."""
    # the kernels' per-packed-row scale gathers assume whole packed rows in a group
    assert g_idx is not None or group_size % 8 == 0, f"w4a16: group_size {group_size} % 8 != 0"
    return dict(HAS_ZERO=zeros is not None, HAS_GIDX=g_idx is not None,
                CHUNK_GROUP=g_idx is None and group_size % block_k == 0)


def w4_dequant_t(qweight, scales, zeros, g_idx, group_size, dtype) -> torch.Tensor:
    """W^T [K, N] in dtype (one Triton kernel): the large-M path's operand for cuBLAS."""
    Kp, N = qweight.shape
    K = Kp * 8
    wt = torch.empty(K, N, dtype=dtype, device=qweight.device)
    block_i, block_n = (4, 16) if not qweight.is_cuda else (16, 128)
    _w4_dequant_kernel[(triton.cdiv(Kp, block_i), triton.cdiv(N, block_n))](
        qweight, scales, zeros, g_idx, wt, N, K, group_size, HAS_ZERO=zeros is not None,
        HAS_GIDX=g_idx is not None, BLOCK_I=block_i, BLOCK_N=block_n, num_warps=4)
    return wt


def _skinny_w4_config(M: int, on_gpu: bool) -> dict:
    block_m = triton.next_power_of_2(M)
    if not on_gpu:
        return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=64, NUM_STAGES=1, num_warps=4)
    # at M = 1 a [64 packed rows, 32 columns] int32 tile (8 KB, 128 B of each packed row) a step
    return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=max(512 // block_m, 64), NUM_STAGES=4,
                num_warps=4)


def w4_skinny(x2, qweight, scales, zeros, g_idx, group_size, bias, out, split=None):
    M, K = x2.shape
    N = qweight.shape[1]
    cfg = _skinny_w4_config(M, x2.is_cuda)
    consts = _w4_consts(zeros, g_idx, group_size, cfg["BLOCK_K"])
    if consts["HAS_GIDX"]:  # per-row scale / zero gathers: fewer stages (shared memory)
        cfg["NUM_STAGES"] = min(cfg["NUM_STAGES"], 2)
    bk = cfg["BLOCK_K"]
    if split is None:
        split = _split_k(triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(K, bk), x2.device)
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
    if split == 1:
        _w4_skinny_kernel[grid](x2, qweight, scales, zeros, g_idx, bias, out, M, N, K, group_size,
                                k_per_split, x2.stride(0), out.stride(0), 0,
                                HAS_BIAS=bias is not None, **consts, **cfg)
        return out
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    _w4_skinny_kernel[grid](x2, qweight, scales, zeros, g_idx, None, part, M, N, K, group_size,
                            k_per_split, x2.stride(0), N, M * N, HAS_BIAS=False, **consts, **cfg)
    y = part.sum(0)
    if bias is not None:
        y += bias.float()
    out.copy_(y)
    return out


def w4_gemm(x2, qweight, scales, zeros, g_idx, group_size, bias, out, split=None):
    M, K = x2.shape
    N = qweight.shape[1]
    cfg = _gemm_config(M, x2.is_cuda)
    consts = _w4_consts(zeros, g_idx, group_size, cfg["BLOCK_K"])
    if split is None:
        tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
        split = _split_k(tiles, triton.cdiv(K, cfg["BLOCK_K"]), x2.device)
    return _launch_gemm(_w4_gemm_kernel, M, N, K, out, bias, cfg, split,
                        (x2, qweight, scales, zeros, g_idx), (group_size, x2.stride(0)),
                        DOT_IEEE=x2.dtype == torch.float32, **consts)


def w4a16_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_w4_args(x, qweight, scales, zeros, g_idx, group_size)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    g_idx = g_idx.to(torch.int32).contiguous() if g_idx is not None else None
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        pass
    elif M <= TC_MAX_M:
        from .quant_tc import w4_tc
        w4_tc(x2, qweight, scales, zeros, g_idx, group_size, bias, out)
    elif M <= W4_SKINNY_M:
        w4_skinny(x2, qweight, scales, zeros, g_idx, group_size, bias, out)
    elif M >= W4_DEQUANT_M:
        wt = w4_dequant_t(qweight, scales, zeros, g_idx, group_size, x.dtype)
        out = torch.addmm(bias, x2, wt) if bias is not None else x2 @ wt
    else:
        w4_gemm(x2, qweight, scales, zeros, g_idx, group_size, bias, out)
    return out.view(*x.shape[:-1], N)


@custom_op("rankserve::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], qweight int32 [K//8, N], scales [G, N] (x.dtype), zeros uint8 [G, N] or None
    (symmetric: 8), g_idx int32 [K] or None (k // group_size), bias [N] -> y [..., N] in x.dtype."""
    if _use_triton(x):
        return w4a16_linear_triton(x, qweight, scales, zeros, g_idx, group_size, bias)
    return w4a16_linear_ref(x, qweight, scales, zeros, g_idx, group_size, bias)


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, g_idx, group_size, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])
