"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; Kimi-K2 is the V3
architecture): multi-head latent attention (MLA), DeepSeekMoE, and V3's multi-token prediction
(MTP) layers. Config fields and tensor names are transformers'.

MLA (kernels/mla.py): q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None),
split per head into q_nope [N] and q_pe [R]; kv_a_proj_with_mqa(x) = [c_kv (L) | k_pe (R)], c_kv
RMS-normed. The paged cache keeps only [c_kv | rotated k_pe] per token (L + R values per layer,
576 for V3, against 2 x 128 heads x 192 for the decompressed keys and values). Attention runs in
the absorbed form: q_lat = W_UK^T q_nope, scores against the latent, output W_UV (p . c_kv), where
kv_b_proj = [W_UK; W_UV] per head. Prefill and decode both take that path (one op).
RoPE touches only the R rope dimensions: DeepSeek's interleaved pairs (V2 always; V3 unless
`rope_interleave` is false), default or YaRN frequencies; YaRN scales cos/sin by its attention
factor and the softmax scale by mscale(factor, mscale_all_dim)^2, as transformers does.

DeepSeekMoE: layers from `first_k_dense_replace` on replace the MLP by routed experts
(models/moe.py FusedExperts: the fused-MoE kernel, FP8 experts, TP or EP sharding) plus
`n_shared_experts` always-on experts (one GatedMLP), sharing one all-reduce. Routing: V3 sigmoid
scores plus `e_score_correction_bias` for the choice only, groups ranked by the sum of their two
best scores, the best `topk_group` of `n_group` groups kept, top-k inside them, weights from the
unbiased scores, normalized when `norm_topk_prob`; V2 softmax with `topk_method` "greedy" or
"group_limited_greedy" (groups ranked by their best score). Both scale by `routed_scaling_factor`.

MTP (V3, `num_nextn_predict_layers`): checkpoint layers model.layers.{num_hidden_layers + k}.*
load into `self.mtp[k]` (on the last pipeline stage) and never run in the main forward. A
checkpoint without them (transformers' save_pretrained drops them) simply has no `mtp`.
For speculative decoding, see `DeepseekV3ForCausalLM.mtp_forward` / `mtp_store_kv` and the
`mtp` proposer (runtime/spec_decode.py).
"""
from __future__ import annotations

import logging
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.mla import mla_attention, store_latent_ref
from .fused import FusedResidualLayer
from .layers import (
    AttnMeta, ColumnParallelLinear, GatedMLP, ParallelLMHead, RMSNorm, RowParallelLinear, building_on_meta,
    VocabParallelEmbedding, divide, yarn_mscale, yarn_rope)
from .llama import FusedDecoder, rope_params
from .moe import FusedExperts, MoECausalLM
from .parallel import ParallelInfo, tp_all_reduce
from .quantization import Unquantized
from .config_queries import rope_max_len, without_mtp  # noqa: F401
from .registry import MODELS

log = logging.getLogger("rankserve.models")

REPLICATED = ParallelInfo()  # layers every tensor-parallel rank holds whole (tp_size 1)


def mla_rope(cfg) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [R/2], cos/sin scale, softmax scale) of the rope dimensions: default or YaRN."""
    p = rope_params(cfg)
    kind = p.get("rope_type") or p.get("type") or "default"
    dim = cfg.qk_rope_head_dim
    base = float(p.get("rope_theta", 10000.0))
    softmax_scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if kind == "default":
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim), 1.0, softmax_scale
    if kind != "yarn":
        raise ValueError(f"unsupported rope_type {kind!r} for DeepSeek MLA (supported: default, yarn)")
    inv, attn_factor = yarn_rope(dim, p, cfg.max_position_embeddings)
    if p.get("mscale_all_dim"):
        factor = p.get("factor") or cfg.max_position_embeddings / p["original_max_position_embeddings"]
        softmax_scale *= yarn_mscale(factor, p["mscale_all_dim"]) ** 2
    return inv, attn_factor, softmax_scale


_TABLES: dict[tuple, tuple[torch.Tensor, float]] = {}


