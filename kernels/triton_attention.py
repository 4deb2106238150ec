"""Triton kernels behind `rankserve::attention` (layout and semantics: kernels/attention.py).

- `prepare_qkv`: q/k RMSNorm (Qwen3) + RoPE on the fused qkv rows, q to a buffer, k/v scattered
  into their cache slots (slot -1 = padding, skipped), in one launch.
- `paged_attention`: one unified kernel for any mix of prefill, chunked prefill, prefix extension
  and decode; decode-only batches (`is_decode`, decided by the caller) take a split-KV
  (flash-decoding) path instead, so that small batches with long contexts fill the GPU. A
  mixed step's one-token requests take that kernel too (MIXED_DECODE_SPLIT).

FP8 caches (torch.float8_e4m3fn, see kernels/attention.py) take a constexpr branch (`KV_FP8`), so
16-bit caches compile to the same code as before: the store divides by the layer's scale and
rounds to e4m3; attention widens the fp8 tiles to fp16 (exact; 16-bit queries go to fp16 too,
fp32 ones keep fp32) and folds k_scale into the softmax scale and v_scale into the output.

Sliding-window layers (`window` > 0) start each tile's key loop at its first query's window, so
blocks that fell out of the window are never read (they may be freed and reused); split-KV decode
splits only the window. Soft-capping (`softcap` > 0) is a constexpr branch.

Every grid size is a function of tensor shapes only and nothing is read back to the host, so both
ops can be captured in a CUDA graph. Requests with q_len 0 / seq_len 0 (CUDA-graph padding) are
fine; output rows past query_start_loc[-1] are written as zeros.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import pdl

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
# split-KV decode tiles: keys per step, pipeline stages, and the programs per SM that the split
# count aims for (module constants, so benchmarks/ sweeps can set them). 128 keys: W1 +1.3 % over
# 64 on three H200s (each pair back to back), W2 the same within noise; more programs per SM
# (16, 32) lost 2-5 % (benchmarks/2026-12-05-h200-s10/sweep_decode.py)
DECODE_BLOCK_N = 128
DECODE_STAGES = 2
DECODE_WARPS = 4
DECODE_PROGRAMS_PER_SM = 8
# a mixed step's one-token requests (the running decodes) through the split-KV kernel, whose
# 16-row tiles read each context once per kv head, instead of the unified kernel's tall prefill
# tiles (BLOCK_M rows for one token x GROUP heads): W1's prefill ramp, attention 241 us a layer
# (unified 152 + split 89) against 257 us (session 9's profile, another H200)
MIXED_DECODE_SPLIT = True
# prepare_qkv: steps of at most PREPARE_SPLIT_T tokens run PREPARE_HEADS heads a program (a
# module global so tests can shrink it to the interpreter's sizes)
PREPARE_SPLIT_T, PREPARE_HEADS = 64, 8
# decode steps of up to this many requests run fused_decode_attention (the runner sets it from
# RANKSERVE_FUSED_DECODE_MAX_B; 0: off until measured on a GPU)
FUSED_DECODE_MAX_B = 0
# Decode programs in longest-processing-time-first order (RANKSERVE_DECODE_LPT): a request's kv
# heads and splits launch together, the requests by decreasing context (the runner's argsort,
# AttnMeta.decode_order). A schedule model of W1's decode steps on 396 program slots
# (benchmarks/2026-12-05-s14-lpt) gives 1.35x the ideal in launch order, 1.22x with LPT; off
# until measured on a GPU.
DECODE_LPT = False


# ----------------------------------------------------------------------------------------------
# prepare_qkv: q/k RMSNorm + RoPE + KV-cache store, one launch
# ----------------------------------------------------------------------------------------------

@triton.jit
def _to_fp8(x, scale):
    """fp32 x -> e4m3 of x / scale saturated to +-448, rounded to nearest even like torch.

    x is first rounded to the e4m3 grid in fp32 ((x + c) - c with c = 1.5 * 2^(e + 20): c's ulp
    is the e4m3 ulp of x's binade e, 2^-9 below e4m3's smallest normal 2^-6), so the cast itself
    is exact. On a GPU this changes nothing (its conversion rounds the same way); Triton's
    interpreter rounds fp32 -> fp8 casts without ties-to-even or a carry into the exponent (about
    12% of random values differ from torch, some by half their value), so without it the
    interpreter tests could not compare bit for bit."""
    x = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    e = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    c = ((e + 20) << 23 | 0x400000).to(tl.float32, bitcast=True)
    return ((x + c) - c).to(tl.float8e4nv)


@triton.jit
def _prepare_qkv_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, q_ptr,
                        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, eps,
                        stride_t, stride_cs, stride_qt, stride_qh,
                        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
                        KV_FP8: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait_and_release(USE_PDL)
    # Program (token, block of BLOCK_HEADS heads): head rows h < H of the [heads, D/2] tiles are
    # q heads, H..H+KH-1 k heads (each of those also moves its v head). Rounding follows the
    # torch reference step by step (norm -> dtype -> * weight -> dtype -> fp32 RoPE -> dtype), so
    # compiled and eager runs agree on the same device.
    tok = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = q_ptr.dtype.element_ty
    heads = h0 + tl.arange(0, BLOCK_HEADS)
    is_q = heads < NUM_HEADS
    # every load that depends on no other comes first: at decode sizes the kernel is a chain of
    # memory round trips (pos -> cos / sin the only dependent pair), not arithmetic
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & dm[None, :]
    src = qkv_ptr + tok * stride_t + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=dm, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=dm, other=0.0)[None, :]
    # the v heads of this block's k heads: kv_lo .. kv_hi - 1 (loaded now, stored below)
    kv_lo = tl.maximum(h0 - NUM_HEADS, 0)
    kv_hi = tl.minimum(h0 + BLOCK_HEADS - NUM_HEADS, NUM_KV_HEADS)
    vh = kv_lo + tl.arange(0, BLOCK_KV)
    dv = tl.arange(0, BLOCK_D)
    v_mask = (vh < kv_hi)[:, None] & (dv < HEAD_DIM)[None, :]
    v = tl.load(qkv_ptr + tok * stride_t + (NUM_HEADS + NUM_KV_HEADS + vh[:, None]) * HEAD_DIM
                + dv[None, :], mask=v_mask)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(q_norm_ptr + d, mask=dm, other=0.0)[None, :],
                      tl.load(k_norm_ptr + d, mask=dm, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q[:, None], tl.load(q_norm_ptr + HALF + d, mask=dm, other=0.0)[None, :],
                      tl.load(k_norm_ptr + HALF + d, mask=dm, other=0.0)[None, :]).to(tl.float32)
        x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dt)
    o2 = (x2 * cos + x1 * sin).to(dt)
    q_dst = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q_mask = is_q[:, None] & dm[None, :]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)

    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    # k rows; none for a padding token (slot -1: its k/v go nowhere)
    kh = heads - NUM_HEADS
    k_rows = (heads >= NUM_HEADS) & (kh < tl.where(slot >= 0, NUM_KV_HEADS, 0))
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + kh[:, None] * stride_kch + d[None, :]
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        k1 = _to_fp8(o1.to(tl.float32), k_scale)
        k2 = _to_fp8(o2.to(tl.float32), k_scale)
    else:
        cdt = k_cache_ptr.dtype.element_ty
        k1 = o1.to(cdt)
        k2 = o2.to(cdt)
    tl.store(k_dst, k1, mask=k_rows[:, None] & dm[None, :])
    tl.store(k_dst + HALF, k2, mask=k_rows[:, None] & dm[None, :])
    if KV_FP8:
        v = _to_fp8(v.to(tl.float32), tl.load(v_scale_ptr))
    else:
        v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + vh[:, None] * stride_vch
             + dv[None, :], v, mask=(vh < tl.where(slot >= 0, kv_hi, 0))[:, None] & (dv < HEAD_DIM)[None, :])


def prepare_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_heads: int, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `attention.prepare_qkv_ref`: returns q [T, H, D], stores k/v."""
    T = qkv.shape[0]
    _, block_size, KH, D = k_cache.shape
    assert qkv.shape[1] == (num_heads + 2 * KH) * D and D % 2 == 0, "qkv / cache shape mismatch"
    _check_last_dim(qkv, cos_sin, k_cache, v_cache)
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    has_norm = q_norm is not None
    fp8, k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    # decode-sized steps: a few heads a program (Llama-8B at one token was one program of 40
    # heads in a [64, 64] tile, 7.5 us a layer in W2's profile); larger steps: a token a program
    heads = triton.next_power_of_2(num_heads + KH)
    block_heads = min(heads, PREPARE_HEADS) if T <= PREPARE_SPLIT_T else heads
    _prepare_qkv_kernel[(T, triton.cdiv(num_heads + KH, block_heads))](
        qkv, positions, cos_sin, q_norm if has_norm else cos_sin, k_norm if has_norm else cos_sin,
        q, k_cache, v_cache, k_scale, v_scale, slot_mapping, eps,
        qkv.stride(0), cos_sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=KH, HEAD_DIM=D, BLOCK_SIZE=block_size,
        HAS_NORM=has_norm, KV_FP8=fp8, BLOCK_HEADS=block_heads,
        BLOCK_KV=min(triton.next_power_of_2(KH), block_heads), BLOCK_HALF=triton.next_power_of_2(D // 2),
        BLOCK_D=triton.next_power_of_2(D), num_warps=4 if block_heads == heads else 2, **pdl.launch(qkv))
    return q


# ----------------------------------------------------------------------------------------------
# unified attention (prefill / chunked prefill / prefix extension / decode, mixed)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, offs_d, d_mask, kvh,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE: tl.constexpr, compute_dt: tl.constexpr, KV_FP8: tl.constexpr):
    """K and V rows of context positions `offs_n`, found through the request's block table
    (an fp8 cache's tiles widened to `compute_dt`: exact, its scales are applied by the caller)."""
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_blk = offs_n % BLOCK_SIZE
    k_off = blk * stride_kb + in_blk * stride_ks + kvh * stride_kh
    v_off = blk * stride_vb + in_blk * stride_vs + kvh * stride_vh
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(compute_dt)
        v = v.to(compute_dt)
    return k, v


@triton.jit
def _fp8_dot_query(q, KV_FP8: tl.constexpr):
    """With an fp8 cache the dots run in fp16: e4m3 -> fp16 is one conversion per two values
    (-> bf16 takes several), so 16-bit queries go to fp16 (exact for bf16 values within fp16's
    range, to which they are clamped). fp32 queries (interpreter tests) stay fp32."""
    if KV_FP8:
        if q.dtype != tl.float32:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """fp32 models: exact fp32 products (TF32, the default, would make a verify step, which runs
    the unified kernel, round differently from the decode kernel and flip near-tied tokens)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _qk_scale(scale_log2e, k_scale_ptr, KV_FP8: tl.constexpr):
    """Softmax scale (log2 domain) of the raw cache keys: an fp8 cache's k_scale folded in."""
    if KV_FP8:
        return scale_log2e * tl.load(k_scale_ptr)
    else:
        return scale_log2e


@triton.jit
def _softcap(s, softcap_log2e, SOFTCAP: tl.constexpr):
    """c * tanh(s / c) on log2-domain scores (c = softcap * log2(e): the same cap, rescaled)."""
    if SOFTCAP:
        x = s / softcap_log2e
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return softcap_log2e * tl.where(x < 0, -t, t)
    else:
        return s


@triton.jit
def _v_out(acc, l_i, v_scale_ptr, KV_FP8: tl.constexpr):
    """acc / l, times an fp8 cache's v_scale."""
    if KV_FP8:
        return acc * (tl.load(v_scale_ptr) / l_i)[:, None]
    else:
        return acc / l_i[:, None]


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "window"])  # one compilation
def _unified_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, qsl_ptr,
        seq_lens_ptr, bt_ptr, scale_log2e, num_seqs, num_tokens, window, softcap_log2e,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
        SKIP_DECODE: tl.constexpr):
    # Program (pid, kvh) owns BLOCK_Q query tokens x the GROUP query heads of kv head kvh, as
    # BLOCK_M = BLOCK_Q * GROUP (padded) rows, so every K/V tile is loaded once per kv head.
    # Request i owns the tiles [S_i, S_{i+1}) with S_i = qsl[i] // BLOCK_Q + i, which is at least
    # ceil(q_len_i / BLOCK_Q) tiles; hence T // BLOCK_Q + B + 1 programs always suffice.
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # binary search: largest i in [0, num_seqs] with S_i <= pid (i == num_seqs: padding rows)
    lo = pid * 0
    hi = lo + num_seqs + 1  # tensors (not constexpr even when num_seqs == 1): loop-carried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    req = lo
    q_start = tl.load(qsl_ptr + req)
    local = pid - (q_start // BLOCK_Q + req)

    rows = tl.arange(0, BLOCK_M)
    tok_in_tile = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    if req == num_seqs:
        # past the last request: zero the padding rows [qsl[B], T) so they stay finite
        tok = (q_start + local * BLOCK_Q + tok_in_tile).to(tl.int64)
        mask = (tok_in_tile < BLOCK_Q) & (tok < num_tokens)
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=mask[:, None] & d_mask[None, :])
        return

    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if local * BLOCK_Q >= q_len:  # spare tile of this request (or an empty request)
        return
    if SKIP_DECODE:  # one-token requests went to the split-KV kernel (MIXED_DECODE_SPLIT)
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    q_local = local * BLOCK_Q + tok_in_tile
    row_mask = (tok_in_tile < BLOCK_Q) & (q_local < q_len)
    q_pos = ctx_len + q_local  # absolute position, for the causal mask
    tok = (q_start + q_local).to(tl.int64)

    q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = _fp8_dot_query(tl.load(q_ptrs, mask=io_mask, other=0.0), KV_FP8)
    qk_scale = _qk_scale(scale_log2e, k_scale_ptr, KV_FP8)

    # finite -1e30 start: fully masked rows give p = 0 instead of NaN (inf - inf)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # keys beyond the last query position of this tile are never needed
    kv_end = ctx_len + tl.minimum(q_len, (local + 1) * BLOCK_Q)
    # nor keys before the first query's window (window: 2^30 for full attention)
    kv_lo = tl.maximum(ctx_len + local * BLOCK_Q - window + 1, 0)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(kv_lo, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, offs_d, d_mask,
                             kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                             stride_vh, BLOCK_SIZE, q.dtype, KV_FP8)

        s = _softcap(_dot(q, tl.trans(k), None, IEEE) * qk_scale, softcap_log2e, SOFTCAP)
        causal = (n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
                  & (offs_n[None, :] > q_pos[:, None] - window))
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = _v_out(acc, l_i, v_scale_ptr, KV_FP8)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------------------------
# split-KV decode (one query token per request)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rope_rows(qkv_row, rows, offs_d, d_mask, pos, cos_sin_ptr, stride_cs, norm_ptr, eps,
               row_mask, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Head rows `rows` of one token's fused qkv after the q/k RMSNorm (when given) and RoPE,
    [len(rows), BLOCK_D] in the model dtype, rounded as prepare_qkv_ref rounds them. Each
    column's rotate-half partner (d +- D/2) is loaded beside it, so the head stays one tile."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = qkv_row.dtype.element_ty
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    mask = row_mask[:, None] & d_mask[None, :]
    base = qkv_row + rows[:, None] * HEAD_DIM
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xp = ((xp * r).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    half = tl.where(first, offs_d, offs_d - HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + half, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + half, mask=d_mask, other=0.0)[None, :]
    # first half x1 cos - x2 sin, second x2 cos + x1 sin (a + (-b) is a - b exactly)
    return (x * cos + tl.where(first[None, :], -xp, xp) * sin).to(dt)


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, part_out_ptr, part_lse_ptr,
        out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, scale_log2e, num_seqs, window, softcap_log2e,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        pos_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr, eps, stride_cs, order_ptr,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, ONLY_DECODE: tl.constexpr,
        KV_FP8: tl.constexpr,
        SOFTCAP: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
        PREPARE: tl.constexpr, HAS_NORM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        LPT: tl.constexpr, HAS_ORDER: tl.constexpr):
    # PREPARE (fused_decode_attention): q_ptr is the fused qkv [T, (H + 2 KH) D]; the query
    # comes from it through q/k norm + RoPE here, and the program whose segment holds the new
    # position stores its k / v into the cache first: prepare_qkv's launch is gone.
    pdl.wait_and_release(USE_PDL)
    # Program (req, kvh, split): the GROUP heads of kv head kvh over one segment of the context.
    # Partial results are normalised; lse (log2 domain) lets the reduce kernel reweight them (a
    # fused reduce by each (req, kvh)'s last program, on atomic counters, was 3 % slower on W2).
    # With one split (large batches) the result is final: written straight to out, no reduce.
    # LPT (DECODE_LPT): grid (kv heads, splits, requests), requests slowest and taken in
    # `order` (longest context first, the host's argsort): blocks are dispatched in launch
    # order, so the longest programs start first and the short ones fill the tail
    if LPT:
        kvh = tl.program_id(0)
        split = tl.program_id(1)
        req = tl.program_id(2)
        if HAS_ORDER:
            req = tl.load(order_ptr + req)
    else:
        req = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if ONLY_DECODE:  # a mixed step's one-token requests only (the unified kernel does the rest)
        if q_len != 1:
            return
    seq_len = tl.where(q_len > 0, tl.load(seq_lens_ptr + req), 0)  # q_len 0: nothing to do
    base = tl.maximum(seq_len - window, 0)  # the window's first key (0: full attention)
    seg = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_lo = base + split * seg
    n_hi = tl.minimum(n_lo + seg, seq_len)
    hs = tl.arange(0, BLOCK_H)
    if NUM_SPLITS > 1:
        if n_lo >= n_hi:  # an empty segment (most of them for short contexts at a long
            # max_model_len): weight 0 in the reduction, nothing else to load or store
            row0 = (req * NUM_HEADS + kvh * GROUP + hs).to(tl.int64) * NUM_SPLITS + split
            tl.store(part_lse_ptr + row0, tl.full([BLOCK_H], float("-inf"), tl.float32),
                     mask=hs < GROUP)
            return

    h_mask = hs < GROUP
    head = kvh * GROUP + hs
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = hs < tl.where(q_len > 0, GROUP, 0)  # no query row for an empty request
    if PREPARE:
        tok = q_start.to(tl.int64)
        qkv_row = q_ptr + tok * stride_qt
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        q = _rope_rows(qkv_row, head, offs_d, d_mask, pos, cos_sin_ptr, stride_cs, q_norm_ptr, eps,
                       q_rows, HEAD_DIM, HAS_NORM)
        # the segment that holds the new position stores its k / v, then reads them back with
        # the rest (no other program reads that position; the barrier orders this CTA's stores)
        if (n_lo <= seq_len - 1) & (seq_len - 1 < n_hi) & (slot >= 0):
            one = hs == 0
            k = _rope_rows(qkv_row, NUM_HEADS + kvh + hs * 0, offs_d, d_mask, pos, cos_sin_ptr,
                           stride_cs, k_norm_ptr, eps, one, HEAD_DIM, HAS_NORM)
            v = tl.load(qkv_row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + offs_d, mask=d_mask)
            blk = slot // BLOCK_SIZE
            in_blk = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + blk * stride_kb + in_blk * stride_ks + kvh * stride_kh
            v_dst = v_cache_ptr + blk * stride_vb + in_blk * stride_vs + kvh * stride_vh
            if KV_FP8:
                k = _to_fp8(k.to(tl.float32), tl.load(k_scale_ptr))
                v = _to_fp8(v.to(tl.float32), tl.load(v_scale_ptr))
            tl.store(k_dst + hs[:, None] * 0 + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty),
                     mask=one[:, None] & d_mask[None, :])
            tl.store(v_dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)
            tl.debug_barrier()
    else:
        q_ptrs = (q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                  + offs_d[None, :])
        q = tl.load(q_ptrs, mask=q_rows[:, None] & d_mask[None, :], other=0.0)
    q = _fp8_dot_query(q, KV_FP8)
    qk_scale = _qk_scale(scale_log2e, k_scale_ptr, KV_FP8)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, offs_d, d_mask,
                             kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                             stride_vh, BLOCK_SIZE, q.dtype, KV_FP8)

        s = _softcap(_dot(q, tl.trans(k), None, IEEE) * qk_scale, softcap_log2e, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    empty = l_i == 0.0  # empty segment: weight 0 in the reduction, partial output 0
    out = _v_out(acc, tl.where(empty, 1.0, l_i), v_scale_ptr, KV_FP8)
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs + q_start.to(tl.int64) * stride_ot, out.to(out_ptr.dtype.element_ty),
                 mask=q_rows[:, None] & d_mask[None, :])
        if not ONLY_DECODE:
            # T == B, so row `req` is a padding row exactly when req >= qsl[B]: zero it
            is_pad = req >= tl.load(qsl_ptr + num_seqs)
            tl.store(o_ptrs + req.to(tl.int64) * stride_ot,
                     tl.zeros([BLOCK_H, BLOCK_D], out_ptr.dtype.element_ty),
                     mask=(hs < tl.where(is_pad, GROUP, 0))[:, None] & d_mask[None, :])
        return
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    row = (req * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
    tl.store(part_lse_ptr + row, lse, mask=h_mask)
    # an empty segment's partial output is never read (the reduce masks it by its lse): the
    # splits past a short context (most of them at a long max_model_len) store nothing
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=(h_mask & ~empty)[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, qsl_ptr, num_seqs,
                          stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait_and_release(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (req * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty segments
    # only non-empty segments' partials are loaded (masked lanes issue no memory traffic)
    live = s_mask & (lse != float("-inf"))
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=live[:, None] & d_mask[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)

    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    o_ptrs = out_ptr + head * stride_oh + offs_d
    tl.store(o_ptrs + q_start.to(tl.int64) * stride_ot, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < tl.where(q_len > 0, HEAD_DIM, 0))
    # T == B here, so row `req` is a padding row exactly when req >= qsl[B]: zero it
    is_pad = req >= tl.load(qsl_ptr + num_seqs)
    tl.store(o_ptrs + req.to(tl.int64) * stride_ot, tl.zeros([BLOCK_D], out_ptr.dtype.element_ty),
             mask=offs_d < tl.where(is_pad, HEAD_DIM, 0))


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

def _kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(fp8 cache?, k_scale, v_scale) for the kernels: missing scales of an fp8 cache are 1.0;
    a 16-bit cache never reads them (any pointer will do)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert v_cache.dtype == k_cache.dtype, "k and v caches of different dtypes"
    if not fp8:
        return False, k_cache, k_cache
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones((), dtype=torch.float32, device=k_cache.device)
    return True, one if k_scale is None else k_scale, one if v_scale is None else v_scale


def _check_last_dim(*ts: torch.Tensor) -> None:
    for t in ts:
        assert t.stride(-1) == 1, "attention tensors need a contiguous last (head_dim) dimension"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _unified_config(num_tokens: int, num_seqs: int, head_dim: int, group: int, on_gpu: bool
                    ) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = query tokens x group heads, BLOCK_N keys, num_warps, num_stages).

    Shape-only: the mean query length T // B picks the tile height. Decode-heavy mixed batches
    want short tiles (a decode token wastes BLOCK_Q - 1 rows of MMA work), long prefills tall
    ones. Measured on an H200 (bf16, head_dim 128, 32/8 heads): see kernels/benchmark.py.
    """
    if not on_gpu:  # interpreter: small tiles keep numpy fast
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif head_dim > 128:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    elif num_tokens // max(num_seqs, 1) >= 256:
        block_m, block_n, warps, stages = 128, 32 if head_dim > 64 else 64, 4, 3
    elif num_tokens // max(num_seqs, 1) >= 16:
        block_m, block_n, warps, stages = 64, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 32, 64, 4, 3
    return max(block_m, 16, triton.next_power_of_2(group)), block_n, warps, stages


def _num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int,
                device: torch.device) -> int:
    """Segments per sequence for split-KV decode: about DECODE_PROGRAMS_PER_SM programs per SM
    (shape-only; more programs in flight hide the latency of the paged gathers), at least
    BLOCK_N keys each."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4  # interpreter: few programs
    splits = triton.cdiv(DECODE_PROGRAMS_PER_SM * sms, batch * num_kv_heads)
    return max(1, min(splits, _MAX_SPLITS, triton.cdiv(max_context, block_n)))


def _NO_PREPARE(q: torch.Tensor, KH: int) -> dict:
    """The split kernel's PREPARE arguments when it reads a ready query (never dereferenced)."""
    return dict(pos_ptr=q, cos_sin_ptr=q, q_norm_ptr=q, k_norm_ptr=q, slot_ptr=q, eps=0.0,
                stride_cs=0, PREPARE=False, HAS_NORM=False, NUM_KV_HEADS=KH)


def _NO_ORDER(q: torch.Tensor) -> dict:
    return dict(order_ptr=q, LPT=False, HAS_ORDER=False)


def _split_decode(q, stride_qt, stride_qh, out, k_cache, v_cache, k_scale, v_scale,
                  query_start_loc, seq_lens, block_table, scale_log2e, win, cap, ieee, common,
                  H, group, fp8, prepare: dict, order: torch.Tensor | None) -> torch.Tensor:
    """Split-KV decode (one query row per request), then the reduce kernel where it split.
    `order` [B]: the requests by decreasing context (a permutation), for DECODE_LPT."""
    B, D = seq_lens.shape[0], out.shape[-1]
    _, block_size, KH, _ = k_cache.shape
    on_gpu = q.is_cuda
    use_pdl = pdl.launch(q)
    block_n = DECODE_BLOCK_N if on_gpu else 16
    max_context = min(block_table.shape[1] * block_size, win)
    splits = _num_splits(B, KH, max_context, block_n, q.device)
    part_out = part_lse = out  # unused with one split
    if splits > 1:
        part_out = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    if DECODE_LPT and B <= 65535:  # (requests on grid axis z: at most 65535)
        assert order is None or order.shape[0] == B, "decode order: one entry per request"
        grid = (KH, splits, B)
        lpt = dict(order_ptr=seq_lens if order is None else order, LPT=True,
                   HAS_ORDER=order is not None)
    else:
        grid, lpt = (B, KH, splits), _NO_ORDER(q)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, part_out, part_lse, out, query_start_loc,
        seq_lens, block_table, scale_log2e, B, win, cap[0], stride_qt, stride_qh, out.stride(0),
        out.stride(1), *common, **prepare, **lpt, HEAD_DIM=D, GROUP=group, BLOCK_SIZE=block_size,
        NUM_HEADS=H, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), NUM_SPLITS=splits, ONLY_DECODE=False,
        KV_FP8=fp8, SOFTCAP=cap[1], IEEE=ieee, num_warps=DECODE_WARPS,
        num_stages=DECODE_STAGES, **use_pdl)
    if splits == 1:
        return out
    _decode_reduce_kernel[(B, H)](
        part_out, part_lse, out, query_start_loc, B, out.stride(0), out.stride(1),
        NUM_HEADS=H, HEAD_DIM=D, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if D <= 64 else 2, **use_pdl)
    return out


def fused_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                           q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, num_heads: int, scale: float, *,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           window: int = 0, softcap: float = 0.0,
                           decode_order: torch.Tensor | None = None) -> torch.Tensor:
    """prepare_qkv then paged_attention(is_decode=True), in the split-KV kernel's launches: each
    program builds its heads' query from the fused qkv row (q/k norm, RoPE), and the one whose
    segment holds the new position stores the token's k / v first. One launch fewer a layer for
    decode steps (T == B, one query row per request). Returns [T, H, D]."""
    T = qkv.shape[0]
    B = seq_lens.shape[0]
    _, block_size, KH, D = k_cache.shape
    H = num_heads
    assert T == B, f"decode attention needs one query row per request (T={T}, B={B})"
    assert qkv.shape[1] == (H + 2 * KH) * D and D % 2 == 0, "qkv / cache shape mismatch"
    _check_last_dim(qkv, cos_sin, k_cache, v_cache)
    out = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return out
    fp8, k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    win = window if window > 0 else 1 << 30
    cap = (float(softcap) * _LOG2E if softcap > 0 else 1.0, softcap > 0)
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0))
    has_norm = q_norm is not None
    prepare = dict(pos_ptr=positions, cos_sin_ptr=cos_sin, q_norm_ptr=q_norm if has_norm else cos_sin,
                   k_norm_ptr=k_norm if has_norm else cos_sin, slot_ptr=slot_mapping, eps=eps,
                   stride_cs=cos_sin.stride(0), PREPARE=True, HAS_NORM=has_norm, NUM_KV_HEADS=KH)
    return _split_decode(qkv, qkv.stride(0), D, out, k_cache, v_cache, k_scale, v_scale,
                         query_start_loc, seq_lens, block_table, scale * _LOG2E, win, cap,
                         qkv.dtype == torch.float32, common, H, H // KH, fp8, prepare,
                         decode_order)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float, *, is_decode: bool,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    window: int = 0, softcap: float = 0.0,
                    decode_order: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches [num_blocks, block_size, KH, D] (already holding this step's k/v);
    an fp8 cache is read with its scales (fp32 [] tensors, 1.0 when not given). `decode_order`
    (decode steps, DECODE_LPT): the requests by decreasing context length, a permutation of
    0..B-1 that only changes which program starts first, never the result.

    `is_decode`: the caller guarantees that every request has at most one query token (padding
    requests have none) and T == B. Never inferred from T == B: a padded prefill has that shape.
    """
    T, H, D = q.shape
    B = seq_lens.shape[0]
    _, block_size, KH, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape, "k/v cache shape mismatch"
    assert H % KH == 0, f"num_heads {H} not a multiple of num_kv_heads {KH}"
    _check_last_dim(q, k_cache, v_cache)
    group = H // KH
    out = torch.empty_like(q)
    if T == 0:
        return out
    on_gpu = q.is_cuda
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16; masked beyond D
    scale_log2e = scale * _LOG2E
    fp8, k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    win = window if window > 0 else 1 << 30
    ieee = q.dtype == torch.float32
    cap = (float(softcap) * _LOG2E if softcap > 0 else 1.0, softcap > 0)
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0))

    if is_decode:
        assert T == B, f"decode attention needs one query row per request (T={T}, B={B})"
        return _split_decode(q, q.stride(0), q.stride(1), out, k_cache, v_cache, k_scale, v_scale,
                             query_start_loc, seq_lens, block_table, scale_log2e, win, cap, ieee,
                             common, H, group, fp8, _NO_PREPARE(q, KH), decode_order)

    split_decodes = MIXED_DECODE_SPLIT and B > 1
    if split_decodes:  # one program per (request, kv head); those with q_len != 1 return
        _decode_split_kernel[(B, KH, 1)](
            q, k_cache, v_cache, k_scale, v_scale, out, out, out, query_start_loc,
            seq_lens, block_table, scale_log2e, B, win, cap[0], q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), *common, **_NO_PREPARE(q, KH), **_NO_ORDER(q),
            NUM_HEADS=H, HEAD_DIM=D,
            GROUP=group, BLOCK_SIZE=block_size, BLOCK_H=max(16, triton.next_power_of_2(group)),
            BLOCK_N=DECODE_BLOCK_N if on_gpu else 16, BLOCK_D=block_d, NUM_SPLITS=1,
            ONLY_DECODE=True, KV_FP8=fp8, SOFTCAP=cap[1], IEEE=ieee,
            num_warps=DECODE_WARPS, num_stages=DECODE_STAGES, USE_PDL=False)
    block_m, block_n, warps, stages = _unified_config(T, B, D, group, on_gpu)
    block_q = block_m // group
    grid = (T // block_q + B + 1, KH)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, query_start_loc, seq_lens, block_table,
        scale_log2e, B, T, win, cap[0], q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common,
        HEAD_DIM=D, GROUP=group, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, KV_FP8=fp8, SOFTCAP=cap[1], IEEE=ieee, num_warps=warps,
        num_stages=stages, SKIP_DECODE=split_decodes)
    return out
