"""A transformers config, resolved once and kept in the cache directory, so that a warm start
reads the model config without importing transformers' config classes.

Importing a family's config class is the slowest part of reading a config: in transformers 5,
`configuration_llama` pulls `utils.type_validators` → `activations` → `integrations.hub_kernels`
→ `core_model_loading` → `torch.distributed.tensor`, accelerate, sympy (1 s on a laptop, several
on the GPU machine, plus `import transformers`' own package-metadata scan). The first load (cold
start) goes through transformers and saves every attribute the config object answers — its fields
with the class's defaults filled in, its class attributes, properties and `attribute_map` aliases —
keyed by the config.json bytes and the transformers version. Later loads rebuild a plain object with the same
attributes. Configs with fields other than plain Python data and torch dtypes are not kept."""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import types
import warnings

import torch

_VERSION = 2  # of the snapshot format: bump when what is saved changes
_PLAIN = (type(None), bool, int, float, str, torch.dtype)


class ConfigSnapshot(types.SimpleNamespace):
    """The attributes of a transformers config; `snapshot_of` tells which class it came from."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return isinstance(v, _PLAIN)


def _path(cache_dir: str, raw: bytes) -> str | None:
    try:
        tf = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256(raw + f"\0{tf}\0{_VERSION}".encode()).hexdigest()[:32]
    return os.path.join(cache_dir, "hf_configs", f"{key}.pkl")


def load(cache_dir: str, raw: bytes, model_dir: str) -> ConfigSnapshot | None:
    path = _path(cache_dir, raw)
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            # the key is the config's content: another directory may have saved it
            return ConfigSnapshot(**pickle.load(f), name_or_path=model_dir)
    except (OSError, pickle.UnpicklingError, EOFError, TypeError):
        return None  # a damaged entry: read the config through transformers again


def attributes(config) -> dict | None:
    """Every public attribute `config` answers: its fields (None if one is not plain data), and
    those of its class attributes, properties and aliases that are plain data."""
    cls = type(config)
    fields = {k for k in vars(config) if not k.startswith("_")}
    derived = {k for k in dir(config) if not k.startswith("_")} | set(getattr(cls, "attribute_map", {}))
    out = {}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # deprecated aliases (torch_dtype) warn on access
    try:
        for k in sorted((fields | derived) - {"name_or_path"}):  # where it was read: set on load
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    v = getattr(config, k)
            except Exception:  # a property that does not apply to this config
                continue
            if callable(v):
                continue
            if not _plain(v):
                if k in fields:
                    return None
                continue  # a view object (per-layer configs ...): not kept
            out[k] = v
    finally:
        quiet.setLevel(level)
    out["snapshot_of"] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def save(cache_dir: str, raw: bytes, config) -> None:
    path, attrs = _path(cache_dir, raw), attributes(config)
    if path is None or attrs is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # ranks of one node may write it at once
        with open(tmp, "wb") as f:
            pickle.dump(attrs, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next start its transformers import
