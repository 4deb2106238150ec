"""LoRA on the parallel linear layers: PEFT adapters read, sharded like their layers, and applied
per token from device slots (kernels/lora.py).

A targeted layer keeps its linear method (dense, FP8, 4-bit ...) and gets a `LoRAMethod` around
it: the base GEMM, then `+ expand(shrink(x))` for each token's adapter slot. The wrapper is not
`dense`, so the fused norm + GEMM and SiLU + GEMM fast paths step aside for wrapped layers (the
unfused path is the same arithmetic). Slots: `lora_a` [S, n·R, K] (the n fused sub-matrices'
A stacked, so one shrink serves q/k/v or gate/up) and `lora_b{i}` [S, N_i, R] per sub-matrix;
ranks below R are zero-padded and the scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) is
folded into B.

Tensor parallelism: a column-parallel layer keeps A whole and B's rows of its output shard; a
row-parallel layer keeps A's columns of its input shard and B whole, and adds its partial
update before the layer's all-reduce (the sum over ranks of (x_r A_r^T) B^T is x A^T B^T), so
LoRA costs no extra collective.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn as nn

from ..kernels.lora import lora_expand_add, lora_shrink
from .layers import ColumnParallelLinear, RowParallelLinear
from .lora_config import TARGETS, adapter_rank, read_adapter_config  # noqa: F401
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


class LoRAMethod(LinearMethod):
    dense = False  # the fused prologue paths need a plain weight and no side update

    def __init__(self, base: LinearMethod, ctx: LoRAContext, num_slices: int, max_rank: int):
        self.base, self.ctx, self.num_slices, self.max_rank = base, ctx, num_slices, max_rank

    def __getattr__(self, name):  # everything else (scales, flags) is the base method's
        return getattr(self.__dict__["base"], name)

    def describe(self) -> str:
        return self.base.describe() + "+LoRA"

    def after_loading(self, layer):
        self.base.after_loading(layer)

    def apply(self, layer, x, bias):
        y = self.base.apply(layer, x, bias)
        c, R = self.ctx, self.max_rank
        ts = c.token_slot[:x.shape[0]]
        s = lora_shrink(x, layer.lora_a, ts, c.seg_start, c.seg_slot, c.sgmv)
        y2 = y.view(-1, y.shape[-1])
        col = 0
        for i in range(self.num_slices):  # each sub-matrix's update, added into y in place
            b = getattr(layer, f"lora_b{i}")
            lora_expand_add(y2, s, b, ts, col, i * R)
            col += b.shape[1]
        return y


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
        mod.register_buffer("lora_a", torch.zeros(max_loras, len(outs) * max_rank, k, dtype=dtype,
                                                  device=device), persistent=False)
        for i, n in enumerate(outs):
            mod.register_buffer(f"lora_b{i}", torch.zeros(max_loras, n, max_rank, dtype=dtype,
                                                          device=device), persistent=False)
        mod.quant = LoRAMethod(mod.quant, ctx, len(outs), max_rank)
        layers[name] = mod
    return layers


def load_adapter(path: str, model: nn.Module, layers: dict[str, nn.Module], max_rank: int,
                 dtype) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """This rank's shard of a PEFT adapter, padded to `max_rank`, scaling folded into B:
    {module name: (A [n·R, K], [B_i [N_i, R]])} on the host, for the layers of this stage."""
    cfg = read_adapter_config(path)
    r = adapter_rank(cfg)
    if r > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {r} > --max-lora-rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = _read_tensors(path)
    out: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = module.removeprefix("base_model.model.")
        for target, shard in model.map_weight(name + ".weight"):
            lname = target.removesuffix(".weight")
            layer = layers.get(lname)
            if layer is None:
                if lname.rsplit(".", 1)[-1] in TARGETS:
                    continue  # a layer of another pipeline stage
                raise ValueError(f"LoRA adapter {path!r}: module {module!r} is not supported")
            k, outs = _shapes(layer)
            if lname not in out:
                out[lname] = (torch.zeros(len(outs) * max_rank, k, dtype=dtype),
                              [torch.zeros(n, max_rank, dtype=dtype) for n in outs])
            A, Bs = out[lname]
            i = shard or 0
            if isinstance(layer, RowParallelLinear):
                c0 = layer.pi.tp_rank * layer.in_per_rank
                A[:r] = a[:, c0:c0 + layer.in_per_rank]
                Bs[0][:, :r] = b.float() * scaling
            else:
                _, start, n = layer.shard_rows(i)
                A[i * max_rank:i * max_rank + r] = a
                Bs[i][:, :r] = b[start:start + n].float() * scaling
    return out


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    binf = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binf):
        return torch.load(binf, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors")


def set_slot(layers: dict[str, nn.Module], slot: int, weights) -> None:
    """Copy an adapter (from load_adapter) into device slot `slot` of every LoRA layer."""
    for name, layer in layers.items():
        w = weights.get(name)
        if w is None:
            layer.lora_a[slot].zero_()
            for i in range(layer.quant.num_slices):
                getattr(layer, f"lora_b{i}")[slot].zero_()
            continue
        layer.lora_a[slot].copy_(w[0], non_blocking=True)
        for i, b in enumerate(w[1]):
            getattr(layer, f"lora_b{i}")[slot].copy_(b, non_blocking=True)
