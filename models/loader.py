"""Build a model from an HF checkpoint directory and load its weights.

Each rank reads only its slices of each safetensors tensor (`get_slice`), so tensor parallelism
never materialises a full tensor on a rank that does not need it.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re

import torch
from tqdm import tqdm

from .parallel import ParallelInfo
from .registry import MODELS


def read_slice(t, index=None) -> torch.Tensor:
    """Materialise a tensor or a safetensors slice (only the indexed part is read)."""
    if index is None:
        return t[...] if not isinstance(t, torch.Tensor) else t  # [...]: 0-dim too
    return t[index]


def slice_shape(t) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) else t.get_shape()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# architectures whose configs also ship under other model types with remote code (Kimi-K2:
# model_type "kimi_k2", DeepseekV3ForCausalLM): read with transformers' own config class
_BUILTIN_CONFIGS = {"DeepseekV3ForCausalLM": "DeepseekV3Config", "DeepseekV2ForCausalLM": "DeepseekV2Config"}


# older AutoGPTQ / AutoAWQ checkpoints keep the scheme beside config.json (often without quant_method)
_SIDE_QUANT_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def _with_side_quant_config(config, model_dir: str):
    import json
    qc = getattr(config, "quantization_config", None)
    compression = getattr(config, "compression_config", None)
    if not qc and compression:  # llm-compressor's exports of 2024 (compressed-tensors < 0.7)
        # name their scheme so; vLLM reads it where quantization_config is absent
        qc = config.quantization_config = dict(compression if isinstance(compression, dict)
                                               else compression.to_dict())
    if qc:
        if not isinstance(qc, dict):
            qc = qc.to_dict()
        path = os.path.join(model_dir, "hf_quant_config.json")
        named = qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")
        if str(qc.get("quant_method", "")).lower() == "modelopt" and not named and os.path.isfile(path):
            # some uploads name only the method in config.json ({"quant_method": "modelopt"});
            # the scheme is then ModelOpt's side file's (config.json wins where both say)
            with open(path) as f:
                side = json.load(f).get("quantization") or {}
            config.quantization_config = {**side, **qc}
        return config
    for name, method in _SIDE_QUANT_CONFIGS.items():
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                config.quantization_config = {"quant_method": method, **json.load(f)}
            return config
    # NVIDIA ModelOpt's exports: {"producer": ..., "quantization": {"quant_algo": ...}}, flattened
    # (models/quantization.py ModelOptConfig)
    path = os.path.join(model_dir, "hf_quant_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            side = json.load(f)
        config.quantization_config = {"quant_method": "modelopt", **(side.get("quantization") or {}),
                                      "source": "hf_quant_config.json"}
    return config


def load_hf_config(model_dir: str, cache_dir: str | None = None):
    """The checkpoint's transformers config (with `quantization_config` from a side file where
    config.json has none)."""
    return _with_side_quant_config(_load_hf_config(model_dir, cache_dir), model_dir)


def _load_hf_config(model_dir: str, cache_dir: str | None = None):
    """The checkpoint's transformers config. With `cache_dir` (the engine's start path) it is
    read without importing transformers where that can be done: a shipped family through its
    own reader (models/config_readers.py: seconds of a cold start), another config read before
    with the same transformers from its snapshot there (models/config_snapshot.py)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a model directory (no config.json)")
    with open(path, "rb") as f:
        data = f.read()
    if cache_dir is None:
        return _read_hf_config(model_dir, data)
    import json

    from . import config_readers, config_snapshot
    config = config_readers.read(json.loads(data), model_dir)
    if config is not None:
        return config
    config = config_snapshot.load(cache_dir, data, model_dir)
    if config is None:
        config = _read_hf_config(model_dir, data)
        config_snapshot.save(cache_dir, data, config)
    return config


def _read_hf_config(model_dir: str, data: bytes):
    import json
    import transformers
    raw = json.loads(data)
    arch = (raw.get("architectures") or [None])[0]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if arch in _BUILTIN_CONFIGS and raw.get("model_type") not in CONFIG_MAPPING:
        raw.pop("auto_map", None)  # never run the checkpoint's code
        return getattr(transformers, _BUILTIN_CONFIGS[arch]).from_dict(raw)
    return transformers.AutoConfig.from_pretrained(model_dir)


