"""Dense decoder family: Llama (2/3/3.1 RoPE scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Written for torch.compile(fullgraph=True): no data-dependent Python control flow, the token
dimension is the only dynamic one. Parameter names follow the HF checkpoints, with q/k/v and
gate/up fused (see `STACKED`). Pipeline parallelism builds only this stage's layers.

The blocks are plain pre-norm blocks; the family opts in to the fused residual/norm fast path
(models/fused.py), which runs the same blocks on a (h, delta) residual stream.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config_queries import rope_max_len
from .fused import FusedResidualDecoder, FusedResidualLayer
from .layers import (
    Attention, AttnMeta, GatedMLP, ParallelInfo, ParallelLMHead, RMSNorm, VocabParallelEmbedding)
from .registry import MODELS


# (fused param, checkpoint name, shard id)
STACKED = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


# fp8 KV-cache scales in checkpoints (name after "self_attn.") → the Attention buffers they set
KV_SCALES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",),
             "k_proj.output_scale": ("k_scale",), "v_proj.output_scale": ("v_scale",),
             "k_proj.k_scale": ("k_scale",), "v_proj.v_scale": ("v_scale",),  # ModelOpt
             "kv_scale": ("k_scale", "v_scale")}  # older checkpoints: one scale for both


def rope_params(cfg) -> dict:
    """RoPE settings from either transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`)."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    out = {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    out.update(getattr(cfg, "rope_scaling", None) or {})
    return out


def layer_window(cfg, layer_id: int) -> int:
    """Sliding window of a layer in tokens, 0 for full attention. HF's rules: Mistral windows
    every layer when `sliding_window` is set; Qwen2/Qwen3/Gemma3 (transformers 5 fills
    `layer_types` from `use_sliding_window` / `max_window_layers`) window the layers typed
    "sliding_attention"."""
    window = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None)
    if not window or cfg.architectures[0] == "MistralForCausalLM" or not types:
        return window
    return window if types[layer_id] == "sliding_attention" else 0


def kv_sliding_window(cfg) -> int:
    """The window shared by every attention layer, else 0 (some layer attends to everything):
    only then can the KV-cache manager release blocks that leave the window."""
    if not getattr(cfg, "architectures", None) or not hasattr(cfg, "num_hidden_layers"):
        return 0
    windows = {layer_window(cfg, i) for i in range(cfg.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else 0


def stage_layers(num_layers: int, pi: ParallelInfo) -> range:
    """Contiguous layer range of this pipeline stage (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pi.pp_size)
    start = pi.pp_rank * base + min(pi.pp_rank, extra)
    return range(start, start + base + (pi.pp_rank < extra))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, pi: ParallelInfo, dtype, mlp: nn.Module,
                 qkv_bias: bool, qk_norm: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
            rope_max_len(cfg), rope_params(cfg), pi, qkv_bias,
            cfg.rms_norm_eps if qk_norm else None, dtype, window=layer_window(cfg, layer_id))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype, make_layer):
        super().__init__()
        self.pi = pi
        self.layer_ids = stage_layers(cfg.num_hidden_layers, pi)
        if pi.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pi, dtype)
        # keyed by the global layer index so checkpoint names map directly
        self.layers = nn.ModuleDict({str(i): make_layer(i) for i in self.layer_ids})
        if pi.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, attn, hidden_states=None):
        x = self.embed_tokens(input_ids) if self.pi.is_first_stage else hidden_states
        for layer in self.layers.values():
            x = layer(x, positions, attn)
        return self.norm(x) if self.pi.is_last_stage else x


class FusedDecoderLayer(FusedResidualLayer, DecoderLayer):
    """DecoderLayer on the fused residual stream (models/fused.py)."""


class FusedDecoder(FusedResidualDecoder, Decoder):
    """Decoder threading the fused residual stream (models/fused.py)."""


@MODELS.register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class CausalLM(nn.Module):
    # Opt in to the fused residual/norm fast path (models/fused.py); same outputs as the plain
    # blocks above, fewer kernels per layer. The MoE families inherit it.
    fused_residual = True
    activations = {"hidden_act": ("silu", "swish")}  # config field -> what the MLP runs (loader)

    def __init__(self, cfg, pi: ParallelInfo, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.pi = cfg, pi
        arch = cfg.architectures[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        qk_norm = arch.startswith("Qwen3")
        decoder, layer = (FusedDecoder, FusedDecoderLayer) if self.fused_residual else (Decoder, DecoderLayer)
        self.model = decoder(cfg, pi, dtype, lambda i: layer(
            cfg, i, pi, dtype, self.make_mlp(cfg, i, pi, dtype), qkv_bias, qk_norm))
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if pi.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pi, dtype)
            if self.tied and pi.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, cfg, layer_id, pi, dtype) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, pi, dtype,
                        bias=bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn, hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def map_weight(self, name: str) -> list[tuple[str, int | None]]:
        """Checkpoint tensor name → [(parameter name, shard id)] ([] to skip)."""
        if "rotary_emb" in name:
            return []
        if name == "lm_head.weight" and self.tied:
            return []
        if name == "model.embed_tokens.weight" and self.tied and not self.pi.is_first_stage:
            name = "lm_head.weight"  # tied head on a later stage loads from the embedding
        layer, _, rest = name.partition(".self_attn.")
        if rest in KV_SCALES:  # buffers: the model runner loads them, not load_weights
            return [(f"{layer}.self_attn.{t}", None) for t in KV_SCALES[rest]]
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                return [(name.replace(part, fused), shard)]
        return [(name, None)]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers.values()]
