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
