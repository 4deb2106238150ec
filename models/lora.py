"""LoRA on the parallel linear layers: PEFT adapters read, sharded like their layers, and applied
per token from device slots (kernels/lora.py).

A targeted layer keeps its linear method and gets a `LoRAMethod` around it. Per slot: A [C, K]
(C = n·R: the n fused sub-matrices' A stacked, ranks below R zero-padded) and B [N, R] (each
output row's own sub-matrix; the scaling lora_alpha / r, or / sqrt(r) for rsLoRA, folded in).

- Folded (dense bases, while all slots' A add at most FOLD_MAX of the weight's rows): the layer's
  GEMM runs on `lora_weight` = [W; A_slot0; A_slot1; ...] ([N + S·C (padded), K]; `weight` is a
  view of its first N rows), so x A^T of every slot comes out of the base GEMM as extra columns
  and LoRA costs one expand launch per layer, nothing else. The layer stays `dense`: the fused
  norm + GEMM and SiLU + GEMM decode paths (models/fused.py, kernels/gemv.py) take the wide weight
  and hand their output to `fused_epilogue` (the expand).
- Otherwise (quantized bases, or many slots of a high rank): `lora_a` [S, C, K], one shrink
  (the token's own slot only) after the base GEMM, then the expand; the fused paths step aside.

Tensor parallelism: a column-parallel layer keeps A whole and B's rows of its output shard; a
row-parallel layer keeps A's columns of its input shard and B whole, and adds its partial
update before the layer's all-reduce (the sum over ranks of (x_r A_r^T) B^T is x A^T B^T), so
LoRA costs no extra collective.
"""
from __future__ import annotations

import itertools
import math
import os

import torch
import torch.nn as nn

from ..kernels.gemv import skinny_linear
from ..kernels.lora import lora_expand, lora_shrink
from .layers import ColumnParallelLinear, RowParallelLinear
from .lora_config import TARGETS, adapter_rank, read_adapter_config, weights_file  # noqa: F401
from .quantization import LinearMethod



class LoRAContext:
    """Per-step slot metadata shared by every LoRA layer: persistent device buffers (CUDA graphs
    read them) that the runner fills each step. `sgmv`: prefill-shaped step (segment kernels)
    or decode (one token per request: the per-token kernels); a host tensor, so a compiled
    graph serves both."""

    def __init__(self, max_tokens: int, max_seqs: int, device):
        self.token_slot = torch.full((max_tokens + 1,), -1, dtype=torch.int32, device=device)
        self.seg_start = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.seg_slot = torch.full((max_seqs + 1,), -1, dtype=torch.int32, device=device)
        self.sgmv = torch.zeros((), dtype=torch.bool)  # on the host: read by the ops, not traced


# Fold A into the base weight while all slots' rows add at most this share of its rows: the
# GEMM reads them for every token (at decode, bytes: +6% for Llama-8B's qkv with 8 rank-16 slots,
# ~1 us, against a separate shrink launch of 3-5 us); beyond it a separate shrink is cheaper
FOLD_MAX = 0.25
ROW_ALIGN = 64  # the wide weight's extra rows, padded (GEMM tiles)