def resolve_dtype(name: str, hf_config, device_type: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device_type == "cpu":
        return torch.float32  # bf16 matmuls on CPU are slow and lose parity
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    d = d if isinstance(d, torch.dtype) else _DTYPES.get(str(d), torch.bfloat16)
    return torch.bfloat16 if d == torch.float32 else d


# architecture → the module of models/ that registers it: a start imports its own family only
# (each family brings its kernels: MLA, MoE, Mamba); tests/test_startup.py keeps it complete
FAMILIES = {**dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                             "Qwen3ForCausalLM"), "llama"),
            "Qwen3MoeForCausalLM": "moe", "MixtralForCausalLM": "moe",
            "DeepseekV2ForCausalLM": "deepseek", "DeepseekV3ForCausalLM": "deepseek",
            "Gemma3ForCausalLM": "gemma3", "NemotronHForCausalLM": "nemotron_h"}


def model_class(hf_config):
    import importlib
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("the model config has no 'architectures' field")
    if archs[0] in FAMILIES:
        importlib.import_module(f"{__package__}.{FAMILIES[archs[0]]}")
    else:  # every family registered, for the error's list of what is supported
        for mod in sorted(set(FAMILIES.values())):
            importlib.import_module(f"{__package__}.{mod}")
    return MODELS.get(archs[0])


def check_activations(cls, hf_config) -> None:
    """The config's activations must be the ones the family's code runs (`cls.activations`:
    config field -> accepted names); another one would run silently as the built-in one."""
    for field, accepted in getattr(cls, "activations", {}).items():
        value = getattr(hf_config, field, None)
        if value is not None and value not in accepted:
            raise ValueError(f"{field} {value!r} is not supported for {hf_config.architectures[0]} "
                             f"(supported: {', '.join(accepted)})")


