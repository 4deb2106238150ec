"""Build a model from an HF checkpoint directory and load its weights.

Each rank reads only its slices of each safetensors tensor (`get_slice`), so tensor parallelism
never materialises a full tensor on a rank that does not need it.
"""
from __future__ import annotations

import glob
import os

import torch
from tqdm import tqdm

from .parallel import ParallelInfo
from .registry import MODELS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model_dir: str):
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir!r} is not a model directory (no config.json)")
    return AutoConfig.from_pretrained(model_dir)


def resolve_dtype(name: str, hf_config, device_type: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device_type == "cpu":
        return torch.float32  # bf16 matmuls on CPU are slow and lose parity
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    d = d if isinstance(d, torch.dtype) else _DTYPES.get(str(d), torch.bfloat16)
    return torch.bfloat16 if d == torch.float32 else d


def model_class(hf_config):
    from . import moe  # noqa: F401  (registers the MoE families)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("the model config has no 'architectures' field")
    return MODELS.get(archs[0])


def build_model(hf_config, pi: ParallelInfo, dtype: torch.dtype, device: torch.device):
    cls = model_class(hf_config)
    with torch.device(device):
        model = cls(hf_config, pi, dtype)
    return model.eval()


def load_weights(model, model_dir: str, progress: bool = True) -> int:
    """Copy this rank's slices into the model; returns the number of bytes read."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r} (use --load-format dummy "
                         "to run with random weights)")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    nbytes = 0
    for path in tqdm(files, desc="Loading safetensors", unit="file", disable=not progress):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                for target, shard in model.map_weight(name):
                    param = params.get(target)
                    if param is None:  # another pipeline stage's layer, or unused
                        continue
                    src = f.get_slice(name)
                    loader = getattr(param, "weight_loader", None)
                    if loader is None:
                        param.data.copy_(src[:])
                    else:
                        loader(param, src, shard)
                    loaded.add(target)
                    nbytes += param.numel() * param.element_size()
    missing = [n for n in params if n not in loaded and not _tied_alias(model, n, loaded)]
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return nbytes


def _tied_alias(model, name: str, loaded: set[str]) -> bool:
    return name == "lm_head.weight" and "model.embed_tokens.weight" in loaded


def init_dummy_weights(model, seed: int) -> None:
    """Random weights for benchmarks without a checkpoint (norms stay at 1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.dim() >= 2:
            p.data.normal_(0, 0.02, generator=gen)
        else:
            p.data.zero_()
