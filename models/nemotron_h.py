"""NVIDIA Nemotron-H (`NemotronHForCausalLM`): a hybrid of Mamba2, attention and MLP blocks.

Why this family (rather than Granite 4.0-H): every Nemotron-H block is the same
`x + mixer(norm(x))` with one mixer per layer (`layers_block_type`: "linear_attention" = Mamba2,
"full_attention", "mlp"), attention has no RoPE and the MLP is a plain relu^2 one, so the new
parts are exactly the Mamba2 mixer and its per-request state; Granite 4.0-H adds MoE, four
scaling multipliers and shared experts on top of the same mixer.

Mamba2 mixer: in_proj -> [z | xBC | dt]; xBC -> silu(causal conv1d) (state: the last K - 1
inputs); SSD scan over heads (state [H, P, N] fp32); y * silu(z) -> grouped RMSNorm -> out_proj.
States live per request in slots (the request's row of the model runner's input batch), are
read iff the request continues (seq_len > q_len) and written back every step; see
kernels/mamba.py. Tensor parallelism is not supported for the Mamba2 mixer yet (tp = 1).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.mamba import mamba_conv1d, ssd_scan
from .layers import (
    Attention, AttnMeta, ColumnParallelLinear, ParallelInfo, ParallelLMHead, RMSNorm,
    RowParallelLinear, VocabParallelEmbedding)
from .llama import CausalLM, stage_layers
from .loader import read_slice
from .registry import MODELS

MAMBA, ATTENTION, MLP = "linear_attention", "full_attention", "mlp"


def has_recurrent_state(cfg) -> bool:
    return MAMBA in (getattr(cfg, "layers_block_type", None) or ())


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        if pi.tp_size != 1:
            raise ValueError("Mamba2 layers do not support tensor parallelism yet (use --tp 1)")
        self.H, self.P = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.G, self.N, self.K = cfg.n_groups, cfg.ssm_state_size, cfg.conv_kernel
        self.inter = self.H * self.P
        self.conv_dim = self.inter + 2 * self.G * self.N
        self.eps = cfg.layer_norm_epsilon
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [self.inter + self.conv_dim + self.H],
                                            bool(cfg.use_bias), pi, dtype)
        conv = dict(dtype=dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.K, **conv), requires_grad=False)
        self.conv_weight.weight_loader = lambda p, src, shard_id=None: p.data.copy_(
            read_slice(src).reshape(p.shape))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim, **conv), requires_grad=False) \
            if cfg.use_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.H, **conv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.H, **conv), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.H, **conv), requires_grad=False)
        self.norm = RMSNorm(self.inter, self.eps, dtype)
        self.out_proj = RowParallelLinear(self.inter, cfg.hidden_size, bool(cfg.use_bias), pi, dtype)
        # per-request state slots, bound by the model runner (like the attention KV caches)
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def state_shapes(self, num_slots: int) -> tuple[tuple, tuple]:
        return (num_slots, self.K - 1, self.conv_dim), (num_slots, self.H, self.P, self.N)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        T = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.inter, self.conv_dim, self.H], dim=-1)
        xbc = mamba_conv1d(xbc.contiguous(), self.conv_weight, self.conv_bias, self.conv_state,
                           attn.query_start_loc, attn.seq_lens, attn.state_idx)
        xs, B, C = xbc.split([self.inter, self.G * self.N, self.G * self.N], dim=-1)
        y = ssd_scan(xs.reshape(T, self.H, self.P), dt.contiguous(), self.dt_bias,
                     -torch.exp(self.A_log.float()), B.reshape(T, self.G, self.N),
                     C.reshape(T, self.G, self.N), self.D, self.ssm_state, attn.query_start_loc,
                     attn.seq_lens, attn.state_idx, attn.is_decode)
        # gated RMSNorm over groups of inter / G channels (fp32), then the weight
        h = y.reshape(T, self.inter).float() * F.silu(z.float())
        g = h.view(T, self.G, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj(self.norm.weight * g.view(T, self.inter).to(x.dtype))


class Relu2MLP(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], cfg.mlp_bias, pi, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, pi, dtype)

    def forward(self, x: torch.Tensor, positions=None, attn=None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, cfg, layer_id: int, pi: ParallelInfo, dtype):
        super().__init__()
        self.kind = cfg.layers_block_type[layer_id]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)
        if self.kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, pi, dtype)
        elif self.kind == ATTENTION:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.mixer = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   head_dim, cfg.max_position_embeddings, {}, pi, False, None, dtype)
            # no positional encoding: RoPE with cos 1, sin 0 is the identity, exactly
            table = torch.cat([torch.ones(cfg.max_position_embeddings, head_dim // 2),
                               torch.zeros(cfg.max_position_embeddings, head_dim // 2)], -1)
            self.mixer.cos_sin = table.to(self.mixer.cos_sin.device)
        elif self.kind == MLP:
            self.mixer = Relu2MLP(cfg, pi, dtype)
        else:
            raise ValueError(f"unsupported Nemotron-H block type {self.kind!r} (mamba, attention, mlp)")

    def forward(self, x, positions, attn):
        if self.kind == MLP:
            return x + self.mixer(self.norm(x))
        return x + self.mixer(self.norm(x), positions, attn)


class NemotronHModel(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        self.pi = pi
        self.layer_ids = stage_layers(cfg.num_hidden_layers, pi)
        if pi.is_first_stage:
            self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pi, dtype)
        self.layers = nn.ModuleDict({str(i): NemotronHBlock(cfg, i, pi, dtype) for i in self.layer_ids})
        if pi.is_last_stage:
            self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)

    def forward(self, input_ids, positions, attn, hidden_states=None):
        x = self.embeddings(input_ids) if self.pi.is_first_stage else hidden_states
        for layer in self.layers.values():
            x = layer(x, positions, attn)
        return self.norm_f(x) if self.pi.is_last_stage else x


@MODELS.register("NemotronHForCausalLM")
class NemotronHForCausalLM(CausalLM):
    fused_residual = False

    def __init__(self, cfg, pi: ParallelInfo, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.cfg, self.pi = cfg, pi
        self.model = NemotronHModel(cfg, pi, dtype)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if pi.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pi, dtype)
            if self.tied and pi.is_first_stage:
                self.lm_head.weight = self.model.embeddings.weight

    def map_weight(self, name: str) -> list[tuple[str, int | None]]:
        if name == "lm_head.weight" and self.tied:
            return []
        name = name.replace("backbone.", "model.")  # original Nemotron-H checkpoints
        name = name.replace(".mixer.conv1d.weight", ".mixer.conv_weight")
        name = name.replace(".mixer.conv1d.bias", ".mixer.conv_bias")
        for part, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
            if f".mixer.{part}." in name:
                return [(name.replace(part, "qkv_proj"), shard)]
        return [(name, None)]

    def attention_layers(self) -> list[Attention]:
        return [b.mixer for b in self.model.layers.values() if b.kind == ATTENTION]

    def mamba_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.model.layers.values() if b.kind == MAMBA]
