"""config.json read without transformers for the families rankserve ships, so that a cold start
does not import transformers either (its import and a family's config class: 6–10 s on the GPU
machine, models/config_snapshot.py).

A reader gives the object transformers 5 would give for the fields rankserve reads: the file's
fields over the class's defaults, the class's aliases (`attribute_map`), the fields its
`__post_init__` derives (head_dim, layer_types ...), the dtype as a torch dtype, and RoPE settings
in one `rope_parameters` dict (rope_theta folded in). tests/test_startup.py checks every
attribute the engine and the bench read, and the meta-device model, against transformers for
every shipped config. Other families, nested per-layer RoPE and remote-code model types return
None: the caller reads them through transformers."""
from __future__ import annotations

from typing import Callable

import torch

from .config_snapshot import ConfigSnapshot
from .registry import Registry

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCALED_ROPE = ("llama3", "yarn", "longrope")  # these carry the pretraining context length

# model_type → (field defaults of its config class, attribute_map, post-init fix-ups)
READERS: Registry[tuple[dict, dict, Callable[[dict], None]]] = Registry("config reader")

_ANY = dict(architectures=None, tie_word_embeddings=False, attention_bias=False, rms_norm_eps=1e-6, hidden_act="silu",
            pad_token_id=None)


def _kv_heads(c: dict) -> None:
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]


def _llama(c: dict) -> None:
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    _kv_heads(c)


def _qwen3(c: dict) -> None:
    if not c["use_sliding_window"]:
        c["sliding_window"] = None  # transformers drops the window unless it is switched on
    _kv_heads(c)
    if c.get("layer_types") is None:
        c["layer_types"] = ["sliding_attention" if c["sliding_window"] is not None and i >= c["max_window_layers"]
                            else "full_attention" for i in range(c["num_hidden_layers"])]


def _qwen3_moe(c: dict) -> None:
    if not c["use_sliding_window"]:
        c["sliding_window"] = None
    if c.get("mlp_only_layers") is None:
        c["mlp_only_layers"] = []


def _deepseek_v3(c: dict) -> None:
    _kv_heads(c)
    c["qk_head_dim"] = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    c["head_dim"] = c["qk_rope_head_dim"]


READERS.register("llama")((dict(
    _ANY, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
    bos_token_id=1, eos_token_id=2, mlp_bias=False, head_dim=None, pretraining_tp=1), {}, _llama))

READERS.register("qwen3")((dict(
    _ANY, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
    bos_token_id=None, eos_token_id=None), {}, _qwen3))

READERS.register("qwen3_moe")((dict(
    _ANY, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
    num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False, mlp_only_layers=None,
    bos_token_id=None, eos_token_id=None), {"num_experts": "num_local_experts"}, _qwen3_moe))

READERS.register("deepseek_v3")((dict(
    _ANY, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1, pretraining_tp=1, rope_interleave=True, num_nextn_predict_layers=1),
    {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}, _deepseek_v3))


def _rope(raw: dict, c: dict) -> dict | None:
    """transformers 5's one RoPE dict: rope_scaling (else rope_parameters) with rope_theta and
    rope_type filled in; None for per-layer-type (nested) settings."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        return None
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _SCALED_ROPE:
        if "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    return params


def read(raw: dict, model_dir: str) -> ConfigSnapshot | None:
    """The config of a shipped family as transformers would read it, else None."""
    model_type = raw.get("model_type")
    if model_type not in READERS:
        return None
    defaults, aliases, post_init = READERS.get(model_type)
    c = dict(defaults)
    for k, v in raw.items():
        if k in ("rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype", "auto_map"):
            continue
        c[aliases.get(k, k)] = v
    post_init(c)
    rope = _rope(raw, c)
    if rope is None:
        return None
    c["rope_parameters"] = c["rope_scaling"] = rope
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is not None and name not in _DTYPES:
        return None  # a dtype spelled otherwise: transformers knows how to read it
    c["dtype"] = c["torch_dtype"] = _DTYPES.get(name)
    for alias, field in aliases.items():
        c[alias] = c[field]
    return ConfigSnapshot(**c, name_or_path=model_dir, snapshot_of=f"{__name__}.{model_type}")