def mla_cos_sin(cfg) -> tuple[torch.Tensor, float]:
    """(fp32 [max_pos, R] table: cos then sin of the R/2 frequencies, times the attention factor;
    softmax scale). One table per device shared by every layer: V3's 163840 positions make it
    40 MiB, which per layer would cost 2.5 GiB."""
    n = rope_max_len(cfg)  # the positions --max-model-len may reach
    key = (repr(sorted(rope_params(cfg).items())), cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
           n, str(torch.get_default_device()))
    if building_on_meta():
        with torch.device("cpu"):
            inv, _, scale = mla_rope(cfg)
        return torch.empty(n, 2 * inv.numel(), dtype=torch.float32), scale
    if key not in _TABLES:
        inv, attn_factor, scale = mla_rope(cfg)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        _TABLES[key] = torch.cat([freqs.cos(), freqs.sin()], -1) * attn_factor, scale
    return _TABLES[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., R] by (cos, sin) [..., R/2] in fp32. Interleaved pairs (x0, x1), (x2, x3)...
    come out in rotate-half order (first elements, then second ones), as transformers returns
    them: q and k take the same permutation, so their dot products are unchanged."""
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        H = cfg.num_attention_heads
        self.num_heads = divide(H, pi.tp_size, "num_attention_heads")
        self.N, self.R, self.V, self.L = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                          cfg.kv_lora_rank)
        qk, hidden, bias = self.N + self.R, cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = cfg.q_lora_rank
        self.dtype = dtype
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [H * qk], False, pi, dtype)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, [cfg.q_lora_rank], bias, REPLICATED, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)  # transformers' default eps
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [H * qk], False, pi, dtype)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, [self.L + self.R], bias, REPLICATED, dtype)
        self.kv_a_layernorm = RMSNorm(self.L, 1e-6, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.L, [H * (self.N + self.V)], False, pi, dtype)
        self.o_proj = RowParallelLinear(H * self.V, hidden, bias, pi, dtype)
        table, self.scale = mla_cos_sin(cfg)
        # V2 rotates interleaved pairs (complex form); V3 does when rope_interleave (its default)
        self.interleave = cfg.architectures[0] == "DeepseekV2ForCausalLM" or bool(getattr(cfg, "rope_interleave", True))
        self.register_buffer("cos_sin", table, persistent=False)
        self.window = 0  # full attention (for the runner's per-kind KV report)
        # the startup log's label; the decompressed K/V it replaces, for comparison
        self.kv_kind = (f"MLA latent ({self.L} + {self.R} values; decompressed K/V would be "
                        f"{H} heads x ({qk} + {self.V}))")
        # the latent cache, bound by the model runner; v_cache stays empty (width 0)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.w_kv_b: torch.Tensor | None = None  # dense kv_b_proj when the checkpoint's is quantized
        # fp8 latent cache (--kv-cache-dtype fp8): one scale for c_kv and k_pe (stored = x /
        # k_scale), from the checkpoint's self_attn.k_scale when it has one, else 1.0
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple, tuple]:
        """One latent cache per layer: [c_kv | k_pe] per token, shared by every head."""
        return (num_blocks, block_size, 1, self.L + self.R), (num_blocks, block_size, 1, 0)

    def after_loading(self) -> None:
        """The absorbed form needs kv_b_proj's weight itself: dequantize a quantized one (FP8,
        or 4-bit as GPTQModel's / AutoAWQ's DeepSeek exports store it) once."""
        proj = self.kv_b_proj
        if not proj.quant.dense:
            w = proj.quant.dense_weight(proj).to(self.dtype)
            if self.w_kv_b is not None and self.w_kv_b.shape == w.shape and self.w_kv_b.device == w.device:
                self.w_kv_b.copy_(w)  # new weights: in place, where captured CUDA graphs read it
            else:
                self.w_kv_b = w

    def derived_weights(self) -> list[torch.Tensor]:
        return [] if self.w_kv_b is None else [self.w_kv_b]

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """What the cache keeps of each token: [normed c_kv | rotated k_pe], [T, L + R]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.L, self.R], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv.contiguous()), apply_rope(k_pe, cos, sin, self.interleave)], -1)

    def store(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The cache write of `forward` alone (eager; for tokens whose output nobody reads)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        kv = self.latent(x, cos, sin)
        if kv.is_cuda:
            from ..kernels.triton_mla import store_latent
            store_latent(kv, self.k_cache, slot_mapping, self.k_scale)
        else:
            store_latent_ref(kv, self.k_cache, slot_mapping, self.k_scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        T, H, N, R, L = x.shape[0], self.num_heads, self.N, self.R, self.L
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, N + R).split([N, R], dim=-1)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, R/2]
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], self.interleave)
        w = (self.kv_b_proj.weight if self.w_kv_b is None else self.w_kv_b).view(H, N + self.V, L)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :N]).transpose(0, 1)  # [T, H, L]
        o = mla_attention(torch.cat([q_lat, q_pe], -1), self.latent(x, cos, sin), self.k_cache,
                          self.k_scale, attn.slot_mapping, attn.query_start_loc, attn.seq_lens, attn.block_table,
                          self.scale, L, attn.is_decode)
        o = torch.bmm(o.transpose(0, 1), w[:, N:].transpose(1, 2))  # [H, T, V]
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.V))


