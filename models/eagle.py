"""EAGLE-1 and EAGLE-3 draft heads (speculative decoding: the `eagle` / `eagle3` proposers in
runtime/spec_decode.py).

A head is a Llama decoder layer (or a few) that reads the target's hidden states beside the
token embeddings. The proposer feeds it pairs (h_t, token t + 1) at position t, in the target's
block layout, with a KV cache of its own; one step of it gives the hidden state that predicts
token t + 2.

- EAGLE-1 (`EagleLlamaForCausalLM`, the EAGLE repository's `cnets1.Model`; e.g.
  yuhuili/EAGLE-LLaMA3.1-Instruct-8B): x = fc([embed(t + 1) | h_t]) with h_t the target's last
  hidden state after its final norm, then the layers (layer 0 without input_layernorm), no
  final norm; logits from the target's lm_head. Tensors: fc.weight [H, 2H] (fc.bias if the
  config's `bias`, default true), layers.{i}.*; embed_tokens.weight (a frozen copy of the
  target's) is not loaded: the target's embedding is used.
- EAGLE-3 (`Eagle3LlamaForCausalLM`; the EAGLE repository's `cnets.Model`, architectures
  `LlamaForCausalLMEagle3`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; and the `speculators`
  format, RedHatAI/...speculator.eagle3): the target's hidden states h_t are the residual
  stream entering three of its layers (`eagle_aux_hidden_state_layer_ids`, default 2,
  L // 2, L - 3), concatenated, reduced by fc.weight [H, 3 H_target] (`combine`); layer 0
  attends over [input_layernorm(embed(t + 1)) | hidden_norm(h)] (q/k/v_proj take 2H), its
  residual is h (hidden_norm(h) with `norm_before_residual`); later steps feed back the
  layer's output (before `norm`). Logits: lm_head [draft_vocab, H] after `norm`; draft id d is
  target id d + d2t[d]. Tensors: midlayer.* (speculators: layers.0.*), fc.weight, norm.weight,
  lm_head.weight, d2t, t2d (unused); embed_tokens.weight if trained, else the target's.

Tensor parallelism: the layers are sharded as the target's (heads, MLP); fc is replicated; the
EAGLE-3 lm_head is vocab-parallel like any other.
"""
from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn as nn

from .layers import (
    Attention, AttnMeta, ColumnParallelLinear, GatedMLP, ParallelInfo, ParallelLMHead,
    QKVParallelLinear, RMSNorm, VocabParallelEmbedding)
from .llama import STACKED, DecoderLayer, rope_params
from .registry import MODELS

REPLICATED = ParallelInfo()  # fc: every tensor-parallel rank holds it whole
EAGLE1 = "EagleLlamaForCausalLM"
EAGLE3 = "Eagle3LlamaForCausalLM"
# architectures names in published configs → the class of each method
ARCHS = {"eagle": (EAGLE1, "LlamaForCausalLM", "EagleLlamaForCausalLM"),
         "eagle3": (EAGLE3, "LlamaForCausalLMEagle3", "Eagle3Speculator", "LlamaForCausalLM")}


def load_head_config(path: str, method: str):
    """The head's config as a LlamaConfig (the `speculators` format flattened: its
    transformer_layer_config plus the EAGLE-3 fields), with `architectures` set to this
    engine's class of the method. Refuses configs of the other method or of no head."""
    import transformers
    flag = "--speculative-config"
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != "eagle3" or method != "eagle3":
            raise ValueError(f"{flag}: {path!r} is a speculators {kind!r} checkpoint; method "
                             f"{method} reads {'EAGLE-3 ones' if method == 'eagle3' else 'none'}")
        if raw.get("norm_before_fc"):
            raise ValueError(f"{flag}: {path!r}: norm_before_fc is not supported")
        layer = dict(raw.get("transformer_layer_config") or {})
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if raw.get(key) is not None:
                layer[key] = raw[key]
        layer["norm_before_residual"] = raw.get("norm_before_residual", True)
        raw = layer
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch in ARCHS["eagle3" if method == "eagle" else "eagle"] and arch != "LlamaForCausalLM":
        other = "eagle3" if method == "eagle" else "eagle"
        raise ValueError(f"{flag}: {path!r} is an {other.upper().replace('3', '-3')} head "
                         f"({arch}); use method {other!r}")
    if arch not in ARCHS[method]:
        raise ValueError(f"{flag}: {path!r} ({arch}) is not an EAGLE{'-3' if method == 'eagle3' else ''} "
                         f"head (architectures {', '.join(ARCHS[method][1:])})")
    if raw.get("add_para_norm"):  # HASS: norms on the embedding and hidden inputs
        raise ValueError(f"{flag}: {path!r}: add_para_norm (HASS heads) is not supported")
    raw.pop("model_type", None)
    cfg = transformers.LlamaConfig(**raw)
    cfg.architectures = [ARCHS[method][0]]
    return cfg


