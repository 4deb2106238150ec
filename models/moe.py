"""MoE families: Qwen3-MoE and Mixtral. Same decoder as models/llama.py with the MLP replaced by
a routed-experts layer (softmax router, top-k, optional renormalisation).

Experts are stored stacked (`w13` [E, 2I, H] gate+up, `w2` [E, H, I]) and run by the
`rankserve::fused_moe` op (Triton grouped GEMM on CUDA, plain torch on CPU). Without expert
parallelism each rank keeps every expert with its intermediate dimension split (TP); with
`--enable-expert-parallel` each rank keeps E/TP whole experts. Both end in one all-reduce.
Quantized experts: FP8 (`w13` / `w2` e4m3 with `w13_scale` / `w2_scale`), or 4-bit (GPTQ / AWQ /
compressed-tensors W4A16: `w13_qweight` [E, H/8, 2I], `w13_scales`, ... in kernels/quant.py's
w4a16 layout, loaded per expert by the dense 4-bit layers' loaders; `rankserve::fused_moe_w4a16`).
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.moe import fused_moe, fused_moe_w4a16
from ..kernels.quant import FP8, quant_fp8_weight
from .layers import GatedMLP, divide
from .loader import read_slice as _read, slice_shape
from .parallel import ParallelInfo, tp_all_reduce
from .quantization import (MoEQuant, Slices, W4A16, _fp8_tensor, check_2d, check_channel_scale, copy_checked,
                           current_moe_quant)
from .llama import CausalLM
from .registry import MODELS


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, pi: ParallelInfo, dtype,
                 prefix: str = ""):
        super().__init__()
        self.pi = pi
        if pi.enable_expert_parallel:
            self.num_local = divide(num_experts, pi.tp_size, "number of experts")
            self.first_expert = pi.tp_rank * self.num_local
            self.inter = intermediate
        else:
            self.num_local, self.first_expert = num_experts, 0
            self.inter = divide(intermediate, pi.tp_size, "moe_intermediate_size")
        # FP8 or 4-bit experts (models/quantization.py), or the model dtype
        self.quant = ExpertsQuant(current_moe_quant(prefix))  # prefix: the checkpoint's module
        E, I2, H, inter = self.num_local, 2 * self.inter, hidden, self.inter
        self.weight_numel = E * (I2 * H + H * inter)  # the experts' weights, whatever their width
        if self.quant.spec is not None and self.quant.spec.w4 is not None:
            self._create_w4(self.quant.spec.w4, hidden, intermediate, prefix, dtype)
            return
        wdt = dtype if self.quant.spec is None or self.quant.spec.online else FP8
        self.w13 = nn.Parameter(torch.empty(E, I2, H, dtype=wdt), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, inter, dtype=wdt), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.load_dtype = dtype  # what `--quantization fp8` quantizes from
        spec = self.quant.spec
        if spec is not None and not spec.online:
            if spec.block:
                bn, bk = spec.block
                # a rank's rows of gate/up and columns of down must be whole blocks: a block's
                # scale read for part of it would be another rank's too (wrong, not just slow)
                if inter % bn or inter % bk:
                    split = (f" split over {pi.tp_size} tensor-parallel ranks ({inter} per rank)"
                             if pi.tp_size > 1 and not pi.enable_expert_parallel else "")
                    raise ValueError(
                        f"MoE experts ({prefix or 'mlp.experts'}): intermediate size {intermediate}{split} is not "
                        f"a multiple of the checkpoint's weight_block_size {list(spec.block)}"
                        + ("; use --enable-expert-parallel (whole experts per rank) or a smaller "
                           "--tp" if split else ""))
                if H % bn:
                    raise ValueError(f"MoE experts ({prefix or 'mlp.experts'}): hidden size {H} is not a multiple "
                                     f"of the checkpoint's weight_block_size {list(spec.block)}")
                shapes = (E, I2 // bn, -(-H // bk)), (E, H // bn, -(-inter // bk))
            else:
                shapes = (E, I2), (E, H)
            self.w13_scale = nn.Parameter(torch.empty(shapes[0]), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(shapes[1]), requires_grad=False)
            self.w13_scale.weight_loader = self.w2_scale.weight_loader = self.scale_loader

    def _create_w4(self, m: W4A16, H: int, intermediate: int, prefix: str, dtype) -> None:
        """4-bit experts: per expert, the tensors a W4A16 linear layer makes (repacked to
        kernels/quant.py's layout by the same loaders), stacked: `w13_qweight` [E, H/8, 2I],
        `w13_scales` [E, G, 2I], ..., `w2_qweight` [E, I/8, H] (compressed-tensors: its names)."""
        pi, inter = self.pi, self.inter
        split = pi.tp_size > 1 and not pi.enable_expert_parallel
        full_i = intermediate if split else inter
        where = f"MoE experts ({prefix or 'mlp.experts'}): intermediate size {intermediate}"
        if split:  # a rank's columns of down_proj must be whole packed words and whole groups
            cut = f"{where} split over {pi.tp_size} tensor-parallel ranks ({inter} per rank) is not a multiple of"
            fix = "; use --enable-expert-parallel (whole experts per rank) or a smaller --tp"
            if inter % 8:
                raise ValueError(f"{cut} 8 (4-bit values are packed 8 to an int32 word){fix}")
            # act-order and per-channel scales: every rank keeps all groups (no group is cut)
            if m.group_size > 0 and not m.desc_act and inter % m.group_size:
                raise ValueError(f"{cut} the checkpoint's group_size {m.group_size}{fix}")
        self.w4_groups, self.w4_full_h = (m.group_k(H), m.group_k(full_i)), H
        self.w4_prefix = prefix or "mlp.experts"
        self.w4_loaded: set[tuple[str, int, int]] = set()  # (param, expert, part) since the last check
        for target, (k, full_k, n) in (("w13", (H, H, 2 * inter)), ("w2", (inter, full_i, H))):
            for name, shape, dt, load, optional in m.tensors(k, full_k, n, dtype):
                p = nn.Parameter(torch.empty(self.num_local, *shape, dtype=dt), requires_grad=False)
                pname = target + expert_suffix(name)
                p.weight_loader = (lambda param, src, shard, load=load, pname=pname:
                                   self._load_w4(param, src, shard, load, pname))
                p.optional = optional
                p.checkpoint_name = name  # for the errors
                setattr(self, pname, p)

    def _load_w4(self, param, src, shard: tuple[int, int], load, pname: str) -> None:
        expert, part = shard  # part: 0 gate, 1 up, 2 down
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return  # another rank's expert
        rows = self._rows()
        if part == 2:  # down_proj: this rank's columns (TP) of [H, I]
            full = self.inter if self.pi.enable_expert_parallel else self.inter * self.pi.tp_size
            s = Slices((0, 0, self.w4_full_h), (rows.start, self.inter), full)
        else:  # gate / up: this rank's rows, at offset 0 / I of w13
            s = Slices((part * self.inter, rows.start, self.inter), (0, self.w4_full_h), self.w4_full_h)
        load(param.data[e], src, s)
        self.w4_loaded.add((pname, e, part))

    def missing_parts(self, pname: str, shards: set) -> list[str]:
        """(models/loader.py) The (expert, part) pieces of a stacked param not loaded: each of
        this rank's experts needs its gate and up parts (w13...) or its down part (w2...).
        4-bit experts check theirs in check_w4_loaded."""
        if self.quant.spec is not None and self.quant.spec.w4 is not None:
            return []
        want = (2,) if pname.startswith("w2") else (0, 1)
        return [f"expert {self.first_expert + e}'s {('gate_proj', 'up_proj', 'down_proj')[part]}"
                for e in range(self.num_local) for part in want
                if (self.first_expert + e, part) not in shards]

    def check_w4_loaded(self) -> None:
        """After a load: every expert of this rank has each part's tensors (the loader checks
        whole parameters only, and an expert left out would run on uninitialized memory)."""
        if not self.w4_loaded:  # nothing loaded (dummy weights)
            return
        seen, self.w4_loaded = self.w4_loaded, set()
        for pname, p in self.named_parameters(recurse=False):
            if getattr(p, "optional", False):
                continue
            for e in range(self.num_local):
                for part in ((2,) if pname.startswith("w2") else (0, 1)):
                    if (pname, e, part) not in seen:
                        raise ValueError(
                            f"{self.w4_prefix}: the checkpoint has no {p.checkpoint_name} for expert "
                            f"{self.first_expert + e}'s {('gate_proj (w1)', 'up_proj (w3)', 'down_proj (w2)')[part]}")

    def w4_tensors(self, target: str) -> tuple:
        """(qweight, scales, zeros or None, g_idx or None) of w13 or w2 (4-bit experts)."""
        m = self.quant.spec.w4
        return tuple(getattr(self, target + expert_suffix(n), None) for n in (m.qweight, m.scales, m.qzeros, m.g_idx))

    def _rows(self) -> slice:
        # without EP the intermediate dimension is split across TP ranks
        lo = 0 if self.pi.enable_expert_parallel else self.pi.tp_rank * self.inter
        return slice(lo, lo + self.inter)

    def weight_loader(self, param, src, shard: tuple[int, int]):
        expert, part = shard  # part: 0 gate, 1 up, 2 down
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return  # another rank's expert
        rows = self._rows()
        ours = slice(None) if part == 2 else slice(part * self.inter, (part + 1) * self.inter)
        if param.dtype == FP8 and not self.quant.spec.online:
            _fp8_tensor(src)  # a copy would cast 16-bit experts to e4m3 without a scale
        block = _read(src, (slice(None), rows) if part == 2 else rows)
        if param.dtype == FP8 and self.quant.spec.online:  # a reload of experts quantized at
            # load time: per-channel, so each part's rows are quantized on their own, in place
            block, scale = quant_fp8_weight(block.to(param.device, self.load_dtype))
            (self.w2_scale if part == 2 else self.w13_scale).data[e, ours] = scale
        param.data[e, ours].copy_(block)

    def scale_loader(self, param, src, shard: tuple[int, int]):
        expert, part = shard
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return
        rows, block = self._rows(), self.quant.spec.block
        if block:  # [out / bn, in / bk] blocks: the TP slice is whole blocks (checked above)
            bn, bk = block
            check_2d(src)
            if part == 2:
                copy_checked(param.data[e], _read(src, (slice(None), slice(rows.start // bk, -(-rows.stop // bk)))),
                             slice_shape(src))
            else:
                n = self.inter // bn
                copy_checked(param.data[e, part * n:(part + 1) * n],
                             _read(src, slice(rows.start // bn, rows.stop // bn)), slice_shape(src))
            return
        t = _read(src).float()  # per channel [N(, 1)] or per tensor
        check_channel_scale(t, self.w2.shape[1] if part == 2 else rows.stop)
        t = t.reshape(-1)
        if part == 2:
            param.data[e] = t if t.numel() > 1 else t[0]
        else:
            dst = param.data[e, part * self.inter:(part + 1) * self.inter]
            dst.copy_(t[rows] if t.numel() > 1 else t[0].expand(self.inter))

    def forward(self, x, weights, ids):
        spec = self.quant.spec
        if spec is not None and spec.w4 is not None:
            return fused_moe_w4a16(x, *self.w4_tensors("w13"), *self.w4_tensors("w2"), weights, ids,
                                   *self.w4_groups)
        if spec is None or spec.online and self.w13.dtype != FP8:
            return fused_moe(x, self.w13, self.w2, weights, ids)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale,
                         spec.block)


class ExpertsQuant:
    """The `quant` of a FusedExperts: what models/loader.py reports and finalizes."""
    dense = False

    def __init__(self, spec: MoEQuant | None):
        self.spec = spec

    def describe(self) -> str:
        s = self.spec
        if s is None:
            return "experts (dense)"
        if s.w4 is not None:
            return "experts " + s.w4.describe()
        return "experts fp8 e4m3 (" + ("block %dx%d" % tuple(s.block) if s.block else
                                       "per-tensor" if s.per_tensor else "per-channel") + \
            (", quantized at load time)" if s.online else
             "; static input_scale unused, activations dynamic)" if s.static else ")")

    def after_loading(self, mod: FusedExperts) -> None:
        if self.spec is not None and self.spec.w4 is not None:
            mod.check_w4_loaded()
            if not self.spec.w4.desc_act:  # rows in order: group k // group_size, no index needed
                for name in ("w13", "w2"):
                    if hasattr(mod, name + expert_suffix(self.spec.w4.g_idx)):
                        delattr(mod, name + expert_suffix(self.spec.w4.g_idx))
            return
        if self.spec is not None and self.spec.online and mod.w13.dtype != FP8:
            for name in ("w13", "w2"):
                w = getattr(mod, name).data
                qs = [quant_fp8_weight(w[e]) for e in range(w.shape[0])]
                setattr(mod, name, nn.Parameter(torch.stack([a for a, _ in qs]), requires_grad=False))
                setattr(mod, name + "_scale", nn.Parameter(torch.stack([b for _, b in qs]), requires_grad=False))
                # reloads bring 16-bit experts again: weight_loader quantizes them in place
                getattr(mod, name).weight_loader = mod.weight_loader
                getattr(mod, name + "_scale").written_by_weight = True  # not in the checkpoint


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, pi: ParallelInfo, dtype, prefix: str = ""):
        super().__init__()
        self.pi, self.top_k, self.renormalize = pi, top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)  # router, replicated
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(num_experts, hidden, intermediate, pi, dtype, prefix + ".experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        ex = self.experts
        if self.pi.enable_expert_parallel:  # experts of other ranks → -1 (skipped)
            local = ids - ex.first_expert
            ids = torch.where((local >= 0) & (local < ex.num_local), local, -1)
        y = ex(x, weights.to(x.dtype), ids.to(torch.int32))
        return tp_all_reduce(y, self.pi)


_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
                     r"(weight|weight_scale|weight_scale_inv|input_scale|qweight|qzeros|scales|g_idx|"
                     r"weight_packed|weight_zero_point|weight_g_idx)$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_suffix(kind: str) -> str:
    """The stacked parameter (w13 / w2 + this) an expert tensor of this kind loads into: FP8's
    weight / scale, or a 4-bit tensor by its name (GPTQ / AWQ qweight, qzeros, scales, g_idx;
    compressed-tensors weight_packed, weight_zero_point, weight_g_idx, its weight_scale the
    scale)."""
    if kind == "weight":
        return ""
    return "_scale" if kind in ("weight_scale", "weight_scale_inv") else "_" + kind


class MoECausalLM(CausalLM):
    def map_weight(self, name: str):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.search(name)
        if m:
            part, kind = _PART[m.group(2)], m.group(3)
            if kind == "input_scale":
                return []  # static activation scales: activations are quantized dynamically
            target = name[:m.start()] + (".experts.w2" if part == 2 else ".experts.w13")
            return [(target + expert_suffix(kind), (int(m.group(1)), part))]
        return super().map_weight(name)


@MODELS.register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoECausalLM):
    def make_mlp(self, cfg, layer_id, pi, dtype):
        sparse = (layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
                  and cfg.num_experts > 0 and (layer_id + 1) % cfg.decoder_sparse_step == 0)
        if not sparse:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, pi, dtype)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, cfg.norm_topk_prob, pi, dtype, f"model.layers.{layer_id}.mlp")


@MODELS.register("MixtralForCausalLM")
class MixtralForCausalLM(MoECausalLM):
    def make_mlp(self, cfg, layer_id, pi, dtype):
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                         cfg.num_experts_per_tok, True, pi, dtype, f"model.layers.{layer_id}.block_sparse_moe")
