"""Parallel-ready building blocks: column/row/vocab-parallel linear layers (fused QKV and
gate-up), RMSNorm, RoPE, and the paged-attention block.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that copies in only this rank's
slice; `tensor` may be a safetensors slice (`safe_open(...).get_slice(name)`), so a rank reads
only the bytes it needs. At tensor-parallel size 1 every layer is a plain dense layer and the
collectives are no-ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.attention import attention, rms_norm
from .loader import read_slice as _read, slice_shape as _shape
from .parallel import ParallelInfo, tp_all_gather_last, tp_all_reduce
from .quantization import LinearMethod, Slices, current_linear_method


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class ParallelLinear(nn.Module):
    """Shared by the column- and row-parallel layers: the weights are made, loaded and run by a
    linear method (models/quantization.py: dense, FP8, 4-bit), picked from the checkpoint's
    quantization scheme while the model is built."""

    def _init_weights(self, in_features: int, out_features: int, dtype) -> None:
        self.weight_shape = (in_features, out_features, dtype)
        self.set_method(current_linear_method())

    def set_method(self, method: LinearMethod) -> None:
        for name in [n for n, _ in self.named_parameters(recurse=False) if n != "bias"]:
            delattr(self, name)
        self.quant = method
        method.create(self, *self.weight_shape)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.quant.apply(self, x, bias)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T with W's output rows split across TP ranks; output stays sharded.

    `output_sizes` lists the fused sub-matrices (e.g. gate and up); each is split separately so
    that every rank holds matching pieces of each.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, pi: ParallelInfo,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.pi = pi
        self.output_sizes = [divide(s, pi.tp_size, "output size") for s in output_sizes]
        self.full_output_sizes = list(output_sizes)  # the checkpoint's rows of each sub-matrix
        self.full_in = in_features
        self._init_weights(in_features, sum(self.output_sizes), dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda p, src, shard_id=None: load_2d_rows(p, src, self.shard_rows(shard_id or 0))

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's param, first source row, number of rows) of a sub-matrix."""
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), self.pi.tp_rank * size, size

    def slices(self, shard_id: int | None) -> Slices:
        return Slices(self.shard_rows(shard_id or 0), (0, self.full_in), self.full_in,
                      self.full_rows(shard_id or 0))

    def missing_parts(self, pname: str, shards: set) -> list[str]:
        """The fused parts (shard ids) a param loaded only in part lacks (models/loader.py)."""
        n = len(self.output_sizes)
        if n < 2 or None in shards:  # one part, or loaded whole
            return []
        return [f"part {k} of {n} fused" for k in range(n) if k not in shards]

    def full_rows(self, shard_id: int) -> int | None:
        """The checkpoint rows of a sub-matrix (all ranks' shards of it), None: not checked."""
        return self.output_sizes[shard_id] * self.pi.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


def load_2d_rows(param: torch.Tensor, src, rows: tuple[int, int, int]) -> None:
    off, start, n = rows
    param.data[off:off + n].copy_(_read(src, slice(start, start + n)))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when TP > num_kv_heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 pi: ParallelInfo, dtype=None):
        self.num_heads = divide(num_heads, pi.tp_size, "num_attention_heads")
        if num_kv_heads >= pi.tp_size:
            self.num_kv_heads = divide(num_kv_heads, pi.tp_size, "num_key_value_heads")
            self.kv_rank = pi.tp_rank
        else:  # each kv head is shared by tp/num_kv_heads ranks
            divide(pi.tp_size, num_kv_heads, "tensor-parallel size vs num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_rank = pi.tp_rank * num_kv_heads // pi.tp_size
        self.head_dim, self.total_heads = head_dim, (num_heads, num_kv_heads, num_kv_heads)
        sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden, [s * pi.tp_size for s in sizes], bias, pi, dtype)
        self.output_sizes = sizes
        self.full_output_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2

    def shard_rows(self, shard_id: int):
        size = self.output_sizes[shard_id]
        rank = self.pi.tp_rank if shard_id == 0 else self.kv_rank
        return sum(self.output_sizes[:shard_id]), rank * size, size

    def full_rows(self, shard_id: int) -> int:
        return self.total_heads[shard_id] * self.head_dim


class RowParallelLinear(ParallelLinear):
    """y = x W^T with W's input columns split across TP ranks; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, pi: ParallelInfo,
                 dtype=None, reduce: bool = True):
        super().__init__()
        self.pi = pi
        self.reduce = reduce
        self.in_per_rank = divide(in_features, pi.tp_size, "input size")
        self.full_in = in_features
        self.out_features = out_features
        self._init_weights(self.in_per_rank, out_features, dtype)
        self.bias = None
        if bias:  # added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda p, src, shard_id=None: p.data.copy_(_read(src))

    def slices(self, shard_id: int | None) -> Slices:
        return Slices((0, 0, self.out_features), (self.pi.tp_rank * self.in_per_rank, self.in_per_rank),
                      self.full_in, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.linear(x))

    def silu_mul_forward(self, gu: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) W^T for gu = [gate | up], the product in the GEMM's prologue."""
        return self._reduce(self.quant.silu_mul_apply(self, gu, None))  # the bias after the reduction

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            y = tp_all_reduce(y, self.pi)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across TP ranks (padded to a multiple of TP size)."""

    def __init__(self, vocab_size: int, dim: int, pi: ParallelInfo, dtype=None):
        super().__init__()
        self.pi = pi
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / pi.tp_size)
        self.start = pi.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, src, shard_id=None):
        if _shape(src)[0] != self.vocab_size:  # (rows past it would be dropped, rows short of it zero)
            raise ValueError(f"has shape {_shape(src)} in the checkpoint where the config's "
                             f"vocab_size is {self.vocab_size}: the config and the weights are of "
                             "different models")
        end = min(self.start + self.per_rank, _shape(src)[0])
        if end > self.start:
            param.data[:end - self.start].copy_(_read(src, slice(self.start, end)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pi.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return tp_all_reduce(out, self.pi)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; logits are gathered to the full vocabulary."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = F.linear(h, self.weight)
        return tp_all_gather_last(out, self.pi)[..., :self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope(dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): inverse frequencies [dim/2] blending the
    original (high frequencies) and the interpolated ones (low) over a linear ramp, and the
    attention factor that scales cos and sin."""
    base = float(p.get("rope_theta", 10000.0))
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

    def corr_dim(rot):  # the dimension whose wavelength makes `rot` turns over the original length
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = corr_dim(p.get("beta_fast") or 32), corr_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / ((hi + 0.001 if lo == hi else hi) - lo)).clamp(0, 1)
    extrapolate = 1 - ramp  # high frequencies keep their value, low ones are interpolated
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn_factor)