def check_head(cfg, shapes: dict[str, tuple] | None, target_cfg, method: str, path: str) -> None:
    """Refuse a head that does not fit the target, naming the mismatch (before any weight is
    read). `shapes`: the checkpoint's tensors (None with dummy weights)."""
    flag = f"--speculative-config: EAGLE{'-3' if method == 'eagle3' else ''} head {path!r}"
    H, Ht = cfg.hidden_size, target_cfg.hidden_size
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{flag}: its vocab_size ({cfg.vocab_size}) differs from the target's "
                         f"({target_cfg.vocab_size}); a head is trained for one target")
    if method == "eagle" and H != Ht:
        raise ValueError(f"{flag}: its hidden_size ({H}) differs from the target's ({Ht})")
    if shapes is None:
        return
    names = {n.removeprefix("model.") for n in shapes}
    if "fc.weight" not in names:
        raise ValueError(f"{flag} has no fc.weight: not an EAGLE head (a small draft model is "
                         "method draft_model)")
    fc = shapes.get("fc.weight") or shapes["model.fc.weight"]
    eagle3_like = any(n.startswith("midlayer.") or n == "d2t" or ".hidden_norm." in n for n in names)
    if method == "eagle" and (eagle3_like or fc[1] != 2 * H):
        raise ValueError(f"{flag} is an EAGLE-3 head (fc.weight {list(fc)}, midlayer / "
                         "hidden_norm / d2t tensors); use method 'eagle3'")
    if method == "eagle3":
        if not eagle3_like:
            raise ValueError(f"{flag} has no hidden_norm / midlayer tensors: an EAGLE-1 head? "
                             "Use method 'eagle'")
        n_aux = len(aux_layer_ids(cfg, target_cfg.num_hidden_layers))
        if fc != (H, n_aux * Ht):
            raise ValueError(f"{flag}: fc.weight is {list(fc)}; the target ({Ht} wide, {n_aux} "
                             f"auxiliary layers) needs [{H}, {n_aux * Ht}]")
    emb = shapes.get("embed_tokens.weight") or shapes.get("model.embed_tokens.weight")
    if emb is not None and tuple(emb) != (target_cfg.vocab_size, H):
        raise ValueError(f"{flag}: embed_tokens.weight is {list(emb)}, not [{target_cfg.vocab_size}, {H}]")


def aux_layer_ids(cfg, num_target_layers: int) -> list[int]:
    """The target depths EAGLE-3 reads (the stream entering layer i), in the target's layer
    order: the config's `eagle_aux_hidden_state_layer_ids`, else 2, L // 2, L - 3."""
    L = num_target_layers
    ids = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or [2, L // 2, L - 3]
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise ValueError(f"--speculative-config: EAGLE-3 auxiliary layer(s) {bad} outside the "
                         f"target's 0..{L} (a {L}-layer target; set eagle_aux_hidden_state_layer_ids "
                         "in the head's config.json)")
    return sorted(set(ids))


class Eagle1Layer0(nn.Module):
    """EAGLE-1's first layer: a Llama block without input_layernorm."""

    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        self.self_attn = _attention(cfg, pi, dtype, cfg.hidden_size)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, pi, dtype,
                            bias=bool(getattr(cfg, "mlp_bias", False)))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        x = x + self.self_attn(x, positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Layer0(nn.Module):
    """EAGLE-3's first layer: attention over [input_layernorm(embeds) | hidden_norm(h)]."""

    def __init__(self, cfg, pi: ParallelInfo, dtype):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = _attention(cfg, pi, dtype, 2 * H)
        self.mlp = GatedMLP(H, cfg.intermediate_size, pi, dtype, bias=bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                attn: AttnMeta) -> torch.Tensor:
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), hn], -1), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def _attention(cfg, pi: ParallelInfo, dtype, in_features: int) -> Attention:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bias = bool(getattr(cfg, "attention_bias", False))
    a = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                  cfg.max_position_embeddings, rope_params(cfg), pi, bias, None, dtype)
    if in_features != cfg.hidden_size:
        a.qkv_proj = QKVParallelLinear(in_features, head_dim, cfg.num_attention_heads,
                                       cfg.num_key_value_heads, bias, pi, dtype)
    return a


class _Body(nn.Module):
    """What CompiledModel compiles layer by layer (`model.layers`)."""

    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)