class Router(nn.Module):
    """DeepSeek routing (see the module doc) -> (weights [T, K] fp32, expert ids [T, K])."""

    def __init__(self, cfg, v3: bool):
        super().__init__()
        E = cfg.n_routed_experts
        self.top_k, self.num_experts, self.v3 = cfg.num_experts_per_tok, E, v3
        self.scale = float(cfg.routed_scaling_factor)
        # V2: as DeepSeek's own code (transformers' V2 never normalizes; V2 configs set it false)
        self.normalize = bool(cfg.norm_topk_prob) and (v3 or self.top_k > 1)
        self.groups, self.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        self.grouped = v3 or cfg.topk_method == "group_limited_greedy"
        if self.grouped:
            divide(E, self.groups, "n_routed_experts vs n_group")
        # the router runs in fp32, as transformers keeps it
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size), requires_grad=False)
        if v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        T, G = logits.shape[0], self.groups
        if self.v3:  # the bias steers the choice only; weights come from the scores
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(-1)
        if self.grouped:  # V3 ranks groups by their two best scores, V2 by the best one
            groups = choice.view(T, G, -1)
            group_scores = groups.topk(2, dim=-1)[0].sum(-1) if self.v3 else groups.amax(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, -1)[1], 1.0)
            keep = keep.bool().unsqueeze(-1).expand(T, G, self.num_experts // G).reshape(T, -1)
            choice = choice.masked_fill(~keep, float("-inf") if self.v3 else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class DeepseekMoE(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype, v3: bool, prefix: str = ""):
        super().__init__()
        self.pi = pi
        self.gate = Router(cfg, v3)
        self.experts = FusedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, pi, dtype,
                                    prefix + ".experts")
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           pi, dtype)
            self.shared_experts.down_proj.reduce = False  # one all-reduce for both parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        ex = self.experts
        if self.pi.enable_expert_parallel:  # experts of other ranks -> -1 (skipped)
            local = ids - ex.first_expert
            ids = torch.where((local >= 0) & (local < ex.num_local), local, -1)
        y = ex(x, weights.to(x.dtype), ids.to(torch.int32))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return tp_all_reduce(y, self.pi)


class DeepseekDecoderLayer(FusedResidualLayer, nn.Module):
    """Pre-norm block (MLA, then dense MLP or DeepSeekMoE) on the fused residual stream."""

    def __init__(self, cfg, layer_id: int, pi: ParallelInfo, dtype, v3: bool):
        nn.Module.__init__(self)
        self.self_attn = MLAAttention(cfg, pi, dtype)
        if layer_id >= cfg.first_k_dense_replace and cfg.n_routed_experts:
            self.mlp = DeepseekMoE(cfg, pi, dtype, v3, f"model.layers.{layer_id}.mlp")
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, pi, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class SharedHead(nn.Module):
    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pi, dtype)


class MTPLayer(nn.Module):
    """One multi-token-prediction depth: h' = block(eh_proj([enorm(embed(t+1)) | hnorm(h)]))."""

    def __init__(self, cfg, layer_id: int, pi: ParallelInfo, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pi, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, [cfg.hidden_size], False, REPLICATED, dtype)
        self.eh_proj.set_method(Unquantized())  # 16-bit in DeepSeek-V3's FP8 checkpoint too
        self.block = DeepseekDecoderLayer(cfg, layer_id, pi, dtype, v3=True)
        self.shared_head = SharedHead(cfg, pi, dtype)


_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def check_config(cfg, v3: bool) -> None:
    """Refuse settings this implementation does not follow (rather than run them wrongly)."""
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"DeepSeek moe_layer_freq {freq} is not supported (1: every layer from "
                         "first_k_dense_replace on is MoE)")
    scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"scoring_func {scoring!r} is not supported for {cfg.architectures[0]}")
    method = getattr(cfg, "topk_method", None)
    allowed = ("noaux_tc", None) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ValueError(f"topk_method {method!r} is not supported for {cfg.architectures[0]} "
                         f"(supported: {', '.join(m for m in allowed if m)})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")


