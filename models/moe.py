"""MoE families: Qwen3-MoE and Mixtral. Same decoder as models/llama.py with the MLP replaced by
a routed-experts layer (softmax router, top-k, optional renormalisation).

Experts are stored stacked (`w13` [E, 2I, H] gate+up, `w2` [E, H, I]) and run by the
`rankserve::fused_moe` op (Triton grouped GEMM on CUDA, plain torch on CPU). Without expert
parallelism each rank keeps every expert with its intermediate dimension split (TP); with
`--enable-expert-parallel` each rank keeps E/TP whole experts. Both end in one all-reduce.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.moe import fused_moe
from .layers import GatedMLP, _read, divide
from .parallel import ParallelInfo, tp_all_reduce
from .llama import CausalLM
from .registry import MODELS


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, pi: ParallelInfo, dtype):
        super().__init__()
        self.pi = pi
        if pi.enable_expert_parallel:
            self.num_local = divide(num_experts, pi.tp_size, "number of experts")
            self.first_expert = pi.tp_rank * self.num_local
            self.inter = intermediate
        else:
            self.num_local, self.first_expert = num_experts, 0
            self.inter = divide(intermediate, pi.tp_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter, dtype=dtype),
                               requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param, src, shard: tuple[int, int]):
        expert, part = shard  # part: 0 gate, 1 up, 2 down
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return  # another rank's expert
        # without EP the intermediate dimension is split across TP ranks
        lo = 0 if self.pi.enable_expert_parallel else self.pi.tp_rank * self.inter
        rows = slice(lo, lo + self.inter)
        if part == 2:
            param.data[e].copy_(_read(src, (slice(None), rows)))
        else:
            param.data[e, part * self.inter:(part + 1) * self.inter].copy_(_read(src, rows))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, pi: ParallelInfo, dtype):
        super().__init__()
        self.pi, self.top_k, self.renormalize = pi, top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)  # router, replicated
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(num_experts, hidden, intermediate, pi, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        ex = self.experts
        if self.pi.enable_expert_parallel:  # experts of other ranks → -1 (skipped)
            local = ids - ex.first_expert
            ids = torch.where((local >= 0) & (local < ex.num_local), local, -1)
        y = fused_moe(x, ex.w13, ex.w2, weights.to(x.dtype), ids.to(torch.int32))
        return tp_all_reduce(y, self.pi)


_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class MoECausalLM(CausalLM):
    def map_weight(self, name: str):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.search(name)
        if m:
            part = _PART[m.group(2)]
            target = name[:m.start()] + (".experts.w2" if part == 2 else ".experts.w13")
            return [(target, (int(m.group(1)), part))]
        return super().map_weight(name)


@MODELS.register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoECausalLM):
    def make_mlp(self, cfg, layer_id, pi, dtype):
        sparse = (layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
                  and cfg.num_experts > 0 and (layer_id + 1) % cfg.decoder_sparse_step == 0)
        if not sparse:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, pi, dtype)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, cfg.norm_topk_prob, pi, dtype)


@MODELS.register("MixtralForCausalLM")
class MixtralForCausalLM(MoECausalLM):
    def make_mlp(self, cfg, layer_id, pi, dtype):
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                         cfg.num_experts_per_tok, True, pi, dtype)