class EagleHead(nn.Module):
    """Shared by both kinds: forward(ids, positions, attn, hidden) → the hidden state fed back
    to the next step ([T, H]); `draft_tokens(h)` → greedy target token ids. The target's
    embedding (and EAGLE-1's lm_head) are used, not owned: `attach(target)` before use."""
    eagle3 = False

    def __init__(self, cfg, pi: ParallelInfo, dtype: torch.dtype, own_embed: bool = False,
                 fc_bias: bool | None = None, n_aux: int = 3):
        super().__init__()
        self.cfg, self.pi = cfg, pi
        H = cfg.hidden_size
        first = Eagle3Layer0 if self.eagle3 else Eagle1Layer0
        layers = {"0": first(cfg, pi, dtype)}
        for i in range(1, cfg.num_hidden_layers):
            layers[str(i)] = DecoderLayer(cfg, i, pi, dtype, GatedMLP(
                H, cfg.intermediate_size, pi, dtype, bias=bool(getattr(cfg, "mlp_bias", False))),
                bool(getattr(cfg, "attention_bias", False)), False)
        self.model = _Body(layers)
        if self.eagle3:
            Ht = getattr(cfg, "target_hidden_size", None) or H
            self.model.fc = ColumnParallelLinear(n_aux * Ht, [H], False, REPLICATED, dtype)
            self.model.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
            self.lm_head = ParallelLMHead(self.draft_vocab, H, pi, dtype)
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab, dtype=torch.long), requires_grad=False)
        else:
            bias = getattr(cfg, "bias", True) if fc_bias is None else fc_bias  # the EAGLE repo's default
            self.model.fc = ColumnParallelLinear(2 * H, [H], bias, REPLICATED, dtype)
        if own_embed:
            self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, pi, dtype)
        self.quant_config = None

    def attach(self, target: nn.Module) -> None:
        """Use the target's embedding (unless the head has its own) and lm_head, without
        registering them (they are the target's parameters, loaded and counted there)."""
        object.__setattr__(self, "target_embed", target.model.embed_tokens)
        object.__setattr__(self, "target_head", target.lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self.model, "embed_tokens", None)
        return (self.target_embed if own is None else own)(ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
                hidden_states: torch.Tensor) -> torch.Tensor:
        e = self.embed(input_ids)
        layers = iter(self.model.layers.values())
        if self.eagle3:
            x = next(layers)(e, hidden_states, positions, attn)
        else:
            x = next(layers)(self.model.fc(torch.cat([e, hidden_states], -1)), positions, attn)
        for layer in layers:
            x = layer(x, positions, attn)
        return x

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's concatenated auxiliary states → the head's width (identity for
        EAGLE-1, whose pairs take the target's last hidden state as is)."""
        return self.model.fc(aux) if self.eagle3 else aux

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.lm_head.logits(self.model.norm(h))  # draft vocabulary
        return self.target_head.logits(h)

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:
        return self.tokens_of(self.compute_logits(h))

    def tokens_of(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy target token ids of `compute_logits` rows (EAGLE-3: from its draft vocabulary)."""
        d = logits.argmax(-1)
        return d + self.d2t[d] if self.eagle3 else d

    def map_weight(self, name: str) -> list[tuple[str, int | None]]:
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if "rotary_emb" in name or name == "t2d":
            return []
        if name.startswith("lm_head.") or name == "d2t":
            return [(name, None)] if self.eagle3 else []
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                return [("model." + name.replace(part, fused), shard)]
        return [("model." + name, None)]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers.values()]


@MODELS.register(EAGLE1)
class EagleLlamaForCausalLM(EagleHead):
    eagle3 = False


@MODELS.register(EAGLE3)
class Eagle3LlamaForCausalLM(EagleHead):
    eagle3 = True


def build_head(path: str | None, method: str, target: nn.Module, target_cfg, pi: ParallelInfo,
               dtype: torch.dtype, device: torch.device, max_model_len: int, dummy_seed: int | None):
    """The head of `path` for `target`, checked, built and loaded (dummy weights when
    dummy_seed is given). Returns (head, auxiliary target layer ids or None)."""
    from .loader import checkpoint_shapes, init_dummy_weights, load_weights
    cfg = load_head_config(path, method)
    try:
        shapes = None if dummy_seed is not None else checkpoint_shapes(path)
    except ValueError as e:  # (else it reads as the target's own load failing)
        raise ValueError(f"--speculative-config: the head {path}: {e}") from e
    check_head(cfg, shapes, target_cfg, method, path)
    cfg = copy.deepcopy(cfg)
    # RoPE is defined at every position: a head trained on 2k tokens still drafts further out
    cfg.max_position_embeddings = max(getattr(cfg, "max_position_embeddings", 0) or 0, max_model_len)
    aux = aux_layer_ids(cfg, target_cfg.num_hidden_layers) if method == "eagle3" else None
    names = {n.removeprefix("model.") for n in shapes} if shapes is not None else set()
    cls = MODELS.get(cfg.architectures[0])
    kw = {"own_embed": method == "eagle3" and "embed_tokens.weight" in names}
    if method == "eagle" and shapes is not None:
        kw["fc_bias"] = "fc.bias" in names
    if aux is not None:
        kw["n_aux"] = len(aux)
    with torch.device(device):
        head = cls(cfg, pi, dtype, **kw).eval()
    head.attach(target)
    if dummy_seed is not None:
        init_dummy_weights(head, dummy_seed)
    else:
        load_weights(head, path, progress=False)
    if method == "eagle3" and head.draft_vocab != cfg.vocab_size:
        d = head.d2t.detach() + torch.arange(head.draft_vocab, device=device)
        if dummy_seed is None and (d.min() < 0 or d.max() >= cfg.vocab_size):
            raise ValueError(f"--speculative-config: {path!r}: d2t maps draft ids outside the "
                             f"target vocabulary (0..{cfg.vocab_size - 1})")
    return head, aux
