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

from typing import Callable, NamedTuple

import torch

from .config_snapshot import ConfigSnapshot
from .registry import Registry

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCALED_ROPE = ("llama3", "yarn", "longrope")  # these carry the pretraining context length
# read below (RoPE, dtype), never run (auto_map), or rewritten by transformers and unused here
# (classification labels, the saving path)
_NOT_COPIED = {"rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype", "auto_map",
               "id2label", "label2id", "_name_or_path"}



class Family(NamedTuple):
    defaults: dict  # the config class's field defaults (those rankserve may read)
    aliases: dict  # its attribute_map: alias → field
    post_init: Callable[[dict], None]  # what its __post_init__ derives
    rope: bool = True  # RoPE settings folded into `rope_parameters` (not for a NoPE family)


READERS: Registry[Family] = Registry("config reader")  # model_type → Family

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


READERS.register("llama")(Family(dict(
    _ANY, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
    bos_token_id=1, eos_token_id=2, mlp_bias=False, head_dim=None, pretraining_tp=1), {}, _llama))

READERS.register("qwen3")(Family(dict(
    _ANY, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
    bos_token_id=None, eos_token_id=None), {}, _qwen3))

READERS.register("qwen3_moe")(Family(dict(
    _ANY, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
    num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False, mlp_only_layers=None,
    bos_token_id=None, eos_token_id=None), {"num_experts": "num_local_experts"}, _qwen3_moe))

READERS.register("deepseek_v3")(Family(dict(
    _ANY, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1, pretraining_tp=1, rope_interleave=True, num_nextn_predict_layers=1),
    {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}, _deepseek_v3))


_NEMOTRON_KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# older Nemotron-H configs spell the Mamba fields with a prefix; transformers renames them
_NEMOTRON_RENAMES = dict(mamba_n_groups="n_groups", mamba_d_conv="conv_kernel", mamba_expand="expand",
                         mamba_dt_min="time_step_min", mamba_dt_max="time_step_max",
                         mamba_dt_limit="time_step_limit", mamba_dt_init_floor="time_step_floor",
                         mamba_conv_bias="use_conv_bias", mamba_chunk_size="chunk_size")


class Unsupported(Exception):
    """A config this reader does not model: read it through transformers."""


def _nemotron_h(c: dict) -> None:
    for old, new in _NEMOTRON_RENAMES.items():
        if old in c:
            c[new] = c.pop(old)
    pattern, mtp_pattern = c.pop("hybrid_override_pattern", None), c.pop("mtp_hybrid_override_pattern", None)
    if c.get("layers_block_type") is not None or c.get("mtp_layers_block_type") is not None:
        raise Unsupported("explicit layer-type lists (legacy names are remapped by transformers)")
    c["layers_block_type"] = ([_NEMOTRON_KINDS[k] for k in pattern] if pattern is not None
                              else ["linear_attention", "moe", "full_attention", "mlp"])
    c["num_hidden_layers"] = len(c["layers_block_type"])  # a property of the list in transformers
    c["mtp_layers_block_type"] = ([_NEMOTRON_KINDS[k] for k in mtp_pattern] if mtp_pattern is not None
                                  else ["full_attention", "moe"])
    _kv_heads(c)


READERS.register("nemotron_h")(Family(dict(
    architectures=None, tie_word_embeddings=False, attention_bias=False, vocab_size=131072,
    hidden_size=4096, layers_block_type=None, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    sliding_window=None, intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128,
    mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4, expand=2,
    time_step_min=0.001, time_step_max=0.1, time_step_limit=(0.0, float("inf")), time_step_floor=1e-4,
    use_conv_bias=True, chunk_size=128, mamba_proj_bias=False, mamba_ssm_cache_dtype="float32",
    n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688,
    num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
    num_nextn_predict_layers=0, use_bias=False, layer_norm_epsilon=1e-5, residual_in_fp32=False),
    {"layer_types": "layers_block_type", "num_local_experts": "n_routed_experts"}, _nemotron_h, rope=False))


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
    family = READERS.get(model_type)
    aliases = family.aliases
    c = dict(family.defaults)
    for k, v in raw.items():
        if k in _NOT_COPIED:
            continue
        c[aliases.get(k, k)] = v
    try:
        family.post_init(c)
    except Unsupported:
        return None
    if family.rope:
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