def build_model(hf_config, pi: ParallelInfo, dtype: torch.dtype, device: torch.device,
                quantization: str | None = None):
    from .quantization import apply_ignored, building, quant_config_of
    cls = model_class(hf_config)
    check_activations(cls, hf_config)
    heads = getattr(hf_config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % pi.tp_size:  # before any layer's own, vaguer split error
        raise ValueError(f"the model's num_attention_heads ({heads}) is not divisible by "
                         f"--tensor-parallel-size {pi.tp_size}; use a TP size that divides it")
    qconfig = quant_config_of(hf_config, quantization)
    with torch.device(device), building(qconfig):
        model = cls(hf_config, pi, dtype)
        apply_ignored(model, qconfig)  # rebuilds layers: on the model's device too
    model.quant_config = qconfig
    return model.eval()


def finalize_weights(model) -> None:
    """Per-layer work once the weights are in (quantize at load time, drop unused indices)."""
    for mod in model.modules():
        method = getattr(mod, "quant", None)
        if method is not None:
            method.after_loading(mod)
    hook = getattr(model, "after_loading", None)  # model-level work (DeepSeek: MLA's kv_b_proj)
    if hook is not None:
        hook()


def quant_summary(model) -> str:
    """What was quantized, and the weight bytes of this rank (for the startup log)."""
    kinds: dict[str, int] = {}
    for mod in model.modules():
        method = getattr(mod, "quant", None)
        if method is not None:
            kinds[method.describe()] = kinds.get(method.describe(), 0) + 1
    # weights derived at load time and kept beside the checkpoint's (MLA's dequantized FP8
    # kv_b_proj, which the absorbed attention reads): memory of this rank's weights too
    derived = sum(t.numel() * t.element_size() for mod in model.modules()
                  for t in getattr(mod, "derived_weights", list)())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + derived

    def size(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
    layers = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
    extra = f" ({size(derived)} of them dequantized at load time)" if derived else ""
    return f"weights {size(nbytes)} on this rank{extra}; linear layers: {layers}"


# a trainer's files saved beside the weights (transformers' Trainer, accelerate): never weights
_NOT_WEIGHTS = re.compile(r"(training_args|optimizer|scheduler|scaler|rng_state.*)\.bin")


def checkpoint_files(model_dir: str) -> list[str]:
    """The weight files of a checkpoint: *.safetensors, else *.bin (pytorch_model*.bin, older
    AutoGPTQ's gptq_model-4bit-128g.bin, the EAGLE repository's heads), as vLLM reads them."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    files = files or sorted(f for f in glob.glob(os.path.join(model_dir, "*.bin"))
                            if not _NOT_WEIGHTS.fullmatch(os.path.basename(f)))
    if not files:
        raise ValueError(f"no *.safetensors (or *.bin) weight files in {model_dir!r} (use "
                         "--load-format dummy to run with random weights)")
    return files


@contextlib.contextmanager
def open_weights(path: str):
    """name → tensor-or-slice reader of one weight file. safetensors: lazy slices (a rank reads
    only its part); .bin: tensors memory-mapped by torch.load (weights only, no pickled code)."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f.keys(), f.get_slice
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield list(state), state.__getitem__


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, without reading the data."""
    shapes = {}
    for path in checkpoint_files(model_dir):
        with open_weights(path) as (names, get):
            shapes.update({n: tuple(slice_shape(get(n))) for n in names})
    return shapes


def load_weights(model, model_dir: str, progress: bool = True, update: bool = False) -> int:
    """Copy this rank's slices into the model; returns the number of bytes of its weights.
    `update`: new weights for a serving model: a checkpoint that lacks some is refused before
    any tensor is copied (at startup the copy runs first: its errors name a tensor)."""
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    # names first (tensor headers only): which parameters the checkpoint fills, and which parts
    # (shard ids: q/k/v, gate/up) of the fused ones
    loaded: set[str] = set()
    parts: dict[str, set] = {}
    for path in files:
        with open_weights(path) as (names, _):
            for name in names:
                for target, shard in model.map_weight(name):
                    if target in params:
                        loaded.add(target)
                        parts.setdefault(target, set()).add(shard)
                    elif update:  # (at startup the copy below names the tensor in file order)
                        _check_unused(name, target, params)
    missing = [n for n in params if n not in loaded and not _tied_alias(params, n, loaded)
               and not getattr(params[n], "written_by_weight", False)  # scales of --quantization fp8
               and not getattr(params[n], "optional", False)]  # e.g. GPTQ's g_idx without desc_act
    missing += _partly_loaded(model, params, parts)
    if missing and hasattr(model, "drop_missing"):  # optional parts the checkpoint lacks (MTP)
        missing = model.drop_missing(missing, loaded)
    if missing and update:  # not a half-updated model
        raise _lacks(model_dir, missing)
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        with open_weights(path) as (names, get):
            for name in names:
                for target, shard in model.map_weight(name):
                    param = params.get(target)
                    if param is None:  # another pipeline stage's layer, or unused
                        _check_unused(name, target, params)
                        continue
                    src = get(name)
                    loader = getattr(param, "weight_loader", None)
                    try:
                        if _stored_fp8(src) and param.dtype not in _FP8:
                            # a copy would cast the e4m3 values without their scale: wrong tokens
                            # (a model built from its config, quant_config set; --quantization fp8: 16-bit in)
                            qc = getattr(model, "quant_config", False)
                            if qc is None or getattr(qc, "online", False):
                                raise ValueError("is stored as fp8 but the checkpoint's config.json has "
                                                 "no quantization_config (nor a compression_config, "
                                                 "quantize_config.json / "
                                                 "quant_config.json beside it): its scheme is unknown, "
                                                 "so its weights cannot be read (--quantization fp8 "
                                                 "quantizes 16-bit checkpoints only)")
                            raise ValueError(f"is stored as fp8 but {target} is {str(param.dtype)[6:]}: "
                                             f"this module runs unquantized here ({_DENSE_ONLY})")
                        if loader is None:
                            param.data.copy_(src[:])
                        else:
                            loader(param, src, shard)
                    except ValueError as e:  # which tensor the checkpoint cannot load
                        raise ValueError(f"{name}: {e}") from e
    if missing:
        raise _lacks(model_dir, missing)
    finalize_weights(model)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _lacks(model_dir: str, missing: list[str]) -> ValueError:
    return ValueError(f"checkpoint {model_dir!r} lacks weights for: {missing[:5]}"
                      f"{' ...' if len(missing) > 5 else ''}")


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_DENSE_ONLY = ("the embedding, the LM head, norms and MoE routers take 16-bit weights only, as do layers "
               "the quantization config lists as not converted")
# tensors that exist only beside a quantized weight: one whose module this rank runs dense
# (its `.weight` a parameter, no such tensor) would be dropped, and the weight read without it
_QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
                   "weight_packed", "weight_zero_point", "weight_g_idx")  # (the last: compressed-tensors)


def _stored_fp8(src) -> bool:
    dtype = src.dtype if isinstance(src, torch.Tensor) else src.get_dtype()
    return str(dtype).removeprefix("torch.") in ("float8_e4m3fn", "float8_e5m2", "F8_E4M3", "F8_E5M2")


def _check_unused(name: str, target: str, params: dict) -> None:
    module, _, suffix = target.rpartition(".")
    if suffix in ("w13", "w2") and any(f"{target}_{k}" in params for k in ("qweight", "weight_packed")):
        raise ValueError(f"{name}: is a 16-bit expert weight where the quantization config quantizes these "
                         "experts to 4 bits (an expert left unquantized must be listed in "
                         "modules_to_not_convert / ignore, with every other expert of its layer)")
    expert_part = suffix.partition("_")[0]
    if expert_part in ("w13", "w2") and suffix != expert_part and f"{module}.{expert_part}" in params:
        raise ValueError(f"{name}: the checkpoint quantizes these MoE experts, which run unquantized "
                         "here (the quantization config lists them as not converted); such a "
                         "checkpoint is not supported")
    weight = params.get(f"{module}.weight")
    if suffix in _QUANT_SUFFIXES and getattr(weight, "dtype", None) in _FP8:
        reads = sorted(n.rpartition(".")[2] for n in params if n.rpartition(".")[0] == module)
        raise ValueError(f"{name}: is not a tensor {module}'s FP8 layout reads ({', '.join(reads)}): the "
                         "checkpoint's tensors do not follow its quantization_config (quant_method fp8 "
                         "names block scales (weight_block_size) weight_scale_inv, per-tensor ones "
                         "weight_scale)")
    if suffix in _QUANT_SUFFIXES and f"{module}.weight" in params:
        raise ValueError(f"{name}: the checkpoint quantizes {module}, which runs unquantized here "
                         f"({_DENSE_ONLY}); such a checkpoint is not supported")


def _partly_loaded(model, params: dict, parts: dict[str, set]) -> list[str]:
    """Params that hold several checkpoint tensors (fused qkv / gate_up, stacked experts) and got
    only some of them (an incomplete download whose missing file held up_proj but not
    gate_proj): the rest of the param would stay uninitialized. Their module's
    `missing_parts(param name, shard ids loaded)` says which parts are missing."""
    out = []
    for target, shards in parts.items():
        module_name, _, pname = target.rpartition(".")
        check = getattr(model.get_submodule(module_name), "missing_parts", None)
        p = params[target]
        if check is not None and not getattr(p, "optional", False) and not getattr(p, "written_by_weight", False):
            out += [f"{target} ({part})" for part in check(pname, shards)]
    return out


def _tied_alias(params: dict, name: str, loaded: set[str]) -> bool:
    """`name` is another name of a loaded parameter (a tied LM head is the embedding); an untied
    head the checkpoint lacks is missing, not the embedding."""
    return any(params.get(other) is params[name] for other in loaded)


def init_dummy_weights(model, seed: int, config=None) -> None:
    """Random weights for benchmarks without a checkpoint (norms stay at 1, quantization scales
    small enough that dequantized weights have the dense init's magnitude). A config's
    `dummy_residual_scale` (shipped bench configs only) scales what the layers write to the
    residual stream (o_proj, down_proj): at 0 the logits depend on the last token only, and with
    tied embeddings the model repeats it (a target whose drafts are all accepted, for measuring
    speculative decoding's ceiling at a real model's size)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.dtype == torch.float8_e4m3fn:
            p.data.copy_(torch.empty(p.shape, device=p.device).normal_(0, 64, generator=gen).clamp(-448, 448))
        elif p.dtype in (torch.int32, torch.uint8):  # packed 4-bit weights, zero points, g_idx
            hi = 8 if p.dtype == torch.uint8 else 2**31 - 1
            if name.endswith("g_idx"):
                p.data.zero_()
                continue
            p.data.copy_(torch.randint(0, hi, p.shape, device=p.device, generator=gen, dtype=torch.int64))
        elif name.rsplit(".", 1)[-1] in ("weight_scale", "weight_scale_inv", "scales", "input_scale",
                                         "w13_scale", "w2_scale", "w13_scales", "w2_scales"):
            p.data.fill_(0.02 / 64 if p.dtype == torch.float32 else 0.002)
        elif p.dim() >= 2:
            p.data.normal_(0, 0.02, generator=gen)
        else:
            p.data.zero_()
    scale = getattr(config, "dummy_residual_scale", None)
    if scale is not None:
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) and p.is_floating_point():
                p.data.mul_(float(scale))
    finalize_weights(model)
