"""NVIDIA Nemotron-H (`NemotronHForCausalLM`): a hybrid of Mamba2, attention and MLP blocks.

Why this family (rather than Granite 4.0-H): every Nemotron-H block is the same
`x + mixer(norm(x))` with one mixer per layer (`layers_block_type`: "linear_attention" = Mamba2,
"full_attention", "mlp"), attention has no RoPE and the MLP is a plain relu^2 one, so the new
parts are exactly the Mamba2 mixer and its per-request state; Granite 4.0-H adds MoE, four
scaling multipliers and shared experts on top of the same mixer.

Mamba2 mixer: in_proj -> [z | xBC | dt]; xBC -> silu(causal conv1d) (state: the last K - 1
inputs); SSD scan over heads (state [H, P, N], fp32 by default); y * silu(z) -> grouped RMSNorm -> out_proj.
States live per request in slots (the request's row of the model runner's input batch), are
read iff the request continues (seq_len > q_len) and written back every step; see
kernels/mamba.py. Tensor parallelism: see Mamba2Mixer.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.mamba import mamba_conv1d, ssd_scan
from .layers import (
    Attention, AttnMeta, ColumnParallelLinear, ParallelInfo, ParallelLMHead, RMSNorm,
    RowParallelLinear, VocabParallelEmbedding, building_on_meta, divide)
from .llama import KV_SCALES, CausalLM, stage_layers
from .loader import read_slice
from .parallel import tp_all_reduce
from .config_queries import ATTENTION, MAMBA, MLP, has_recurrent_state  # noqa: F401
from .registry import MODELS


class Mamba2InProj(ColumnParallelLinear):
    """in_proj -> [z | x | B | C | dt], each segment split across TP ranks on its own: z, x and
    dt by heads, B and C by groups (a group's B/C replicated on every rank whose heads read it
    when n_groups < tp). The checkpoint's one fused matrix loads as five shards."""

    def __init__(self, hidden: int, H: int, P: int, G: int, N: int, bias: bool, pi: ParallelInfo,
                 dtype, g0: int, G_loc: int):
        tp = pi.tp_size
        H_loc = divide(H, tp, "mamba_num_heads")
        sizes = [H_loc * P, H_loc * P, G_loc * N, G_loc * N, H_loc]
        super().__init__(hidden, [s * tp for s in sizes], bias, pi, dtype)
        self.output_sizes = sizes
        I, r = H * P, pi.tp_rank
        # first source row of this rank's piece of each segment
        self.src_rows = [r * H_loc * P, I + r * H_loc * P, 2 * I + g0 * N, 2 * I + (G + g0) * N,
                         2 * I + 2 * G * N + r * H_loc]

    def shard_rows(self, shard_id: int):
        return sum(self.output_sizes[:shard_id]), self.src_rows[shard_id], self.output_sizes[shard_id]

    def full_rows(self, shard_id: int) -> None:
        return None  # the segments are parts of one stored matrix


