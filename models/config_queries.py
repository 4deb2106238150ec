"""What the engine asks of a model config before it builds the model (a DeepSeek-V3 config
without its MTP layers, a hybrid's recurrent state). Kept apart from the family modules so that
asking does not import every family and its kernels on every start (issue #21)."""
from __future__ import annotations

import copy

# NemotronH's `layers_block_type` names of its layer kinds
MAMBA, ATTENTION, MLP = "linear_attention", "full_attention", "mlp"


def has_recurrent_state(cfg) -> bool:
    return MAMBA in (getattr(cfg, "layers_block_type", None) or ())


def without_mtp(hf_config):
    """The config with its MTP layers dropped: they only run as the `mtp` speculative proposer,
    so otherwise they are neither built, loaded nor given a KV cache (V3: ~15 GB of weights and
    one latent cache layer on the last stage)."""
    if not getattr(hf_config, "num_nextn_predict_layers", 0):
        return hf_config
    cfg = copy.deepcopy(hf_config)
    cfg.num_nextn_predict_layers = 0
    return cfg


def rope_max_len(cfg) -> int:
    """The positions the model serves, as vLLM derives the context length from `rope_scaling`:
    YaRN's original_max_position_embeddings x factor, linear scaling's max_position_embeddings x
    factor (never fewer than max_position_embeddings); other kinds (llama3's
    max_position_embeddings is already the long one) and per-layer-type settings (Gemma 3) keep
    max_position_embeddings."""
    n = cfg.max_position_embeddings
    p = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind, factor = p.get("rope_type") or p.get("type"), p.get("factor")
    if not factor or kind not in ("linear", "yarn"):
        return n
    base = p.get("original_max_position_embeddings") or n if kind == "yarn" else n
    return max(n, int(base * factor))
