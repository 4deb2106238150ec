"""New weights without a restart, on every rank: from a checkpoint directory of the same
architecture (`update_weights_from_disk`), or broadcast by a trainer in the same job over a
process group of its own (`init_weights_update_group` / `update_weights_from_distributed`, the
calls RL frameworks make; SGLang's endpoint names and fields).

The weight-update group: the trainer is rank 0; the engine's rank r (its rank in the engine's
job) is `rank_offset + r`; `world_size` counts them all. Rendezvous at `tcp://master_address:
master_port` (rank 0 hosts the TCP store), keys under the group's name; the backend is built on
the store exactly as `torch.distributed`'s own group helper builds it (prefixes `NAME` then
`NAME/` then the device), so a trainer may create its side with that helper (as OpenRLHF, verl
and SGLang's tests do) or with `trainer_group` below (same torch version on both sides). Each
tensor is broadcast whole from rank 0 in the order of the update call's names; every engine rank
takes its own shard through the parameters' weight loaders, as when loading a checkpoint.
"""
from __future__ import annotations

import atexit
import datetime
import math
import os

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8}
# the config fields that must agree for new weights to fit the running model
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "moe_intermediate_size",
              "num_experts", "num_local_experts", "num_experts_per_tok", "tie_word_embeddings")
GROUP_TIMEOUT_S = 120.0  # init: how long to wait for every member of the group


def parse_dtype(name) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    return DTYPES[key]


def check_checkpoint(current_model_dir: str, model_path: str, expected: dict | None = None) -> None:
    """ValueError unless `model_path` is a safetensors checkpoint of the running architecture
    (and, given the running checkpoint's tensor shapes `expected`, its tensors have them)."""
    from ..models.loader import load_hf_config
    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        raise ValueError(f"model_path {model_path!r} is not a directory")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model_path {model_path!r} has no config.json")
    if not any(f.endswith(".safetensors") for f in os.listdir(model_path)):
        raise ValueError(f"model_path {model_path!r} has no *.safetensors files")
    from ..models.loader import checkpoint_shapes
    try:  # the headers of every file (a truncated one is the caller's error, found here)
        shapes = checkpoint_shapes(model_path)
    except Exception as e:  # noqa: BLE001 - safetensors' own error type
        raise ValueError(f"model_path {model_path!r}: cannot read its weights: {e}") from None
    old, new = load_hf_config(current_model_dir), load_hf_config(model_path)
    a, b = (getattr(old, "architectures", None) or [None])[0], (getattr(new, "architectures", None) or [None])[0]
    if a != b:
        raise ValueError(f"model_path {model_path!r} holds a {b} checkpoint; the running model is {a}")
    for key in SHAPE_KEYS:
        x, y = getattr(old, key, None), getattr(new, key, None)
        if x != y:
            raise ValueError(f"model_path {model_path!r}: {key} is {y}, the running model has {x}")
    # the weights' storage must be the running model's too: checked before any tensor is copied,
    # since a load that fails part way (a 16-bit tensor where e4m3 is expected) leaves the
    # model half updated, and one that does not fail casts values without their scales
    x, y = quant_layout(old), quant_layout(new)
    if x != y:
        raise ValueError(f"model_path {model_path!r} is quantized differently from the running model "
                         f"(quantization_config {y or 'none: 16-bit'}; running: {x or 'none: 16-bit'})")
    wrong = [f"{n} is {list(s)} (running: {list(expected[n])})" for n, s in shapes.items()
             if expected and n in expected and not same_shape(s, expected[n])]
    if wrong:  # found before any tensor is copied: a load failing on it leaves a mix of both
        raise ValueError(f"model_path {model_path!r}: tensors of another shape: {', '.join(wrong[:5])}"
                         f"{' ...' if len(wrong) > 5 else ''}")


def same_shape(a, b) -> bool:
    """Equal shapes; a scalar's [] and [1] count as one (scales are saved either way)."""
    return tuple(a) == tuple(b) or math.prod(a) == math.prod(b) == 1


# the quantization_config fields that decide which tensors a checkpoint holds and how (not the
# quantizer's provenance: damp_percent, model_name_or_path, ...)
QUANT_LAYOUT_KEYS = ("quant_method", "fmt", "weight_block_size", "activation_scheme", "bits", "w_bit",
                     "group_size", "q_group_size", "sym", "desc_act", "zero_point", "version",
                     "checkpoint_format", "format", "config_groups",
                     "modules_to_not_convert", "ignored_layers", "ignore", "dynamic",
                     "modules_in_block_to_quantize")


