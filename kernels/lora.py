"""Multi-LoRA kernels: each token of a mixed batch gets its own adapter's low-rank update.

A LoRA layer adds `(x A^T) B^T` (the scaling folded into B at load time) to the base GEMM. The
adapters live in device slots; a token's slot is `token_slot[t]` (-1: the base model, no update).
B is `b` [S, N, R] for all sub-matrices of a fused layer (q/k/v, gate/up) at once: row n holds
the B row of the slice n lies in (slices `bounds` [0, N_0, N_0 + N_1, ..., N]); ranks below R are
zero-padded. The low-rank activations s come in one of two layouts:

  all slots:  s [1, T, S * C]: every slot's x A^T for every token (C = slices * R columns a
              slot), the extra output rows of the base GEMM whose weight carries every slot's A
              under its own rows (models/lora.py): no shrink kernel at all (`slot_cols` = C)
  own slot:   s [P, T, C] = lora_shrink(x, a [S, C, K]): only the token's adapter, as P partial
              sums over K splits (`slot_cols` = 0), for bases whose GEMM cannot carry A (quantized)
              or when all slots' rows would cost the GEMM too much

  lora_shrink(x, a, ...)   -> s [P, T, C] fp32     s.sum(0)[t] = a[slot(t)] @ x[t]
  lora_expand(y, s, b, token_slot, bounds, slot_cols, bias)
                           -> y (+ bias) + (b[slot(t)] @ round(s_t)) rounded to y's dtype, like
                              PEFT's `y + lora_B(lora_A(x))`, as a new [T, N] tensor

The expand is one launch per layer (all slices): one program per (token tile, column tile) runs
a small tl.dot per slot its tokens use and per slice. The shrink has two kernels:
  BGMV (decode): one program per (token, output tile, K split); a batched gather-matrix-vector
       product.
  SGMV (prefill): one program per (segment, output tile, K split), a segment being a run of
       tokens of one request (`seg_start` [B+1], `seg_slot` [B], i.e. the batch's
       query_start_loc): tl.dot over BLOCK_M tokens at a time.
A shrink's K (the hidden size) is long and its N (the rank) tiny: K is split over programs (one
program per token over all of K measured 25 us a call on an H200).
Grids depend only on T and on the (fixed) length of the segment buffers, so CUDA graphs replay
them with new slot indices. Without CUDA or the Triton interpreter, the plain-torch references run
(a loop over the S slots with masks: no data-dependent shapes, so torch.compile traces it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .custom_op import custom_op


# ----------------------------------------------------------------------------------------------
# plain-torch references
# ----------------------------------------------------------------------------------------------

def ref_lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in range(a.shape[0]):
        m = (token_slot == s).unsqueeze(-1)
        out = out + torch.where(m, xf @ a[s].float().t(), 0.0)
    return out.unsqueeze(0)  # one "partial"


def ref_lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
                    bounds: list[int], slot_cols: int, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    R = b.shape[2]
    sr = s.float().sum(0).to(b.dtype).float()
    d = torch.zeros(y.shape[0], b.shape[1], dtype=torch.float32, device=y.device)
    for sl in range(b.shape[0]):
        m = (token_slot == sl).unsqueeze(-1)
        for i in range(len(bounds) - 1):
            lo, hi, c = bounds[i], bounds[i + 1], sl * slot_cols + i * R
            d[:, lo:hi] += torch.where(m, sr[:, c:c + R] @ b[sl, lo:hi].float().t(), 0.0)
    base = y if bias is None else y + bias
    return base + d.to(y.dtype)


# ----------------------------------------------------------------------------------------------
# BGMV: one token per program
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, slot_ptr, out_ptr, N, K, k_per_split, stride_xt, stride_ws,
                 stride_wn, stride_ot, stride_os, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split, t, n] = sum over the split's k of w[slot(t), n, k] * x[t, k] (0 for slot -1)."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    valid = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # elementwise partials, reduced once
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_end), other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    out = tl.where(valid, tl.sum(acc, axis=1), 0.0)
    tl.store(out_ptr + split * stride_os + t * stride_ot + offs_n, out, mask=offs_n < N)


# ----------------------------------------------------------------------------------------------
# SGMV: one segment (request) per program, BLOCK_M tokens at a time
# ----------------------------------------------------------------------------------------------

@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, seg_start_ptr, seg_slot_ptr, out_ptr, N, K, k_per_split, stride_xt,
                 stride_ws, stride_wn, stride_ot, stride_os, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[split, t, n] = sum over the split's k of w[seg_slot, n, k] * x[t, k] for t in the
    segment (zero for slot -1). Tokens of no segment (padding) are left alone: the caller
    zero-fills `out`."""
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    slot = tl.load(seg_slot_ptr + seg)
    valid = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                         mask=(offs_m[:, None] < end) & (offs_k[None, :] < k_end), other=0.0)
            wt = tl.load(w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_end), other=0.0)
            if IEEE:
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(xt, wt, acc)
        acc = tl.where(valid, acc, 0.0)
        tl.store(out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_ot
                 + offs_n[None, :], acc, mask=(offs_m[:, None] < end) & (offs_n[None, :] < N))


