"""Multi-LoRA kernels: each token of a mixed batch gets its own adapter's low-rank update.

A LoRA layer adds `(x A^T) B^T` (the scaling folded into B at load time) to the base GEMM. The
adapters live in device slots: `a` [S, R, K] and `b` [S, N, R] hold S adapters (ranks padded
with zeros to R); a token's slot is `token_slot[t]` (-1: the base model, no update).

  lora_shrink(x, a, ...)  -> s [T, R] fp32     s[t] = a[slot(t)] @ x[t]
  lora_expand(s, b, ...)  -> d [T, N] fp32     d[t] = b[slot(t)] @ s[t]

Two kernels each:
  BGMV (decode): one program per (token, output tile); a batched gather-matrix-vector product.
  SGMV (prefill): one program per (segment, output tile), a segment being a run of tokens of one
       request (`seg_start` [B+1], `seg_slot` [B], i.e. the batch's query_start_loc): tl.dot over
       BLOCK_M tokens at a time, the adapter tile loaded once per token block.
Both read the same metadata layout and give the same result; the caller picks by batch shape.
Grids depend only on T and on the (fixed) length of the segment buffers, so CUDA graphs replay
them with new slot indices. Without CUDA or the Triton interpreter, the plain-torch references run
(a loop over the S slots with masks: no data-dependent shapes, so torch.compile traces it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


# ----------------------------------------------------------------------------------------------
# plain-torch references
# ----------------------------------------------------------------------------------------------

def ref_lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in range(a.shape[0]):
        m = (token_slot == s).unsqueeze(-1)
        out = out + torch.where(m, xf @ a[s].float().t(), 0.0)
    return out


def ref_lora_expand(s: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    sf = s.float()
    out = torch.zeros(s.shape[0], b.shape[1], dtype=torch.float32, device=s.device)
    for i in range(b.shape[0]):
        m = (token_slot == i).unsqueeze(-1)
        out = out + torch.where(m, sf @ b[i].float().t(), 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# BGMV: one token per program
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, slot_ptr, out_ptr, N, K, stride_xt, stride_ws, stride_wn,
                 stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_k w[slot(t), n, k] * x[t, k] (zero for slot -1)."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    valid = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * xk[None, :], axis=1)
    acc = tl.where(valid, acc, 0.0)
    tl.store(out_ptr + t * stride_ot + offs_n, acc, mask=offs_n < N)


# ----------------------------------------------------------------------------------------------
# SGMV: one segment (request) per program, BLOCK_M tokens at a time
# ----------------------------------------------------------------------------------------------

@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, seg_start_ptr, seg_slot_ptr, out_ptr, N, K, stride_xt, stride_ws,
                 stride_wn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[t, n] = sum_k w[seg_slot, n, k] * x[t, k] for t in the segment (zero for slot -1).
    Tokens of no segment (padding) are left alone: the caller zero-fills `out`."""
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    slot = tl.load(seg_slot_ptr + seg)
    valid = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                         mask=(offs_m[:, None] < end) & (offs_k[None, :] < K), other=0.0)
            wt = tl.load(w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
            if IEEE:
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(xt, wt, acc)
        acc = tl.where(valid, acc, 0.0)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < end) & (offs_n[None, :] < N))


_INTERPRET = isinstance(_bgmv_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 at import


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def _gmv(x, w, token_slot, seg_start, seg_slot, sgmv: bool) -> torch.Tensor:
    """out[t] = w[slot(t)] @ x[t] for x [T, K] (row stride free, unit column stride), w [S, N, K]."""
    T, K = x.shape
    N = w.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    if sgmv:
        out = torch.zeros(T, N, dtype=torch.float32, device=x.device)
        if T == 0:
            return out
        bn = 32 if x.is_cuda else 16
        # (the interpreter's tl.dot mis-reads 16-bit operands: it runs them in fp32)
        ieee = x.dtype == torch.float32 or _INTERPRET
        bk = 32 if ieee else 64
        grid = (seg_slot.shape[0], triton.cdiv(N, bn))
        _sgmv_kernel[grid](x, w, seg_start, seg_slot, out, N, K, x.stride(0), w.stride(0),
                           w.stride(1), out.stride(0), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                           IEEE=ieee)
        return out
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    bn = min(64, triton.next_power_of_2(N)) if x.is_cuda else 16
    bk = min(64, max(16, triton.next_power_of_2(K))) if x.is_cuda else 16  # expand: K = rank
    _bgmv_kernel[(T, triton.cdiv(N, bn))](x, w, token_slot, out, N, K, x.stride(0), w.stride(0),
                                          w.stride(1), out.stride(0), BLOCK_N=bn, BLOCK_K=bk)
    return out


# ----------------------------------------------------------------------------------------------
# ops (torch.compile and CUDA graphs see one opaque op each)
# ----------------------------------------------------------------------------------------------

# `sgmv`: a 0-dim bool tensor on the host (the runner sets it each step), read inside the op, so
# torch.compile neither guards on it nor recompiles when a step changes kernel


@torch.library.custom_op("rankserve::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor,
                seg_start: torch.Tensor, seg_slot: torch.Tensor, sgmv: torch.Tensor) -> torch.Tensor:
    """[T, K] x [S, R, K] → [T, R] fp32."""
    if not _use_triton(x):
        return ref_lora_shrink(x, a, token_slot)
    return _gmv(x, a, token_slot, seg_start, seg_slot, bool(sgmv))


@lora_shrink.register_fake
def _(x, a, token_slot, seg_start, seg_slot, sgmv):
    return x.new_empty((x.shape[0], a.shape[1]), dtype=torch.float32)


@torch.library.custom_op("rankserve::lora_expand", mutates_args=())
def lora_expand(s: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
                seg_start: torch.Tensor, seg_slot: torch.Tensor, sgmv: torch.Tensor) -> torch.Tensor:
    """[T, R] x [S, N, R] → [T, N] fp32 (`s` may be a column slice of a wider shrink output)."""
    s = s.to(b.dtype)  # the intermediate is rounded to the model dtype, as PEFT's lora_A(x) is
    if not _use_triton(s):
        return ref_lora_expand(s, b, token_slot)
    return _gmv(s, b, token_slot, seg_start, seg_slot, bool(sgmv))


@lora_expand.register_fake
def _(s, b, token_slot, seg_start, seg_slot, sgmv):
    return s.new_empty((s.shape[0], b.shape[1]), dtype=torch.float32)
