"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: one registered
custom op, `rankserve::mla_attention`, for prefill, chunked prefill, prefix extension and decode.

MLA caches, per token and layer, one compressed latent instead of per-head keys and values:
c_kv (L = kv_lora_rank values, RMS-normed) and the shared RoPE key k_pe (R = qk_rope_head_dim
values). Head h's key is [W_UK[h] c_kv | k_pe] and its value W_UV[h] c_kv (kv_b_proj holds
W_UK and W_UV). The op runs the absorbed form: with q_lat[h] = W_UK[h]^T q_nope[h],

  score(h, s) = q_nope[h] . W_UK[h] c_kv(s) + q_pe[h] . k_pe(s) = [q_lat[h] | q_pe[h]] . cache(s)
  out[h]      = sum_s p(h, s) W_UV[h] c_kv(s) = W_UV[h] (sum_s p(h, s) c_kv(s)),

so attention is multi-query attention with one shared "head" of width L + R for keys and its first
L values for values; the model multiplies by W_UK before and by W_UV after (batched GEMMs).

Layout (shared by the KV-cache allocator, the model runner and the kernels):
  kv_cache: [num_blocks, block_size, 1, L + R]: c_kv then k_pe (already rotated) of each token
  q: [T, H, L + R]: q_lat then the rotated q_pe of each head (T = padded token count)
  kv: [T, L + R]: this step's c_kv and rotated k_pe, stored at slot_mapping (-1: padding, skipped)
  out: [T, H, L], the attention-weighted latent (rows past query_start_loc[-1]: zeros)
  query_start_loc, seq_lens, block_table, is_decode: as in kernels/attention.py
  kv_scale: fp32 scalar tensor []: an FP8 cache (torch.float8_e4m3fn) stores
      fp8(clamp(x / kv_scale, -448, 448)) and reads fp32(cache) * kv_scale (one scale per layer, for
      c_kv and k_pe alike, as kernels/attention.py's k_scale); a 16-bit cache ignores it
The CPU path is the plain-torch reference below; on CUDA the Triton kernel (kernels/triton_mla.py).
"""
from __future__ import annotations

import torch

from .attention import FP8_KV, dequantize_kv, quantize_fp8
from .custom_op import custom_op


def store_latent_ref(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_scale: torch.Tensor | None = None) -> None:
    valid = slot_mapping >= 0
    x, cache = kv[valid], kv_cache.view(-1, kv_cache.shape[-1])
    if cache.dtype == FP8_KV:  # index_copy_ has no fp8 kernels: move the bytes
        cache, x = cache.view(torch.uint8), quantize_fp8(x, kv_scale).view(torch.uint8)
    cache.index_copy_(0, slot_mapping[valid], x.to(cache.dtype))


def mla_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                      kv_lora_rank: int, is_decode: bool = False,
                      kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in fp32 (the cache already holds this step's latents) -> [T, H, L]."""
    T, H, _ = q.shape
    L = kv_lora_rank
    out = torch.zeros(T, H, L, dtype=q.dtype, device=q.device)
    block_size = kv_cache.shape[1]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    if is_decode:
        assert T == len(lens) and all(b - a <= 1 for a, b in zip(qsl, qsl[1:])), \
            "decode attention needs at most one query token per request and T == B"
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        nblk = -(-seq_len // block_size)
        keys = kv_cache[block_table[i, :nblk].long()].reshape(-1, kv_cache.shape[-1])[:seq_len]
        keys = dequantize_kv(keys, kv_scale)
        qi = q[start:end].float()  # [q_len, H, L + R]
        scores = torch.einsum("qhd,sd->hqs", qi, keys) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(seq_len, device=q.device)[None, :] > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hqs,sl->qhl", scores.softmax(-1), keys[:, :L]).to(q.dtype)
    return out


@custom_op("rankserve::mla_attention", mutates_args=("kv_cache",))
def mla_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                  kv_scale: torch.Tensor, slot_mapping: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, scale: float, kv_lora_rank: int,
                  is_decode: bool) -> torch.Tensor:
    """Store this step's latents, then absorbed-form attention over the paged latent cache."""
    if q.is_cuda:
        from .triton_mla import mla_attention_triton, store_latent
        store_latent(kv, kv_cache, slot_mapping, kv_scale)
        return mla_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale,
                                    kv_lora_rank, is_decode, kv_scale)
    store_latent_ref(kv, kv_cache, slot_mapping, kv_scale)
    return mla_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_table, scale,
                             kv_lora_rank, is_decode, kv_scale)


@mla_attention.register_fake
def _(q, kv, kv_cache, kv_scale, slot_mapping, query_start_loc, seq_lens, block_table, scale,
      kv_lora_rank, is_decode):
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