class LoRAMethod(LinearMethod):
    def __init__(self, base: LinearMethod, ctx: LoRAContext, bounds: list[int], max_rank: int,
                 folded: bool):
        self.base, self.ctx, self.bounds, self.max_rank = base, ctx, bounds, max_rank
        self.num_slices = len(bounds) - 1
        self.folded = folded
        self.dense = folded  # the fused prologue paths take `fused_operands`

    def __getattr__(self, name):  # everything else (scales, flags) is the base method's
        return getattr(self.__dict__["base"], name)

    def describe(self) -> str:
        return self.base.describe() + "+LoRA"

    def after_loading(self, layer):
        self.base.after_loading(layer)

    def fused_operands(self, layer, bias):
        return layer.lora_weight, None if bias is None else layer.lora_bias

    def fused_epilogue(self, layer, y, bias):
        return self._expand(layer, y)

    def apply(self, layer, x, bias):
        if self.folded:
            return self._expand(layer, skinny_linear(x, *self.fused_operands(layer, bias)))
        y = self.base.apply(layer, x, bias)
        c = self.ctx
        ts = c.token_slot[:x.shape[0]]
        s = lora_shrink(x, layer.lora_a, ts, c.seg_start, c.seg_slot, c.sgmv)
        return lora_expand(y, s, layer.lora_b, ts, self.bounds, 0, None)

    def _expand(self, layer, y):
        """y [T, N + extra]: the wide GEMM's output (bias included), every slot's x A^T after
        column N."""
        N = self.bounds[-1]
        ts = self.ctx.token_slot[:y.shape[0]]
        return lora_expand(y[:, :N], y[:, N:].unsqueeze(0), layer.lora_b, ts, self.bounds,
                           self.num_slices * self.max_rank)


def _shapes(layer) -> tuple[int, list[int]]:
    """(input size on this rank, output size of each sub-matrix on this rank)."""
    if isinstance(layer, RowParallelLinear):
        return layer.in_per_rank, [layer.out_features]
    return layer.full_in, list(layer.output_sizes)