@triton.jit
def _expand_kernel(y_ptr, s_ptr, b_ptr, slot_ptr, bias_ptr, out_ptr, T, N, R, P, S, slot_cols,
                   b1, b2, stride_yt, stride_sp, stride_st, stride_bs, stride_bn, stride_ot,
                   NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """out[t, n] = y[t, n] (+ bias[n]) + round(b[slot(t), n, :] @ round(s_t)) for the columns
    n of slice i, s_t = sum_p s[p, t, slot(t) * slot_cols + i * R:][:R] (slot -1: no update).
    One program per (BLOCK_M tokens, BLOCK_N columns); it walks the slots its tokens use (a
    scalar test per slot) and the slices, each a [BLOCK_M, R] x [R, BLOCK_N] tl.dot with the
    other slots' tokens and the other slices' columns masked to zero."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask, n_mask, r_mask = offs_m < T, offs_n < N, offs_r < R
    slot_m = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)
    slice_n = (offs_n >= b1).to(tl.int32) + (offs_n >= b2).to(tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for sl in range(S):
        tok = slot_m == sl
        if tl.max(tok.to(tl.int32), axis=0) > 0:
            w_base = b_ptr + sl * stride_bs
            for i in tl.static_range(NUM_SLICES):
                cols = sl * slot_cols + i * R + offs_r
                sv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for p in range(P):  # the shrink's K-split partials, in order
                    sv += tl.load(s_ptr + p * stride_sp + offs_m[:, None].to(tl.int64) * stride_st
                                  + cols[None, :], mask=tok[:, None] & r_mask[None, :], other=0.0)
                sv = sv.to(b_ptr.dtype.element_ty)  # lora_A(x) rounded to the model dtype
                rows = n_mask & (slice_n == i)
                w = tl.load(w_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                            mask=rows[None, :] & r_mask[:, None], other=0.0)
                if IEEE:
                    acc += tl.dot(sv.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc = tl.dot(sv, w, acc)
    mn = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + offs_n[None, :], mask=mn,
                other=0.0)
    if HAS_BIAS:  # the base layer's bias, added before the update as in y = base(x) + lora(x)
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
        y = (y.to(tl.float32) + bias.to(tl.float32)[None, :]).to(y.dtype)
    d = acc.to(y.dtype)  # lora_B(.) rounded like PEFT's, then added
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :],
             (y.to(tl.float32) + d.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mn)


_INTERPRET = isinstance(_bgmv_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 at import


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (_INTERPRET and t.device.type == "cpu")


def _split_k(K: int, on_gpu: bool) -> tuple[int, int]:
    """(splits P, K per split) of a shrink: >= 512 of K a program on the GPU (the interpreter
    splits small tests too, to check the path), K per split a multiple of every BLOCK_K used."""
    per, granule = (512, 128) if on_gpu else (16, 16)
    split = max(1, min(32, K // per))
    k_per_split = triton.cdiv(triton.cdiv(K, split), granule) * granule
    return triton.cdiv(K, k_per_split), k_per_split


def _shrink(x, w, token_slot, seg_start, seg_slot, sgmv: bool) -> torch.Tensor:
    """Partials [P, T, N] fp32 of w[slot(t)] @ x[t], x [T, K] (unit column stride), w [S, N, K]."""
    T, K = x.shape
    N = w.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    on_gpu = x.is_cuda
    split, kps = _split_k(K, on_gpu)
    if sgmv:
        # (the interpreter's tl.dot mis-reads 16-bit operands: it runs them in fp32)
        ieee = x.dtype == torch.float32 or _INTERPRET
        bn, bk = (32 if on_gpu else 16), (32 if ieee else 64)
        part = torch.zeros(split, T, N, dtype=torch.float32, device=x.device)
        if T:
            _sgmv_kernel[(seg_slot.shape[0], triton.cdiv(N, bn), split)](
                x, w, seg_start, seg_slot, part, N, K, kps, x.stride(0), w.stride(0), w.stride(1),
                part.stride(1), part.stride(0), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee)
        return part
    bn = min(64, triton.next_power_of_2(N)) if on_gpu else 16
    bk = 128 if on_gpu else 16
    part = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    if T:
        _bgmv_kernel[(T, triton.cdiv(N, bn), split)](
            x, w, token_slot, part, N, K, kps, x.stride(0), w.stride(0), w.stride(1),
            part.stride(1), part.stride(0), BLOCK_N=bn, BLOCK_K=bk)
    return part


# ----------------------------------------------------------------------------------------------
# ops (torch.compile and CUDA graphs see one opaque op each)
# ----------------------------------------------------------------------------------------------

# `sgmv`: a 0-dim bool tensor on the host (the runner sets it each step), read inside the op, so
# torch.compile neither guards on it nor recompiles when a step changes kernel


@custom_op("rankserve::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor,
                seg_start: torch.Tensor, seg_slot: torch.Tensor, sgmv: torch.Tensor) -> torch.Tensor:
    """[T, K] x [S, R, K] → [P, T, R] fp32 partial sums over K splits."""
    if not _use_triton(x):
        return ref_lora_shrink(x, a, token_slot)
    return _shrink(x, a, token_slot, seg_start, seg_slot, bool(sgmv))


@lora_shrink.register_fake
def _(x, a, token_slot, seg_start, seg_slot, sgmv):
    P = _split_k(x.shape[1], x.is_cuda)[0] if _use_triton(x) else 1
    return x.new_empty((P, x.shape[0], a.shape[1]), dtype=torch.float32)


@custom_op("rankserve::lora_expand", mutates_args=())
def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
                bounds: list[int], slot_cols: int, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """y [T, N] (+ bias) plus each token's update from b [S, N, R] applied to s [P, T, C] (see
    the module doc), as a new [T, N] tensor."""
    if not _use_triton(y):
        return ref_lora_expand(y, s, b, token_slot, bounds, slot_cols, bias)
    T, N = y.shape[0], b.shape[1]
    out = y.new_empty(T, N)
    if T == 0:
        return out
    assert y.stride(1) == 1 and s.stride(2) == 1 and b.stride(2) == 1, "lora_expand: layout"
    assert 2 <= len(bounds) <= 4 and bounds[0] == 0 and bounds[-1] == N, "lora_expand: slices"
    b1, b2 = (list(bounds[1:-1]) + [N, N])[:2]
    on_gpu = y.is_cuda
    ieee = y.dtype == torch.float32 or _INTERPRET  # (the interpreter's 16-bit tl.dot, see above)
    bm = min(64, max(16, triton.next_power_of_2(T))) if on_gpu else 16
    bn = 64 if on_gpu else 16
    _expand_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
        y, s, b, token_slot, bias, out, T, N, b.shape[2], s.shape[0], b.shape[0], slot_cols, b1,
        b2, y.stride(0), s.stride(0), s.stride(1), b.stride(0), b.stride(1), out.stride(0),
        NUM_SLICES=len(bounds) - 1, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_R=max(16, triton.next_power_of_2(b.shape[2])), IEEE=ieee)
    return out


@lora_expand.register_fake
def _(y, s, b, token_slot, bounds, slot_cols, bias=None):
    return y.new_empty(y.shape[0], b.shape[1])
