"""Triton kernels behind `rankserve::mla_attention` (layout and semantics: kernels/mla.py).

- `store_latent`: this step's [c_kv | k_pe] rows into their cache slots (slot -1: skipped).
- `mla_attention_triton`: one program per (block of heads, query token). All heads share the one
  latent key/value stream, so a program loads each [BLOCK_N, L + R] tile of the paged cache once
  for BLOCK_H heads (tl.dot on [BLOCK_H, L] x [L, BLOCK_N], then [BLOCK_H, BLOCK_N] x
  [BLOCK_N, L]), with an online softmax over the token's causal range. Decode batches (one query
  token per request) add a split-KV pass (flash-decoding): a few requests with long contexts
  would otherwise leave most of the GPU idle.

A token's request is found in-kernel from query_start_loc (no host sync, no extra metadata), so
the grid depends on tensor shapes only: CUDA-graph capturable. Rows past query_start_loc[-1]
(padding) are written as zeros.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention import FP8_KV
from .triton_attention import _to_fp8

_LOG2E = 1.4426950408889634


@triton.jit
def _store_latent_kernel(kv_ptr, cache_ptr, slot_ptr, scale_ptr, stride_t, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr, KV_FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK)
    x = tl.load(kv_ptr + t * stride_t + d, mask=d < WIDTH)
    if KV_FP8:
        y = _to_fp8(x.to(tl.float32), tl.load(scale_ptr))
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + slot * WIDTH + d, y, mask=d < WIDTH)


def store_latent(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    T, width = kv.shape
    assert kv_cache.is_contiguous() and kv_cache.shape[-1] == width
    fp8 = kv_cache.dtype == FP8_KV
    if T:
        _store_latent_kernel[(T,)](kv, kv_cache, slot_mapping, kv_scale if fp8 else kv,
                                   kv.stride(0), WIDTH=width, BLOCK=triton.next_power_of_2(width),
                                   KV_FP8=fp8)


@triton.jit
def _mla_kernel(q_ptr, cache_ptr, out_ptr, part_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, kv_scale_ptr,
                num_reqs, num_tokens, scale_log2e, stride_qt, stride_qh, stride_cb, stride_cs, stride_ot,
                stride_oh, stride_bt, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    hb = tl.program_id(0)  # fastest: a token's head blocks run together and share its tiles in L2
    t = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    dl = tl.arange(0, BLOCK_L)
    lm = dl < L
    dr = tl.arange(0, BLOCK_R)
    rm = dr < R
    # the token's request: the number of requests whose queries end at or before it
    b = tl.arange(0, BLOCK_B)
    ends = tl.load(qsl_ptr + 1 + b, mask=b < num_reqs, other=2147483647)
    req = tl.sum((ends <= t).to(tl.int32), 0)
    valid = (req < num_reqs) & (t < num_tokens)
    req = tl.minimum(req, num_reqs - 1)
    q_start = tl.load(qsl_ptr + req)
    q_end = tl.load(qsl_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    n_keys = tl.where(valid, seq_len - (q_end - q_start) + (t - q_start) + 1, 0)  # causal
    # this split's key range (NUM_SPLITS 1: all of them), whole BLOCK_N tiles
    per_split = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), NUM_SPLITS) * BLOCK_N
    k_lo = split * per_split
    k_hi = tl.minimum(n_keys, k_lo + per_split)

    t64 = t.to(tl.int64)
    q_row = q_ptr + t64 * stride_qt + heads[:, None].to(tl.int64) * stride_qh
    q_l = tl.load(q_row + dl[None, :], mask=hm[:, None] & lm[None, :], other=0.0)
    q_r = tl.load(q_row + L + dr[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
    if KV_FP8:  # fp8 tiles widen exactly to the query's dtype; the scale folds into the
        # softmax scale here and into the output at the end
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2e = scale_log2e * kv_scale
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for s0 in range(k_lo, k_hi, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        sm = s < k_hi
        blk = tl.load(bt_row + s // BLOCK_SIZE, mask=sm, other=0).to(tl.int64)
        base = cache_ptr + blk * stride_cb + (s % BLOCK_SIZE).to(tl.int64) * stride_cs
        k_l = tl.load(base[:, None] + dl[None, :], mask=sm[:, None] & lm[None, :], other=0.0)
        k_r = tl.load(base[:, None] + L + dr[None, :], mask=sm[:, None] & rm[None, :], other=0.0)
        if KV_FP8:
            k_l = k_l.to(q_l.dtype)
            k_r = k_r.to(q_l.dtype)
        if IEEE:
            sc = tl.dot(q_l, tl.trans(k_l), input_precision="ieee")
            sc += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        else:
            sc = tl.dot(q_l, tl.trans(k_l))
            sc += tl.dot(q_r, tl.trans(k_r))
        sc = tl.where(sm[None, :], sc * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp2(sc - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_l.dtype), k_l, input_precision="ieee")
        else:
            acc = tl.dot(p.to(k_l.dtype), k_l, acc * alpha[:, None])
        m = m_new
    if KV_FP8:
        acc = acc * kv_scale
    if NUM_SPLITS == 1:
        out = tl.where(den[:, None] > 0, acc / den[:, None], 0.0)
        o_ptr = out_ptr + t64 * stride_ot + heads[:, None].to(tl.int64) * stride_oh + dl[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=hm[:, None] & lm[None, :])
    else:  # partials [T, splits, H, L + 2]: acc, then the running max and denominator
        row = part_ptr + ((t64 * NUM_SPLITS + split) * H + heads.to(tl.int64)) * (L + 2)
        tl.store(row[:, None] + dl[None, :], acc, mask=hm[:, None] & lm[None, :])
        tl.store(row + L, m, mask=hm)
        tl.store(row + L + 1, den, mask=hm)


@triton.jit
def _mla_reduce_kernel(part_ptr, out_ptr, stride_ot, stride_oh, H: tl.constexpr, L: tl.constexpr,
                       BLOCK_L: tl.constexpr, NUM_SPLITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dl = tl.arange(0, BLOCK_L)
    lm = dl < L
    sp = tl.arange(0, NUM_SPLITS)
    rows = part_ptr + ((t * NUM_SPLITS + sp) * H + h) * (L + 2)
    m = tl.load(rows + L)
    den = tl.load(rows + L + 1)
    m_all = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_all), 0.0)
    total = tl.sum(den * w, 0)
    acc = tl.load(rows[:, None] + dl[None, :], mask=lm[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dl, out.to(out_ptr.dtype.element_ty), mask=lm)


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _num_splits(num_tokens: int, heads_blocks: int, max_blocks: int, block_size: int,
                on_gpu: bool) -> int:
    """Decode: enough programs to fill the GPU (about 2 per SM), at most one split per 256 keys
    of the longest possible context. Shape-only (CUDA graphs)."""
    if not on_gpu:
        return 2 if max_blocks * block_size > 16 else 1  # the interpreter exercises both paths
    want = triton.cdiv(2 * _num_sms(), max(1, num_tokens * heads_blocks))
    cap = triton.cdiv(max_blocks * block_size, 256)
    return triton.next_power_of_2(max(1, min(want, cap, 32)))


def mla_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                         kv_lora_rank: int, is_decode: bool = False,
                         kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    T, H, width = q.shape
    L = kv_lora_rank
    R = width - L
    assert kv_cache.shape[-1] == width and kv_cache.shape[2] == 1
    out = torch.empty(T, H, L, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q = q.contiguous()
    B = seq_lens.shape[0]
    block_h = 16  # tl.dot needs M >= 16; heads beyond H are masked
    grid_h = triton.cdiv(H, block_h)
    on_gpu = q.is_cuda
    splits = _num_splits(T, grid_h, block_table.shape[1], kv_cache.shape[1], on_gpu) if is_decode else 1
    part = torch.empty(T, splits, H, L + 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    big = L > 256
    kw = dict(num_warps=8 if big else 4, num_stages=2) if on_gpu else {}
    _mla_kernel[(grid_h, T, splits)](
        q, kv_cache, out, part, query_start_loc, seq_lens, block_table,
        kv_scale if kv_cache.dtype == FP8_KV else seq_lens, B,
        T, scale * _LOG2E, q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        H=H, L=L, R=R, BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=block_h,
        BLOCK_L=triton.next_power_of_2(L), BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_N=(32 if big else 64) if on_gpu else 16, BLOCK_B=triton.next_power_of_2(B + 1),
        NUM_SPLITS=splits, IEEE=q.dtype == torch.float32, KV_FP8=kv_cache.dtype == FP8_KV, **kw)
    if splits > 1:
        _mla_reduce_kernel[(T, H)](part, out, out.stride(0), out.stride(1), H=H, L=L,
                                   BLOCK_L=triton.next_power_of_2(L), NUM_SPLITS=splits)
    return out
