"""Paged attention over the block table: one registered custom op for prefill, chunked prefill,
prefix extension and decode (mixed in one batch).

Layout (shared by the KV-cache allocator, the model runner and the kernels):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T = padded token count)
  slot_mapping: int64 [T], block_id * block_size + offset, -1 for padding tokens (write nothing)
  query_start_loc: int32 [B + 1], cumulative query lengths (tokens of request i are
      q[query_start_loc[i]:query_start_loc[i+1]])
  seq_lens: int32 [B], context length of request i *including* this step's tokens
  block_table: int32 [B, max_blocks]
Query token j of request i sits at position seq_lens[i] - q_len_i + j and attends causally to
every cached or new key up to that position. Rows past query_start_loc[-1] are padding: 0.

The CPU path is the plain-torch reference below; on CUDA the Triton kernels are used.
"""
from __future__ import annotations

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch reference (caches already hold this step's keys and values)."""
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        nblk = (seq_len + block_size - 1) // block_size
        blocks = block_table[i, :nblk].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]
        vals = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len]
        qi = q[start:end].float().transpose(0, 1)  # [H, q_len, D]
        ki = keys.float().transpose(0, 1).repeat_interleave(group, 0)  # [H, S, D]
        vi = vals.float().transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        out[start:end] = torch.matmul(scores.softmax(-1), vi).transpose(0, 1).to(q.dtype)
    return out


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


@torch.library.custom_op("rankserve::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Store this step's k/v into the paged cache, then attend (see module doc)."""
    if _use_triton(q):
        from rankserve.kernels import triton_attention
        triton_attention.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return triton_attention.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                                block_table, scale)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens, block_table, scale):
    return torch.empty_like(q)