def rope_inv_freq(head_dim: int, params: dict, max_pos: int = 0) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the RoPE variants in HF configs (default, linear, llama3, yarn) and
    the factor cos and sin are scaled by (1 but for YaRN)."""
    theta = float(params.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "yarn":
        return yarn_rope(head_dim, params, max_pos)
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn)")
    return inv.float(), 1.0


_COS_SIN: dict[tuple, torch.Tensor] = {}


def building_on_meta() -> bool:
    """A model built on the meta device (the bench counting parameters): a table then needs only
    its shape, and computing it there would run torch's Python reference ops, whose first use
    imports torch._dynamo and sympy (seconds of a start)."""
    return torch.get_default_device().type == "meta"


def rope_cos_sin(head_dim: int, max_pos: int, params: dict) -> torch.Tensor:
    """fp32 [max_pos, head_dim] table: cos then sin of each position (applied inside the attention
    op, fused with the q/k norm and the KV-cache store). One table per device is shared by all
    layers: at 128k positions it is 64 MiB, which per layer would cost an 8B model 2 GiB."""
    if building_on_meta():
        with torch.device("cpu"):
            inv, _ = rope_inv_freq(head_dim, params, max_pos)  # its checks: an unsupported rope type raises
        return torch.empty(max_pos, 2 * inv.numel(), dtype=torch.float32)
    key = (head_dim, max_pos, repr(sorted(params.items())), str(torch.get_default_device()))
    if key not in _COS_SIN:
        inv, attn_factor = rope_inv_freq(head_dim, params, max_pos)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.to(torch.float32))
        _COS_SIN[key] = torch.cat([freqs.cos(), freqs.sin()], -1) * attn_factor
    return _COS_SIN[key]


@dataclass
class AttnMeta:
    """Per-step attention metadata built by the model runner (see kernels/attention.py)."""
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    # every request has at most one query token (and T == B): the split-KV decode kernel. A
    # Python bool, so torch.compile guards on it: one graph per mode, no recompiles per step
    is_decode: bool = False
    # state slot of each request for recurrent (Mamba2) layers: int32 [B], -1 for padding
    state_idx: torch.Tensor | None = None
    # decode steps with RANKSERVE_DECODE_LPT: int32 [B], the requests by decreasing seq_len (the
    # order the decode kernel starts their programs in; never changes a result)
    decode_order: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_pos: int, rope_params: dict, pi: ParallelInfo, qkv_bias: bool = False,
                 qk_norm_eps: float | None = None, dtype=None, window: int = 0,
                 softcap: float = 0.0):
        super().__init__()
        self.window = window  # sliding window in tokens (0: full attention); see kernels/attention.py
        self.softcap = softcap  # attention-logit soft-capping (0: none)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias, pi, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, False, pi, dtype)
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.register_buffer("cos_sin", rope_cos_sin(head_dim, max_pos, rope_params),
                             persistent=False)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # Qwen3: per-head RMSNorm on q and k before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        # bound by the model runner once the KV cache is allocated
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # fp8 KV cache: per-layer scales (stored = k / k_scale), from the checkpoint when it has
        # them (the model runner loads them), else 1.0; a 16-bit cache ignores them
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttnMeta) -> torch.Tensor:
        return self.from_in_proj(self.qkv_proj(x), positions, attn)

    @property
    def in_proj(self) -> ColumnParallelLinear:
        """The first GEMM, for the fused residual path (models/fused.py)."""
        return self.qkv_proj

    def from_in_proj(self, qkv: torch.Tensor, positions: torch.Tensor, attn: AttnMeta
                     ) -> torch.Tensor:
        qn, kn = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        o = attention(qkv, positions, self.cos_sin, qn, kn, eps, self.k_cache, self.v_cache,
                      self.k_scale, self.v_scale, attn.slot_mapping, attn.query_start_loc,
                      attn.seq_lens, attn.block_table, self.qkv_proj.num_heads, self.scale, attn.is_decode,
                      self.window, self.softcap, attn.decode_order)
        return self.o_proj(o)


class GatedMLP(nn.Module):
    """SwiGLU MLP with a fused gate-up projection."""

    def __init__(self, hidden: int, intermediate: int, pi: ParallelInfo, dtype=None, bias=False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias, pi, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, pi, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_in_proj(self.gate_up_proj(x))

    @property
    def in_proj(self) -> ColumnParallelLinear:
        """The first GEMM, for the fused residual path (models/fused.py)."""
        return self.gate_up_proj

    def from_in_proj(self, gu: torch.Tensor) -> torch.Tensor:
        return self.down_proj.silu_mul_forward(gu)

    @property
    def swiglu_down(self) -> RowParallelLinear:
        """What follows silu(gate) * up, for gate_up's SwiGLU epilogue (models/fused.py)."""
        return self.down_proj