class Mamba2Mixer(nn.Module):
    """Tensor parallel as in Megatron / vLLM: heads (with their dt, A, D, conv channels and norm
    channels) split across ranks, B/C groups split too or, when n_groups < tp, the group of a
    rank's heads replicated on it; out_proj row-parallel. The gated RMSNorm normalises groups of
    I / n_groups channels: whole groups on a rank when tp divides n_groups, else one group spread
    over tp / n_groups ranks whose partial sums of squares are all-reduced."""

    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        tp, r = pi.tp_size, pi.tp_rank
        self.pi = pi
        H, self.P = cfg.mamba_num_heads, cfg.mamba_head_dim
        G, self.N, self.K = cfg.n_groups, cfg.ssm_state_size, cfg.conv_kernel
        if G % tp == 0:
            self.G, self.g0 = G // tp, r * (G // tp)  # this rank's groups
        elif tp % G == 0:
            self.G, self.g0 = 1, r * G // tp  # one group, shared with tp / G - 1 other ranks
        else:
            raise ValueError(f"Mamba2 layers need n_groups ({G}) and the tensor-parallel size "
                             f"({tp}) to divide one another")
        lo, hi = getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))
        if (float(lo), float(hi)) != (0.0, float("inf")):  # the released models' value
            raise ValueError(f"Mamba2 time_step_limit {[lo, hi]} is not supported (only [0, inf]: "
                             "dt is not clamped)")
        self.H = divide(H, tp, "mamba_num_heads")
        self.group_size = H * self.P // G  # the gated norm's groups (channels)
        self.inter = self.H * self.P
        self.conv_dim = self.inter + 2 * self.G * self.N
        self.eps = cfg.layer_norm_epsilon
        self.in_proj = Mamba2InProj(cfg.hidden_size, H, self.P, G, self.N, bool(cfg.use_bias), pi,
                                    dtype, self.g0, self.G)
        I, GN, n = H * self.P, G * self.N, self.G * self.N
        # source rows of this rank's conv channels: its x heads, then its B and C groups
        conv_rows = [(r * self.inter, self.inter), (I + self.g0 * self.N, n), (I + GN + self.g0 * self.N, n)]
        self.conv_weight = self._param((self.conv_dim, self.K), dtype, conv_rows)
        self.conv_bias = self._param((self.conv_dim,), dtype, conv_rows, 0.0) \
            if cfg.use_conv_bias else None
        heads = [(r * self.H, self.H)]
        self.dt_bias = self._param((self.H,), dtype, heads, 0.0)
        self.A_log = self._param((self.H,), dtype, heads, 0.0)
        self.D = self._param((self.H,), dtype, heads, 1.0)
        self.norm = RMSNorm(self.inter, self.eps, dtype)
        self.norm.weight.weight_loader = _rows_loader([(r * self.inter, self.inter)])
        self.out_proj = RowParallelLinear(I, cfg.hidden_size, bool(cfg.use_bias), pi, dtype)
        # the norm's group of this rank, when it spans ranks (see forward)
        onehot = torch.empty(G) if building_on_meta() else F.one_hot(torch.tensor(self.g0), G).float()
        self.register_buffer("group_onehot", onehot, persistent=False)
        # per-request state slots, bound by the model runner (like the attention KV caches)
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    @staticmethod
    def _param(shape, dtype, rows, fill=None) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape, dtype=dtype) if fill is None
                         else torch.full(shape, fill, dtype=dtype), requires_grad=False)
        p.weight_loader = _rows_loader(rows)
        return p

    def state_shapes(self, num_slots: int) -> tuple[tuple, tuple]:
        return (num_slots, self.K - 1, self.conv_dim), (num_slots, self.H, self.P, self.N)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        T = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.inter, self.conv_dim, self.H], dim=-1)
        xbc = mamba_conv1d(xbc.contiguous(), self.conv_weight, self.conv_bias, self.conv_state,
                           attn.query_start_loc, attn.seq_lens, attn.state_idx, attn.is_decode)
        xs, B, C = xbc.split([self.inter, self.G * self.N, self.G * self.N], dim=-1)
        y = ssd_scan(xs.reshape(T, self.H, self.P), dt.contiguous(), self.dt_bias,
                     -torch.exp(self.A_log.float()), B.reshape(T, self.G, self.N),
                     C.reshape(T, self.G, self.N), self.D, self.ssm_state, attn.query_start_loc,
                     attn.seq_lens, attn.state_idx, attn.is_decode)
        # gated RMSNorm over groups of I / n_groups channels (fp32), then the weight
        h = y.reshape(T, self.inter).float() * F.silu(z.float())
        if self.inter >= self.group_size:  # whole groups on this rank
            g = h.view(T, -1, self.group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        else:  # this rank holds part of one group: sum the squares over the group's ranks
            part = h.pow(2).sum(-1, keepdim=True) * self.group_onehot  # [T, n_groups]
            ss = tp_all_reduce(part, self.pi) @ self.group_onehot  # [T]
            g = h * torch.rsqrt(ss[:, None] / self.group_size + self.eps)
        return self.out_proj(self.norm.weight * g.reshape(T, self.inter).to(x.dtype))


def _rows_loader(rows: list[tuple[int, int]]):
    """Loads the concatenation of the source's row ranges [(first row, count), ...] (dim 0)."""
    def load(p, src, shard_id=None):
        parts = [read_slice(src, slice(a, a + n)) for a, n in rows]
        p.data.copy_(torch.cat(parts).reshape(p.shape))
    return load


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
            if not building_on_meta():  # there the table is a shape (models/layers.py)
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
    activations = {"mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu", "swish")}

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
        layer, _, rest = name.partition(".mixer.")
        if rest in KV_SCALES:  # the attention blocks' fp8 KV-cache scales (model runner)
            return [(f"{layer}.mixer.{t}", None) for t in KV_SCALES[rest]]
        if ".mixer.in_proj." in name:  # [z | x | B | C | dt]: five shards (Mamba2InProj)
            return [(name, shard) for shard in range(5)]
        for part, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
            if f".mixer.{part}." in name:
                return [(name.replace(part, "qkv_proj"), shard)]
        return [(name, None)]

    def attention_layers(self) -> list[Attention]:
        return [b.mixer for b in self.model.layers.values() if b.kind == ATTENTION]

    def mamba_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.model.layers.values() if b.kind == MAMBA]
