"""Gemma 3 (text): `Gemma3ForCausalLM`.

Differences from the Llama family (models/llama.py), all in this file:
- RMSNorm scales by (1 + weight): the loader stores 1 + weight, so the shared RMSNorm / the fused
  q/k norm inside the attention op run unchanged;
- four norms per block: `x += post_attention_norm(attn(input_norm(x)))`,
  `x += post_feedforward_norm(mlp(pre_feedforward_norm(x)))`;
- embeddings times sqrt(hidden_size) (in the model dtype, as HF);
- q/k RMSNorm; softmax scale query_pre_attn_scalar ** -0.5;
- interleaved sliding / global layers (`layer_types`), each kind with its own RoPE
  (`rope_parameters[layer_type]`: local base 10k, global 1M, optionally linear-scaled);
- optional soft-capping of the final logits (`final_logit_softcapping`); transformers' Gemma3
  attention never applies `attn_logit_softcapping` (Gemma 2 did), so neither do we;
- gelu(tanh) gated MLP.
Plain blocks (no fused residual stream: the post-norms sit between the block and the add).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import (
    Attention, AttnMeta, ColumnParallelLinear, ParallelInfo, ParallelLMHead, RMSNorm,
    RowParallelLinear, VocabParallelEmbedding)
from .llama import CausalLM, layer_window, stage_layers
from .loader import read_slice
from .registry import MODELS


def load_one_plus(param: torch.Tensor, src, shard_id=None) -> None:
    """Gemma norms scale by (1 + w): store 1 + w (added in fp32, as HF computes it)."""
    param.data.copy_(read_slice(src).float() + 1.0)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), with 1 + w stored."""

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__(dim, eps, dtype)
        self.weight.weight_loader = load_one_plus


class GeluMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with a fused gate-up projection."""

    def __init__(self, hidden: int, intermediate: int, pi: ParallelInfo, dtype=None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], False, pi, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, pi, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(g, approximate="tanh") * u)


def rope_for(cfg, layer_type: str) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:  # transformers 5: one RoPE per layer type
        return dict(params[layer_type])
    # transformers 4 configs: rope_local_base_freq for local layers, rope_theta (+ scaling) global
    if layer_type == "sliding_attention":
        return {"rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)}
    return {"rope_theta": getattr(cfg, "rope_theta", 1e6), **(getattr(cfg, "rope_scaling", None) or {})}


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, pi: ParallelInfo, dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        layer_type = cfg.layer_types[layer_id]
        self.self_attn = Attention(
            h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.max_position_embeddings, rope_for(cfg, layer_type), pi,
            bool(getattr(cfg, "attention_bias", False)), eps, dtype,
            window=layer_window(cfg, layer_id))  # no attn softcap: HF's Gemma3 ignores it too
        self.self_attn.scale = cfg.query_pre_attn_scalar ** -0.5
        for norm in (self.self_attn.q_norm, self.self_attn.k_norm):
            norm.weight.weight_loader = load_one_plus
        self.mlp = GeluMLP(h, cfg.intermediate_size, pi, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Decoder(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        self.pi = pi
        self.layer_ids = stage_layers(cfg.num_hidden_layers, pi)
        if pi.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pi, dtype)
            self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleDict({str(i): Gemma3DecoderLayer(cfg, i, pi, dtype)
                                     for i in self.layer_ids})
        if pi.is_last_stage:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, attn, hidden_states=None):
        if self.pi.is_first_stage:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF: the scale in the dtype
        else:
            x = hidden_states
        for layer in self.layers.values():
            x = layer(x, positions, attn)
        return self.norm(x) if self.pi.is_last_stage else x


@MODELS.register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(CausalLM):
    fused_residual = False
    activations = {"hidden_activation": ("gelu_pytorch_tanh", "gelu_new")}  # both tanh-approximate

    def __init__(self, cfg, pi: ParallelInfo, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.cfg, self.pi = cfg, pi
        self.model = Gemma3Decoder(cfg, pi, dtype)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or 0.0
        self.tied = bool(getattr(cfg, "tie_word_embeddings", True))
        if pi.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pi, dtype)
            if self.tied and pi.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
