"""PEFT adapter configs: what a LoRA adapter directory holds and whether it is supported
(torch-free, so the API process can check an adapter before the engine sees it)."""
from __future__ import annotations

import json
import os

# our (fused) layer → the checkpoint modules it holds, in shard order
TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
           "up_proj": ("up_proj",)}  # (a plain MLP without a gate: Nemotron-H)
SUPPORTED = {m for subs in TARGETS.values() for m in subs}
# PEFT options that make the adapter more than y + x A^T B^T on its layers
OTHER_FORWARD = {"target_parameters": "LoRA on MoE experts", "modules_to_save": "whole modules",
                 "lora_bias": "a bias on B", "layer_replication": "repeated layers",
                 "alora_invocation_tokens": "activated LoRA", "use_qalora": "QALoRA",
                 "trainable_token_indices": "trained embedding rows", "arrow_config": "Arrow routing",
                 "kasa_config": "KaSA", "use_bdlora": "block-diagonal LoRA"}


def read_adapter_config(path: str) -> dict:
    """The PEFT adapter_config.json of `path`, checked for what is supported (ValueError)."""
    f = os.path.join(os.path.expanduser(path), "adapter_config.json")
    if not os.path.isfile(f):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json")
    with open(f) as fh:
        try:
            cfg = json.load(fh)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(cfg, dict) or type(cfg.get("r")) is not int or cfg["r"] < 1:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json needs a rank r (an integer "
                         ">= 1)")
    if type(cfg.get("lora_alpha", 1)) not in (int, float):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json's lora_alpha "
                         f"{cfg['lora_alpha']!r} is not a number")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {path!r}: rank_pattern / alpha_pattern are not supported")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: DoRA is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={cfg['bias']!r} is not supported")
    for key, what in OTHER_FORWARD.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} {cfg[key]!r} ({what}) is not supported")
    # a string is PEFT's regex over module names: its tensors say which layers it has
    # (models/lora.py refuses the ones of other modules)
    targets = cfg.get("target_modules") or []
    bad = [] if isinstance(targets, str) else \
        [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED]
    if bad:
        raise ValueError(f"LoRA adapter {path!r}: target modules {bad} are not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED))})")
    return cfg


def adapter_rank(cfg: dict) -> int:
    return int(cfg["r"])


def weights_file(path: str) -> str:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        f = os.path.join(os.path.expanduser(path), name)
        if os.path.isfile(f):
            return f
    raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