@MODELS.register("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(MoECausalLM):
    v3 = False

    def __init__(self, cfg, pi: ParallelInfo, dtype: torch.dtype):
        nn.Module.__init__(self)
        check_config(cfg, self.v3)
        self.cfg, self.pi = cfg, pi
        self.model = FusedDecoder(cfg, pi, dtype, lambda i: DeepseekDecoderLayer(cfg, i, pi, dtype, self.v3))
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if pi.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pi, dtype)
            if self.tied and pi.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight
        n_mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0 if self.v3 else 0
        if n_mtp and pi.is_last_stage:
            self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + k, pi, dtype) for k in range(n_mtp))

    def map_weight(self, name: str) -> list[tuple[str, int | None]]:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m and int(m[1]) >= self.cfg.num_hidden_layers:  # an MTP layer
            k, rest = int(m[1]) - self.cfg.num_hidden_layers, m[2]
            if not hasattr(self, "mtp") or k >= len(self.mtp):
                return []
            name = f"mtp.{k}.{'block.' if rest.startswith(_BLOCK_PARTS) else ''}{rest}"
            if rest.startswith("eh_proj.") and rest != "eh_proj.weight":
                raise ValueError(f"{name}: a quantized MTP eh_proj is not supported (16-bit only)")
        if name.endswith(".self_attn.kv_scale"):  # MLA: one latent cache, one scale (k_scale)
            return [(name.removesuffix("kv_scale") + "k_scale", None)]
        if name.endswith(".self_attn.v_scale"):
            return []  # no V cache to scale (as in vLLM)
        if ".self_attn." in name:  # MLA's projections keep their checkpoint names
            return [(name, None)]
        return super().map_weight(name)

    def drop_missing(self, missing: list[str], loaded: set[str]) -> list[str]:
        """A checkpoint without MTP weights (e.g. saved by transformers) just has no MTP."""
        if hasattr(self, "mtp") and not any(n.startswith("mtp.") for n in loaded):
            del self.mtp
            log.info("the checkpoint has no MTP layers: running without them")
            return [n for n in missing if not n.startswith("mtp.")]
        return missing

    def after_loading(self) -> None:
        for a in self.attention_layers():
            a.after_loading()

    def attention_layers(self) -> list[MLAAttention]:
        mtp = [m.block.self_attn for m in getattr(self, "mtp", ())]
        return [layer.self_attn for layer in self.model.layers.values()] + mtp

    # ---- multi-token prediction (for speculative decoding) -----------------------------------
    def mtp_forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor,
                    positions: torch.Tensor, attn: AttnMeta, k: int = 0) -> torch.Tensor:
        """Depth k of MTP: from the hidden states the main model's forward returned for tokens
        t (after its final norm; for k > 0, this method's previous output) and the ids of tokens
        t + 1, the hidden states that predict tokens t + 2 (logits: `mtp_logits`).

        `positions` rotate the pairs (vLLM's MTP drafting, and the test, use those of tokens t);
        `attn` is ordinary attention metadata: the layer's own latent cache (allocated by the
        model runner with the others, `attention_layers()[-1]`) stores the pairs at
        attn.slot_mapping, so drafting over several steps can reuse the request's block table.
        Runs on the last pipeline stage (where `mtp` lives); the `mtp` proposer runs it through
        `MTPDrafter` (CUDA graphs, torch.compile at level 2)."""
        h, y = self.mtp[k].block(self._mtp_input(hidden, next_token_ids, k), torch.zeros_like(hidden),
                                 positions, attn)
        return h + y

    def mtp_store_kv(self, hidden: torch.Tensor, next_token_ids: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor, k: int = 0) -> None:
        """`mtp_forward`'s latent-cache write alone, for pairs whose output nobody reads (a
        drafter keeping the cache in step): no attention, no MoE."""
        block = self.mtp[k].block
        x = block.input_layernorm(self._mtp_input(hidden, next_token_ids, k))
        block.self_attn.store(x, positions, slot_mapping)

    def _mtp_input(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, k: int) -> torch.Tensor:
        layer = self.mtp[k]
        e = layer.enorm(layer.embed_tokens(next_token_ids))
        return layer.eh_proj(torch.cat([e, layer.hnorm(hidden)], -1))

    def mtp_logits(self, hidden: torch.Tensor, k: int = 0) -> torch.Tensor:
        head = self.mtp[k].shared_head
        return head.head.logits(head.norm(hidden))


@MODELS.register("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True


class _Layers(nn.Module):
    """What CompiledModel compiles one by one at level 2 (`model.layers`)."""

    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)


class MTPDrafter(nn.Module):
    """Depth k of a V3 target's MTP as a model of its own, with the forward CompiledModel
    runs (runtime/compilation.py: forward(ids, positions, attn, hidden), decode and verify CUDA
    graphs over persistent buffers, `model.layers` compiled at level 2), so the `mtp` proposer
    replays its passes as CUDA graphs. The target's modules and latent cache, not copies:
    `store_only` runs `mtp_store_kv` (the latents alone; returns its input states, which
    nobody reads), else `mtp_forward` (one pass: the hidden states that predict t + 2)."""

    def __init__(self, target: DeepseekV2ForCausalLM, k: int = 0, store_only: bool = False):
        super().__init__()
        object.__setattr__(self, "target", target)  # not a submodule: the target owns its weights
        self.k, self.store_only = k, store_only
        self.model = _Layers({} if store_only else {"0": target.mtp[k].block})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
                hidden_states: torch.Tensor) -> torch.Tensor:
        if self.store_only:
            self.target.mtp_store_kv(hidden_states, input_ids, positions, attn.slot_mapping, self.k)
            return hidden_states
        return self.target.mtp_forward(hidden_states, input_ids, positions, attn, self.k)
