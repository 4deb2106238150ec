"""Paged attention over the block table: one registered custom op, `rankserve::attention`, for
prefill, chunked prefill, prefix extension and decode (mixed in one batch). It takes the fused qkv
projection and does everything up to the attention output, so a decoder layer spends two kernels
between its qkv and o_proj GEMMs: one for q/k RMSNorm (Qwen3) + RoPE + the KV-cache store, one
for attention (plus a reduce for split-KV decode).

Layout (shared by the KV-cache allocator, the model runner and the kernels):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], q heads then k heads then v heads
  q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T = padded token count)
  positions: int64 [T]; cos_sin: fp32 [max_pos, head_dim], cos then sin of each position
  slot_mapping: int64 [T], block_id * block_size + offset, -1 for padding tokens (write nothing)
  query_start_loc: int32 [B + 1], cumulative query lengths (tokens of request i are
      q[query_start_loc[i]:query_start_loc[i+1]])
  seq_lens: int32 [B], context length of request i *including* this step's tokens
  block_table: int32 [B, max_blocks]
  k_scale, v_scale: fp32 scalar tensors [] (per layer), used only by an fp8 cache (below)
  is_decode: the caller's promise that every request has at most one query token and T == B
      (padding requests have none); it selects the split-KV decode kernel. Decided by the model
      runner from the plan, never from shapes: padding can make T == B in a prefill step.
FP8 KV cache (caches of dtype torch.float8_e4m3fn, `FP8_KV`): a key is stored as
  fp8(clamp(k / k_scale, -448, 448)) (round to nearest even; e4m3's finite range is +-448) and read
  back as fp32(cache) * k_scale; the same for values with v_scale. Scales are tensors, so a CUDA
  graph reads their current values. Any other cache dtype ignores them.
Query token j of request i sits at position seq_lens[i] - q_len_i + j and attends causally to
every cached or new key up to that position. Rows past query_start_loc[-1] are padding: 0.
Sliding window (`window` > 0, per layer; 0 = full attention): a key at position p is visible to a
query at q iff q - window < p <= q (HF's convention: the window counts the query's own token), so
blocks wholly before q - window + 1 are never read (the KV-cache manager may already have freed
them; their block-table entries may hold anything). Soft-capping (`softcap` > 0, Gemma 2 style):
scores s become softcap * tanh(s / softcap) before the softmax.

The CPU path is the plain-torch reference below; on CUDA the Triton kernels are used.
"""
from __future__ import annotations

import torch

from .custom_op import custom_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)  # HF casts before the weight; parity needs the same


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout) in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale saturated to +-448, as e4m3 (round to nearest even)."""
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache entries as fp32 (fp8 ones times their scale)."""
    if x.dtype != FP8_KV:
        return x.float()
    return x.float() if scale is None else x.float() * scale


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[valid]
        if cache.dtype == FP8_KV:  # index_copy_ has no fp8 kernels: move the bytes
            cache, x = cache.view(torch.uint8), quantize_fp8(x, s).view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float, *, is_decode: bool = False,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Plain-torch reference (caches already hold this step's keys and values). Any mode
    computes the same; `is_decode` is only checked, so the CPU path enforces the kernel contract."""
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if is_decode:
        assert q.shape[0] == len(lens) and all(b - a <= 1 for a, b in zip(qsl, qsl[1:])), \
            "decode attention needs at most one query token per request and T == B"
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        nblk = (seq_len + block_size - 1) // block_size
        # with a window, blocks before the first query's window are skipped (maybe freed)
        first = max(0, seq_len - q_len - window + 1) // block_size if window > 0 else 0
        blocks = block_table[i, first:nblk].long()
        n = seq_len - first * block_size
        keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:n]
        vals = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:n]
        qi = q[start:end].float().transpose(0, 1)  # [H, q_len, D]
        ki = dequantize_kv(keys, k_scale).transpose(0, 1).repeat_interleave(group, 0)  # [H, S, D]
        vi = dequantize_kv(vals, v_scale).transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first * block_size, seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = torch.matmul(scores.softmax(-1), vi).transpose(0, 1).to(q.dtype)
    return out


def prepare_qkv_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_heads: int, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q/k RMSNorm (when given), RoPE, store k/v into the cache; returns q [T, H, D]."""
    T = qkv.shape[0]
    KH, D = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.view(T, -1, D).split([num_heads, KH, KH], dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


@custom_op("rankserve::attention", mutates_args=("k_cache", "v_cache"))
def attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
              k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
              seq_lens: torch.Tensor, block_table: torch.Tensor, num_heads: int, scale: float,
              is_decode: bool, window: int = 0, softcap: float = 0.0,
              decode_order: torch.Tensor | None = None) -> torch.Tensor:
    """qkv projection -> attention output [T, num_heads * head_dim] (see module doc).
    `decode_order`: the order decode programs start in (kernels/triton_attention.py DECODE_LPT);
    it never changes the result."""
    T = qkv.shape[0]
    if qkv.is_cuda:
        from . import triton_attention as ta
        if is_decode and T <= ta.FUSED_DECODE_MAX_B:
            return ta.fused_decode_attention(
                qkv, positions, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
                query_start_loc, seq_lens, block_table, num_heads, scale, k_scale=k_scale,
                v_scale=v_scale, window=window, softcap=softcap,
                decode_order=decode_order).view(T, -1)
        q = ta.prepare_qkv(qkv, positions, cos_sin, q_norm, k_norm, eps, k_cache, v_cache,
                           slot_mapping, num_heads, k_scale, v_scale)
        out = ta.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                 scale, is_decode=is_decode, k_scale=k_scale, v_scale=v_scale,
                                 window=window, softcap=softcap, decode_order=decode_order)
    else:
        q = prepare_qkv_ref(qkv, positions, cos_sin, q_norm, k_norm, eps, k_cache, v_cache,
                            slot_mapping, num_heads, k_scale, v_scale)
        out = paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                  scale, is_decode=is_decode, k_scale=k_scale, v_scale=v_scale,
                                  window=window, softcap=softcap)
    return out.view(T, -1)


@attention.register_fake
def _(qkv, positions, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, k_scale, v_scale,
      slot_mapping, query_start_loc, seq_lens, block_table, num_heads, scale, is_decode,
      window=0, softcap=0.0, decode_order=None):
    return qkv.new_empty(qkv.shape[0], num_heads * k_cache.shape[3])