def wrap_model(model: nn.Module, ctx: LoRAContext, max_loras: int, max_rank: int, dtype,
               device) -> dict[str, nn.Module]:
    """Give every targeted layer its LoRA slots; returns {module name: layer}. MoE experts and
    other layers keep running without LoRA."""
    layers = {}
    for name, mod in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in TARGETS or not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            continue
        k, outs = _shapes(mod)
        bounds = [0, *itertools.accumulate(outs)]
        cols = len(outs) * max_rank
        folded = bool(mod.quant.dense) and max_loras * cols <= FOLD_MAX * bounds[-1]
        if folded:
            extra = -(-max_loras * cols // ROW_ALIGN) * ROW_ALIGN
            w = mod.weight
            wide = torch.zeros(bounds[-1] + extra, k, dtype=w.dtype, device=w.device)
            wide[:bounds[-1]].copy_(w.data)
            w.data = wide[:bounds[-1]]  # loaders and weight updates keep writing `weight`
            mod.register_buffer("lora_weight", wide, persistent=False)
            if isinstance(mod, ColumnParallelLinear) and mod.bias is not None:  # (row-parallel:
                # after the all-reduce) zeros for A's rows, added in the GEMM's epilogue
                b = torch.zeros(bounds[-1] + extra, dtype=mod.bias.dtype, device=mod.bias.device)
                b[:bounds[-1]].copy_(mod.bias.data)
                mod.bias.data = b[:bounds[-1]]
                mod.register_buffer("lora_bias", b, persistent=False)
        else:
            mod.register_buffer("lora_a", torch.zeros(max_loras, cols, k, dtype=dtype,
                                                      device=device), persistent=False)
        mod.register_buffer("lora_b", torch.zeros(max_loras, bounds[-1], max_rank, dtype=dtype,
                                                  device=device), persistent=False)
        mod.quant = LoRAMethod(mod.quant, ctx, bounds, max_rank, folded)
        layers[name] = mod
    return layers


def slot_a(layer: nn.Module, slot: int) -> torch.Tensor:
    """The [C, K] rows holding A of `slot` (in the wide weight when folded)."""
    q = layer.quant
    if not q.folded:
        return layer.lora_a[slot]
    C = q.num_slices * q.max_rank
    return layer.lora_weight[q.bounds[-1] + slot * C:q.bounds[-1] + (slot + 1) * C]


def _matched(path: str, model: nn.Module, layers: dict[str, nn.Module], r: int,
             shapes: dict[str, tuple[int, ...]]):
    """(lora_A key, lora_B key, layer name, layer, shard) of each adapter module on this stage's
    layers, its shapes checked against the layer's full (unsharded) ones: an adapter of another
    base model is a ValueError here, not a crash in a step or silently cut B rows."""
    for key in shapes:
        if key.endswith(".lora_B.weight"):
            continue
        if not key.endswith(".lora_A.weight"):  # embeddings' LoRA, biases, DoRA magnitudes
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not supported (LoRA A and "
                             "B weights of linear layers only)")
        module = key.removesuffix(".lora_A.weight")
        key_b = module + ".lora_B.weight"
        if key_b not in shapes:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A but no lora_B")
        name = module.removeprefix("base_model.model.")
        for target, shard in model.map_weight(name + ".weight"):
            lname = target.removesuffix(".weight")
            layer = layers.get(lname)
            if layer is None:
                if lname.rsplit(".", 1)[-1] in TARGETS:
                    continue  # a layer of another pipeline stage
                raise ValueError(f"LoRA adapter {path!r}: module {module!r} is not supported")
            n = layer.out_features if isinstance(layer, RowParallelLinear) \
                else layer.full_output_sizes[shard or 0]
            want = ((r, layer.full_in), (n, r))
            if (tuple(shapes[key]), tuple(shapes[key_b])) != want:
                raise ValueError(
                    f"LoRA adapter {path!r}: {name} has lora_A {list(shapes[key])} and lora_B "
                    f"{list(shapes[key_b])}, this model needs {list(want[0])} and {list(want[1])} "
                    "(rank r from adapter_config.json): an adapter of another base model?")
            yield key, key_b, lname, layer, shard


def check_adapter(path: str, model: nn.Module, layers: dict[str, nn.Module], max_rank: int) -> None:
    """Raise ValueError if the adapter cannot run on this model (reads tensor headers only)."""
    from .loader import open_weights, slice_shape
    r = adapter_rank(read_adapter_config(path))
    if r > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {r} > --max-lora-rank {max_rank}")
    f = weights_file(path)
    try:
        with open_weights(f) as (names, get):
            shapes = {k: tuple(slice_shape(get(k))) for k in names}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: the client's error
        raise ValueError(f"LoRA adapter {path!r}: cannot read {os.path.basename(f)}: {e}") from None
    for _ in _matched(path, model, layers, r, shapes):
        pass


def load_adapter(path: str, model: nn.Module, layers: dict[str, nn.Module], max_rank: int,
                 dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of a PEFT adapter, padded to `max_rank`, scaling folded into B:
    {module name: (A [n·R, K], B [N, R])} on the host, for the layers of this stage."""
    cfg = read_adapter_config(path)
    r = adapter_rank(cfg)
    if r > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {r} > --max-lora-rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = _read_tensors(path)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    for key, key_b, lname, layer, shard in _matched(path, model, layers, r, shapes):
        a, b = tensors[key], tensors[key_b]
        k, outs = _shapes(layer)
        if lname not in out:
            out[lname] = (torch.zeros(len(outs) * max_rank, k, dtype=dtype),
                          torch.zeros(sum(outs), max_rank, dtype=dtype))
        A, B = out[lname]
        i = shard or 0
        if isinstance(layer, RowParallelLinear):
            c0 = layer.pi.tp_rank * layer.in_per_rank
            A[:r] = a[:, c0:c0 + layer.in_per_rank]
            B[:, :r] = b.float() * scaling
        else:
            off, start, n = layer.shard_rows(i)
            A[i * max_rank:i * max_rank + r] = a
            B[off:off + n, :r] = b[start:start + n].float() * scaling
    return out


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    f = weights_file(path)
    if f.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(f)
    return torch.load(f, map_location="cpu", weights_only=True)


def set_slot(layers: dict[str, nn.Module], slot: int, weights) -> None:
    """Copy an adapter (from load_adapter) into device slot `slot` of every LoRA layer."""
    for name, layer in layers.items():
        w = weights.get(name)
        if w is None:
            slot_a(layer, slot).zero_()
            layer.lora_b[slot].zero_()
            continue
        slot_a(layer, slot).copy_(w[0], non_blocking=True)
        layer.lora_b[slot].copy_(w[1], non_blocking=True)