def quant_layout(config) -> dict:
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc or qc.get("quant_method") == "compressed-tensors" and not qc.get("config_groups"):
        return {}  # 16-bit weights (a KV-cache-only scheme: its k/v scales load with any update)
    return {k: qc[k] for k in QUANT_LAYOUT_KEYS if qc.get(k) is not None}


def load_from_disk(model, model_path: str) -> int:
    from ..models.loader import load_weights
    with torch.no_grad():
        return load_weights(model, model_path, progress=False, update=True)


def load_tensor(model, params: dict, name: str, tensor: torch.Tensor) -> bool:
    """Copy this rank's share of checkpoint tensor `name` into the model (as the safetensors
    loader does); False if no parameter of this rank takes it (True for a name the model skips
    on purpose: a tied `lm_head.weight`, a rotary `inv_freq`)."""
    targets = model.map_weight(name)
    used = not targets
    with torch.no_grad():
        for target, shard in targets:
            param = params.get(target)
            if param is None:  # another pipeline stage's layer, or unused
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            used = True
    return used


class WeightsUpdateGroup:
    """A process group between a trainer (rank 0) and the engine's ranks, outside the engine's
    own torch.distributed world: a bare backend on a store of its own."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float = GROUP_TIMEOUT_S):
        import torch.distributed as dist
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs CUDA; use gloo on CPU")
        self.name, self.rank, self.world_size, self.backend = group_name, rank, world_size, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                           timeout=timeout))
        store.set_timeout(timeout)
        # the prefixes torch.distributed's group helper puts on a PrefixStore(group_name, store)
        base = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
        dev = "cuda" if backend == "nccl" else "cpu"
        bstore = dist.PrefixStore(f"{dev}/", base)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(bstore, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(bstore, rank, world_size, opts)
        self.pg._set_sequence_number_for_group()
        self._store = store  # keep the rendezvous store alive as long as the group
        # a group left to interpreter teardown can die in std::terminate (gloo's threads)
        atexit.register(self.destroy)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        pg, self.pg, self._store = self.pg, None, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        del pg


def trainer_group(master_address: str, master_port: int, world_size: int,
                  group_name: str = "weight_update_group", backend: str = "nccl",
                  timeout_s: float = GROUP_TIMEOUT_S) -> WeightsUpdateGroup:
    """The trainer's side (rank 0) of the group; call it while the engine's
    /init_weights_update_group request is pending, then `group.broadcast(tensor)` each tensor
    in the order of the /update_weights_from_distributed request's names."""
    return WeightsUpdateGroup(master_address, master_port, 0, world_size, group_name, backend, timeout_s)


def untaken_names(model, names: list[str]) -> list[str]:
    """The names no parameter of this rank takes (a name the model skips on purpose, such as a
    tied `lm_head.weight` or a rotary `inv_freq`, is taken)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [n for n in names if (targets := model.map_weight(n))
            and not any(t in params for t, _ in targets)]


def receive_weights(model, group: WeightsUpdateGroup, names: list[str], dtypes: list,
                    shapes: list[list[int]], device: torch.device, load: bool = True) -> list[str]:
    """Receive each tensor from the trainer and load it (`load` False: receive only, so that a
    refused update leaves no broadcast of the trainer waiting); returns the names no parameter
    of this rank took. A tensor that fails to load stops the loading, not the receiving."""
    from ..models.loader import finalize_weights
    params = dict(model.named_parameters(remove_duplicate=False))
    unused, failed = [], None
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=group.device)
        group.broadcast(t, src=0)
        if not load or failed:
            continue
        try:
            if not load_tensor(model, params, name, t.to(device) if t.device != device else t):
                unused.append(name)
        except (ValueError, RuntimeError) as e:
            failed = f"{name}: {e}"
    if failed:
        raise ValueError(f"{failed} (the tensors before it were loaded, those after it received "
                         "but not loaded: send them all again)")
    if not load:
        return unused
    with torch.no_grad():  # what is derived from the weights once loaded (MLA's FP8 kv_b_proj)
        finalize_weights(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return unused
