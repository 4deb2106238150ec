"""Quantized checkpoints: the schemes (one registry, `QUANT_METHODS`) and how each one creates,
loads, shards and runs the weights of a parallel linear layer or a fused-MoE expert stack.

A scheme is read from the checkpoint's `quantization_config` (no flag needed); `--quantization
fp8` quantizes a 16-bit checkpoint at load time. Supported:
  fp8                 HF / DeepSeek-V3 / Qwen3-FP8: e4m3 weights, `weight_block_size` [bn, bk] with
                      `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], or per-tensor `weight_scale`
  fbgemm_fp8          Meta's Llama-3.1-405B-FP8: per-channel `weight_scale` [N, 1]
  compressed-tensors  float-quantized FP8 (tensor / channel / block weight scales); pack-quantized
                      4-bit (W4A16): `weight_packed` [N, K/8], `weight_scale` [N, G], and
                      `weight_zero_point` [N/8, G] when asymmetric
  gptq                4-bit, `qweight` [K/8, N], `qzeros` [G, N/8] (stored minus one in the v1
                      format), `scales` [G, N], `g_idx` [K] (act-order when desc_act)
  awq                 4-bit GEMM layout, `qweight` [K, N/8] packed in AWQ's column order
Activations are quantized dynamically (per token, or per 1 x bk group for block scales), also for
checkpoints that ship a static `input_scale` (read, not used: finer scales never lose accuracy).
4-bit weights are repacked once at load time into the one layout `kernels/quant.py` runs; MoE
experts (models/moe.py) of every scheme above load per expert through the same code, stacked.

Sharding: a layer tells the scheme which rows (its output slice per fused shard) and columns
(its input slice) this rank keeps; each stored tensor says along which of its axes those lie and
at what granularity (8 for packed nibbles, the block or group size for scales).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re

import torch
import torch.nn as nn

from ..kernels import quant as q
from ..kernels.fp8_prologue import fp8_add_rms_norm_linear, fp8_silu_mul_linear
from ..kernels.gemv import (add_rms_norm, add_rms_norm_linear, silu_mul_linear, silu_mul_ref,
                            silu_mul_triton, skinny_linear)
from .loader import read_slice as _read, slice_shape as _shape
from .registry import Registry

QUANT_METHODS: Registry[type] = Registry("quantization method")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not a multiple of {b} (the checkpoint's packing, group "
                         "or block size): this layer cannot be fused or sharded across "
                         "tensor-parallel ranks there")
    return a // b


def check_channel_scale(t: torch.Tensor, rows: int) -> None:
    """A per-channel scale has an entry per output row (at least the `rows` this rank reads),
    a per-tensor one a single entry: anything else is refused, not broadcast."""
    if t.numel() != 1 and (t.numel() < rows or t.dim() > 1 and t.shape[1:].numel() != 1):
        raise ValueError(f"has shape {list(t.shape)} in the checkpoint: a per-channel scale needs "
                         f"one entry per output row ({rows} at least here: [{rows}] or "
                         f"[{rows}, 1]), a per-tensor one a single entry")


def check_2d(src) -> list[int]:
    """The shape of `src`, refused unless 2-D (a per-tensor scale where the config has blocks:
    indexing it would fail without the tensor's name)."""
    shape = _shape(src)
    if len(shape) != 2:
        raise ValueError(f"has shape {list(shape)} in the checkpoint where this layer reads a 2-D "
                         "tensor (the layout its quantization config names: block scales "
                         "[ceil(N/bn), ceil(K/bk)], packed 4-bit words, group scales)")
    return shape


def copy_checked(dst: torch.Tensor, block: torch.Tensor, stored: list[int]) -> None:
    """dst.copy_(block), refusing a block of another shape: copy_ would broadcast a short one
    (one row of a block scale over every block row) without a word."""
    if tuple(block.shape) != tuple(dst.shape):
        raise ValueError(f"has shape {list(stored)} in the checkpoint, which does not fit this "
                         f"layer: it reads a [{', '.join(map(str, block.shape))}] block of it where "
                         f"[{', '.join(map(str, dst.shape))}] is needed (a scale's shape must "
                         "follow its weight's, and the block / group size)")
    dst.copy_(block)


@dataclasses.dataclass
class Slices:
    """What one rank keeps of a (fused) linear layer: `rows` = (offset in the rank's param,
    first source row, count) of the output shard being loaded; `cols` = (first source column,
    count) of the input."""
    rows: tuple[int, int, int]
    cols: tuple[int, int]
    full_in: int  # the unsharded input size (K)
    full_out: int | None = None  # the unsharded output rows of the part loaded (None: unchecked)


def load_2d(param: torch.Tensor, src, s: Slices, out_axis: int, out_div: int = 1,
            in_div: int = 1, convert=None, unpacks: bool = False) -> None:
    """Copy this rank's block of a stored [.., ..] tensor whose output dim is `out_axis` (the
    other is the input dim), each stored at granularity out_div / in_div (packed nibbles,
    block or group scales). `convert` maps the read block to the param's layout (`unpacks`: it
    unpacks the output dim, so the param holds one entry per output row)."""
    off, start, n = s.rows
    c0, nc = s.cols
    shape = check_2d(src)
    if s.full_out is not None and shape[out_axis] != -(-s.full_out // out_div):
        need = list(shape)
        need[out_axis] = -(-s.full_out // out_div)
        per = f", {out_div} to an entry" if out_div > 1 else ""
        raise ValueError(f"has shape {list(shape)} in the checkpoint where this layer needs {need} "
                         f"({s.full_out} output rows in the config{per}): a config of another "
                         "model, or a tensor not of its weight's shape")
    if unpacks:  # whole packed words: a word read for part of its values would not fit the param
        _div(n, out_div, "output shard size")
    r = (slice(_div(start, out_div, "output shard offset"),
               _div(start, out_div, "output shard offset") + -(-n // out_div)))
    cin = shape[1 - out_axis]
    if nc == s.full_in:
        c = slice(0, cin)
    else:
        c = slice(_div(c0, in_div, "input shard offset"), _div(c0, in_div, "input shard offset")
                  + _div(nc, in_div, "input shard size"))
    block = _read(src, (r, c) if out_axis == 0 else (c, r))
    if convert is not None:
        block = convert(block)
    o = _div(off, out_div, "fused shard offset") if out_div > 1 and not unpacks else off
    rows = (r.stop - r.start) * (out_div if unpacks else 1)  # the param's, from what was asked
    copy_checked(param.data[o:o + rows] if out_axis == 0 else param.data[:, o:o + rows], block, shape)


# ------------------------------------------------------------------------------------------------
# linear methods: create the params of a layer, load them, run the layer
# ------------------------------------------------------------------------------------------------

class LinearMethod:
    dense = False  # the fused norm + GEMM and SiLU + GEMM fast paths need a plain weight

    def create(self, layer: nn.Module, in_features: int, out_features: int, dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def after_loading(self, layer: nn.Module) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [N, K] in fp32, dequantized (for code that needs the matrix
        itself: MLA's absorbed kv_b_proj, models/deepseek.py)."""
        raise ValueError(f"{self.describe()} weights cannot be dequantized")

    # The decode-layer prologues (models/fused.py, RowParallelLinear.silu_mul_forward), one entry
    # point per prologue for every method: a `dense` method (16-bit weights, LoRA folded into
    # them) runs the prologue inside its GEMM (kernels/gemv.py) on `fused_operands`, then
    # `fused_epilogue`; others run one 16-bit prologue kernel, then apply (FP8 fuses more).
    def fused_operands(self, layer: nn.Module, bias):
        """(weight, bias) for a GEMM with a fused prologue (`dense` methods)."""
        return layer.weight, bias

    def fused_epilogue(self, layer: nn.Module, y: torch.Tensor, bias) -> torch.Tensor:
        """What follows that GEMM (LoRA's update, models/lora.py); nothing for a plain layer."""
        return y

    def add_rms_norm_apply(self, layer: nn.Module, h: torch.Tensor, delta: torch.Tensor,
                           norm_w: torch.Tensor, eps: float, bias: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(rmsnorm(h + delta)), h + delta)"""
        if self.dense:
            w, b = self.fused_operands(layer, bias)
            y, h = add_rms_norm_linear(h, delta, norm_w, eps, w, b)
            return self.fused_epilogue(layer, y, bias), h
        x, h = add_rms_norm(h, delta, norm_w, eps)
        return self.apply(layer, x, bias), h

    def silu_mul_apply(self, layer: nn.Module, gu: torch.Tensor, bias: torch.Tensor | None
                       ) -> torch.Tensor:
        """apply(silu(gate) * up) for gu = [gate | up]"""
        if self.dense:
            w, b = self.fused_operands(layer, bias)
            return self.fused_epilogue(layer, silu_mul_linear(gu, w), bias)
        return self.apply(layer, silu_mul(gu), bias)

    def _param(self, layer, name, shape, dtype, loader, fill=None):
        p = nn.Parameter(torch.empty(shape, dtype=dtype) if fill is None
                         else torch.full(shape, fill, dtype=dtype), requires_grad=False)
        p.weight_loader = lambda param, src, shard_id=None: loader(param, src, layer.slices(shard_id))
        setattr(layer, name, p)
        return p


class Unquantized(LinearMethod):
    dense = True

    def describe(self):
        return "dense"

    def create(self, layer, in_features, out_features, dtype):
        self._param(layer, "weight", (out_features, in_features), dtype,
                    lambda p, src, s: load_2d(p, src, s, 0))

    def apply(self, layer, x, bias):
        return skinny_linear(x, layer.weight, bias)


class Fp8Linear(LinearMethod):
    """e4m3 weights [N, K]; per-channel scales [N] (per-tensor checkpoints are expanded to their
    rows), or block scales [ceil(N/bn), ceil(K/bk)] (`weight_scale_inv`)."""

    def __init__(self, block_size: list[int] | None, scale_name: str = "weight_scale",
                 input_scale: bool = False, per_tensor: bool = False):
        self.block = list(block_size) if block_size else None
        self.scale_name = scale_name
        self.input_scale = input_scale
        self.per_tensor = per_tensor  # the checkpoint's scales (expanded to rows here): for the log

    def describe(self):
        kind = ('block %dx%d' % tuple(self.block) if self.block
                else 'per-tensor' if self.per_tensor else 'per-channel')
        # a static activation scale is not silently dropped: the log says what runs instead
        return f"fp8 e4m3 ({kind}{'; static input_scale unused, activations dynamic' if self.input_scale else ''})"

    def create(self, layer, in_features, out_features, dtype):
        self._param(layer, "weight", (out_features, in_features), q.FP8,
                    lambda p, src, s: load_2d(p, _fp8_tensor(src), s, 0))
        if self.block:
            bn, bk = self.block
            shape = (-(-out_features // bn), -(-in_features // bk))
            self._param(layer, self.scale_name, shape, torch.float32,
                        lambda p, src, s: load_2d(p, src, s, 0, bn, bk, lambda t: t.float()))
        else:
            self._param(layer, self.scale_name, (out_features,), torch.float32, self._load_scale)
        if self.input_scale:  # static activation scale: read, not used (dynamic is finer), so
            # a layer exported without one (its input quantizer off) loads as well
            self._param(layer, "input_scale", (), torch.float32, lambda p, src, s: None).optional = True

    @staticmethod
    def _load_scale(p, src, s: Slices):
        t = _read(src).float()
        off, start, n = s.rows
        check_channel_scale(t, start + n)
        if t.numel() == 1:  # per-tensor: every row of this shard
            p.data[off:off + n] = t.reshape(())
        else:  # per-channel [N] or [N, 1]
            p.data[off:off + n] = t.reshape(-1)[start:start + n]

    def scale(self, layer):
        return getattr(layer, self.scale_name)

    def dense_weight(self, layer):
        return q.dequant_fp8_weight(layer.weight, self.scale(layer), self.block)

    def apply(self, layer, x, bias):
        return q.fp8_linear(x, layer.weight, self.scale(layer), bias, self.block)

    def add_rms_norm_apply(self, layer, h, delta, norm_w, eps, bias):
        return fp8_add_rms_norm_linear(h, delta, norm_w, eps, layer.weight, self.scale(layer),
                                       bias, self.block)

    def silu_mul_apply(self, layer, gu, bias):
        return fp8_silu_mul_linear(gu, layer.weight, self.scale(layer), bias, self.block)


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
                      "F8_E5M2": "float8_e5m2"}


def _fp8_tensor(src):
    """`src`, checked to hold e4m3 values: a copy would silently cast anything else (a 16-bit
    layer the config does not list as unquantized, a "dense" checkpoint)."""
    dtype = str(src.dtype).removeprefix("torch.") if isinstance(src, torch.Tensor) else src.get_dtype()
    dtype = _SAFETENSORS_DTYPES.get(dtype, dtype)
    if dtype != "float8_e4m3fn":
        raise ValueError(f"is {dtype} in the checkpoint where the quantization config expects "
                         "float8_e4m3fn (a layer left unquantized must be listed in "
                         "modules_to_not_convert / ignore)")
    return src


class Fp8Online(Fp8Linear):
    """`--quantization fp8` on a 16-bit checkpoint: load the weight as is, then quantize it
    (per channel) once it is loaded."""

    def __init__(self):
        super().__init__(None)

    def describe(self):
        return "fp8 e4m3 (per-channel, quantized at load time)"

    def create(self, layer, in_features, out_features, dtype):
        Unquantized.create(self, layer, in_features, out_features, dtype)

    def after_loading(self, layer):
        if layer.weight.dtype == q.FP8:  # a reload: its shards were quantized as they came
            return
        dtype = layer.weight.dtype
        wq, scale = q.quant_fp8_weight(layer.weight.data)
        layer.weight = nn.Parameter(wq, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.weight_scale.written_by_weight = True  # not in the checkpoint
        # later loads (reload after sleep level 2, weight updates) bring 16-bit shards again:
        # per-channel scales make each shard's rows independent, so quantize them in place
        # (same storage: CUDA graphs stay valid), exactly as the first load did
        layer.weight.weight_loader = lambda p, src, shard_id=None: self._requantize(
            layer, p, src, layer.slices(shard_id), dtype)

    @staticmethod
    def _requantize(layer, p, src, s, dtype):
        def convert(block):
            wq, scale = q.quant_fp8_weight(block.to(p.device, dtype))
            layer.weight_scale.data[s.rows[0]:s.rows[0] + len(scale)] = scale
            return wq
        load_2d(p, src, s, 0, convert=convert)


def _unpack_cols(packed: torch.Tensor, order=None) -> torch.Tensor:
    """int32 [R, C/8] packed along columns -> uint8 [R, C] (nibble i = column 8c + order[i])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = ((packed.to(torch.int32)[:, :, None] >> shifts) & 0xF).to(torch.uint8)  # [R, C/8, 8]
    if order is not None:
        nib = nib[:, :, torch.argsort(torch.tensor(order))]
    return nib.reshape(packed.shape[0], -1)


def _packed_int32(src):
    """`src`, checked to be int32 words (older exports' unpacked int8 zero points would unpack to
    other values of the same shape)."""
    dtype = str(src.dtype).removeprefix("torch.") if isinstance(src, torch.Tensor) else src.get_dtype()
    dtype = {"I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64"}.get(dtype, dtype)
    if dtype != "int32":
        raise ValueError(f"is {dtype} in the checkpoint where packed int32 words are expected")
    return src


class W4A16(LinearMethod):
    """4-bit weight-only (GPTQ or AWQ), repacked to kernels/quant.py's layout: `qweight` int32
    [K/8, N], `scales` [G, N], `qzeros` uint8 [G, N] (None when symmetric), `g_idx` (act-order)."""

    def __init__(self, fmt: str, group_size: int, sym: bool, desc_act: bool = False,
                 zero_plus_one: bool = True):
        self.fmt, self.group_size, self.sym, self.desc_act = fmt, group_size, sym, desc_act
        self.zero_plus_one = zero_plus_one  # GPTQ v1 stores (zero - 1) mod 16
        # params are named as the checkpoint names its tensors (compressed-tensors: weight_packed
        # [N, K/8] packed along K, which is the kernel's [K/8, N] word for word, transposed)
        self.qweight, self.scales, self.qzeros, self.g_idx = (
            ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")
            if fmt == "compressed-tensors" else ("qweight", "scales", "qzeros", "g_idx"))

    def describe(self):
        return (f"{self.fmt} 4-bit ({'group %d' % self.group_size if self.group_size > 0 else 'per-channel'}, "
                f"{'symmetric' if self.sym else 'zero point'}{', act-order' if self.desc_act else ''})")

    def group_k(self, full_in: int) -> int:
        """The group size along K the kernels index with (-1, per channel: one group, all of K)."""
        return self.group_size if self.group_size > 0 else full_in

    def tensors(self, in_features: int, full_in: int, out_features: int, dtype
                ) -> list[tuple[str, tuple[int, ...], torch.dtype, object, bool]]:
        """(name, shape, dtype, loader(param, src, Slices), optional) of each tensor of an
        [in_features of full_in] x out_features weight, in the kernels' layout: what a linear
        layer makes its params of, and fused-MoE experts (models/moe.py) one per expert."""
        G = self.group_k(full_in)
        sharded_in = in_features != full_in
        # act-order rows of any group can land on any rank, and group -1's one group spans all
        # ranks: keep every group's scales
        keep_all = sharded_in and (self.desc_act or self.group_size <= 0)
        groups_kept = -(-full_in // G) if keep_all else -(-in_features // G)
        if in_features % 8:
            raise ValueError(f"4-bit weights need an input size divisible by 8 per rank, got {in_features}")
        gdiv = 1 if keep_all else G
        gcols = (lambda s: dataclasses.replace(s, cols=(0, full_in))) if keep_all else (lambda s: s)
        qshape, sshape = (in_features // 8, out_features), (groups_kept, out_features)
        out = []
        if self.fmt == "compressed-tensors":  # [N, ..] tensors: loaded through transposed views
            out.append((self.qweight, qshape, torch.int32, lambda p, src, s: load_2d(p.data.T, src, s, 0, 1, 8)))
            out.append((self.scales, sshape, dtype,
                        lambda p, src, s: load_2d(p.data.T, src, gcols(s), 0, 1, gdiv)))
            if not self.sym:  # `weight_zero_point` int32 [N/8, G], packed along N (offset by 8 as the weights)
                out.append((self.qzeros, sshape, torch.uint8,
                            lambda p, src, s: load_2d(p.data.T, _packed_int32(src), gcols(s), 0, 8, gdiv,
                                                      lambda t: _unpack_cols(t.T).T, unpacks=True)))
            if self.desc_act:  # actorder group: `weight_g_idx` [K], each input column's group
                out.append((self.g_idx, (in_features,), torch.int32,
                            lambda p, src, s: self._load_g_idx(p, src, s, G)))
            return [t + (False,) for t in out]
        if self.fmt == "gptq":
            out.append(("qweight", qshape, torch.int32, lambda p, src, s: load_2d(p, src, s, 1, 1, 8)))
            zconv = (lambda t: (_unpack_cols(t) + (1 if self.zero_plus_one else 0)) & 0xF)
        else:  # awq: [K, N/8] packed along N in AWQ's order -> unpack, repack along K
            out.append(("qweight", qshape, torch.int32,
                        lambda p, src, s: load_2d(p, src, s, 1, 8, 1,
                                                  lambda t: q.pack_int4(_unpack_cols(t, AWQ_ORDER)),
                                                  unpacks=True)))
            zconv = (lambda t: _unpack_cols(t, AWQ_ORDER))
        out.append(("scales", sshape, dtype, lambda p, src, s: load_2d(p, src, gcols(s), 1, 1, gdiv)))
        if not self.sym:  # symmetric: the zero point is 8 (GPTQ still stores it: not read)
            out.append(("qzeros", sshape, torch.uint8,
                        lambda p, src, s: load_2d(p, src, gcols(s), 1, 8, gdiv, zconv, unpacks=True)))
        out = [t + (False,) for t in out]
        if self.fmt == "gptq":  # without desc_act: dropped after loading (some exporters leave it out)
            out.append(("g_idx", (in_features,), torch.int32,
                        lambda p, src, s: self._load_g_idx(p, src, s, G), not self.desc_act))
        return out

    def create(self, layer, in_features, out_features, dtype):
        layer.group_size_k = self.group_k(layer.full_in)
        for name, shape, dt, load, optional in self.tensors(in_features, layer.full_in, out_features, dtype):
            p = self._param(layer, name, shape, dt, load)
            p.optional = optional

    def _load_g_idx(self, p, src, s: Slices, G: int):
        c0, nc = s.cols
        copy_checked(p.data, _read(src, slice(c0, c0 + nc)).to(torch.int32), _shape(src))
        # without desc_act the index is dropped (rows in order: group k // G); an act-order
        # index there would put rows in the wrong groups
        idx = p.data.cpu()
        if not self.desc_act and not torch.equal(idx, torch.arange(c0, c0 + nc, dtype=torch.int32) // G):
            rows = int((idx == idx[0]).sum())  # in order, with groups of another size?
            if torch.equal(idx, idx[0] + torch.arange(nc, dtype=torch.int32) // rows):
                raise ValueError(f"puts {rows} rows in each group where the config has group_size "
                                 f"{self.group_size}: the config is not the checkpoint's")
            raise ValueError("is an act-order index (rows not in group order) but the config has "
                             "desc_act false; set desc_act true")

    def after_loading(self, layer):
        if not self.desc_act and hasattr(layer, "g_idx"):
            del layer.g_idx  # rows in order: group k // group_size, no index needed

    def dense_weight(self, layer):
        return q.dequant_w4(getattr(layer, self.qweight), getattr(layer, self.scales),
                            getattr(layer, self.qzeros, None), getattr(layer, self.g_idx, None),
                            layer.group_size_k)

    def apply(self, layer, x, bias):
        return q.w4a16_linear(x, getattr(layer, self.qweight), getattr(layer, self.scales),
                              getattr(layer, self.qzeros, None),
                              getattr(layer, self.g_idx, None), layer.group_size_k, bias)


# ------------------------------------------------------------------------------------------------
# schemes (checkpoint configs)
# ------------------------------------------------------------------------------------------------

# fused layers and the checkpoint modules they load (models/llama.py STACKED): configs list the latter
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _listed(name: str, m: str) -> bool:
    """Whether module `name` is entry `m` of an ignore list: a run of whole name parts (the
    name, a prefix, a suffix, or a middle part such as "layers.0.mlp", as vLLM matches entries;
    "layers.1" is not layers.10), or "re:" a pattern matched from the start (compressed-tensors,
    GPTQModel)."""
    if m.startswith("re:"):
        return re.match(m[3:], name) is not None
    if any(c in m for c in "*?["):  # ModelOpt's exclude_modules are shell-style wildcards
        return fnmatch.fnmatchcase(name, m)
    return f".{m}." in f".{name}."


class QuantConfig:
    name = ""
    ignored: list[str] = []
    only: list[str] | None = None  # when set, the modules (name suffixes) quantized; others dense
    targets: list[str] | None = None  # compressed-tensors: the modules quantized (re: or names)

    def linear(self, prefix: str) -> LinearMethod:
        raise NotImplementedError

    def moe(self) -> "MoEQuant | None":
        """How fused-MoE experts are stored; None: the scheme cannot run MoE experts."""
        return None

    def _dense(self, name: str) -> bool:
        return (any(_listed(name, m) for m in self.ignored)
                or self.only is not None and not any(name.endswith("." + m) for m in self.only)
                or self.targets is not None and not any(
                    re.match(t[3:], name) if t.startswith("re:") else name == t for t in self.targets))

    def skips(self, prefix: str) -> bool:
        """Whether the config leaves module `prefix` unquantized. A fused module is when all the
        parts it loads are (Llama-3.1-405B-FP8 lists layer 0's q/k/v/gate/up_proj); some
        but not all is an error, since one fused weight cannot mix dense and quantized parts."""
        head, _, last = prefix.rpartition(".")
        if last not in FUSED_PARTS or any(_listed(prefix, m) for m in self.ignored):
            return self._dense(prefix)
        parts = [f"{head}.{p}" for p in FUSED_PARTS[last]]
        hit = [p for p in parts if self._dense(p)]
        if 0 < len(hit) < len(parts):
            raise ValueError(f"{prefix}: the {self.name} config leaves {', '.join(hit)} unquantized but "
                             f"not {', '.join(p for p in parts if p not in hit)}; a fused layer's parts "
                             "must all be quantized or all be dense")
        return bool(hit)


@dataclasses.dataclass
class MoEQuant:
    """FP8 experts: weights e4m3, scales per channel or per block, loaded per expert (or
    quantized per channel at load time: `online`). 4-bit experts (`w4`, GPTQ / AWQ /
    compressed-tensors W4A16): each expert's tensors as that scheme's linear layers make and
    load them (W4A16.tensors), stacked."""
    block: list[int] | None
    online: bool = False
    per_tensor: bool = False  # the checkpoint's scales (expanded per channel): for the log
    static: bool = False  # the checkpoint's static input_scale (dropped: activations dynamic): for the log
    w4: W4A16 | None = None


def _ignored(qc: dict) -> list[str]:
    return list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore")
                or qc.get("exclude_modules") or [])


@QUANT_METHODS.register("fp8")
class Fp8Config(QuantConfig):
    name = "fp8"

    def __init__(self, qc: dict, online: bool = False):
        fmt = qc.get("fmt", "e4m3")  # DeepSeek-V3: e4m3; MiniMax-M2: the torch dtype's name
        if str(fmt).lower() not in ("e4m3", "e4m3fn", "float8_e4m3fn"):
            raise ValueError(f"fp8 format {fmt!r} is not supported (only e4m3)")
        self.block = qc.get("weight_block_size")
        if self.block is not None and len(self.block) != 2:
            raise ValueError(f"weight_block_size must be [bn, bk], got {self.block}")
        self.static = qc.get("activation_scheme", "dynamic") == "static"
        if self.block is not None and self.static:  # its input_scale tensors would be dropped
            raise ValueError(f"fp8 weight_block_size {self.block} with activation_scheme 'static' is not "
                             "supported (block scales quantize activations per group, dynamically)")
        self.online = online
        self.ignored = _ignored(qc)

    def linear(self, prefix):
        if self.online:
            return Fp8Online()
        if self.block:
            return Fp8Linear(self.block, "weight_scale_inv")
        return Fp8Linear(None, "weight_scale", input_scale=self.static, per_tensor=True)

    def moe(self):
        return MoEQuant(None, online=True) if self.online else MoEQuant(self.block, per_tensor=not self.block,
                                                                        static=self.static)


@QUANT_METHODS.register("fbgemm_fp8")
class FbgemmFp8Config(QuantConfig):
    name = "fbgemm_fp8"

    def __init__(self, qc: dict, online: bool = False):
        self.ignored = _ignored(qc)

    def linear(self, prefix):
        return Fp8Linear(None, "weight_scale")

    def moe(self):
        return MoEQuant(None)


@QUANT_METHODS.register("modelopt")
class ModelOptConfig(QuantConfig):
    """NVIDIA ModelOpt (Model Optimizer) FP8 exports, such as nvidia/Llama-3.1-8B-Instruct-FP8: the
    scheme in hf_quant_config.json ({"quantization": {"quant_algo", "kv_cache_quant_algo",
    "exclude_modules"}}, flattened by the loader) or in config.json (quant_method modelopt,
    quant_algo, ignore, kv_cache_scheme). FP8: e4m3 `weight`, a scalar `weight_scale` and a static
    scalar `input_scale` per layer (read, not used: activations are quantized per token, finer);
    FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` per output channel. k/v scales
    (`k_proj.k_scale`, `v_proj.v_scale`) go to an fp8 KV cache. exclude_modules are wildcards."""
    name = "modelopt"
    ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")

    def __init__(self, qc: dict, online: bool = False):
        nested = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
        qc = {**nested, **qc}
        algo = str(qc.get("quant_algo") or "").upper()
        where = qc.get("source", "config.json")
        if algo not in self.ALGOS:
            raise ValueError(f"NVIDIA ModelOpt checkpoints with quant_algo {qc.get('quant_algo')!r} "
                             f"(from {where}) are not supported; supported: {', '.join(self.ALGOS)}")
        kv = qc.get("kv_cache_quant_algo")
        # config.json (ModelOpt's conversion): a dict for FP8, the algo's name as is otherwise
        scheme = qc.get("kv_cache_scheme")
        if kv and str(kv).upper() != "FP8" or isinstance(scheme, dict) and not (
                scheme.get("type") == "float" and scheme.get("num_bits") == 8) or (
                scheme and not isinstance(scheme, dict) and str(scheme).upper() != "FP8"):
            raise ValueError(f"NVIDIA ModelOpt KV cache quantization {kv or scheme!r} (from {where}) "
                             "is not supported (only FP8: per-layer k/v scales)")
        self.per_tensor = algo == "FP8"
        self.ignored = _ignored(qc)

    def linear(self, prefix):
        return Fp8Linear(None, "weight_scale", input_scale=self.per_tensor, per_tensor=self.per_tensor)

    def moe(self):
        return MoEQuant(None, per_tensor=self.per_tensor, static=self.per_tensor)


def _ct_args(args: dict | None) -> dict | None:
    """compressed-tensors QuantizationArgs as its parser reads them (and vLLM with it): type,
    strategy and actorder in any case, actorder as a bool (compressed-tensors 0.6: true is
    group), block_structure as "128x128" (its older spelling)."""
    if not args:
        return args
    out = {k: v.lower() if k in ("type", "strategy", "actorder") and isinstance(v, str) else v
           for k, v in args.items()}
    if isinstance(out.get("actorder"), bool):
        out["actorder"] = "group" if out["actorder"] else None
    block = out.get("block_structure")
    if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):
        out["block_structure"] = [int(b) for b in block.split("x")]
    return out


@QUANT_METHODS.register("compressed-tensors")
class CompressedTensorsConfig(QuantConfig):
    """The float-quantized FP8 scheme of compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC /
    FP8_BLOCK presets) and its pack-quantized W4A16; other schemes of the format are
    refused by name."""
    name = "compressed-tensors"
    w4: "W4A16 | None" = None  # llm-compressor W4A16 (pack-quantized)

    def __init__(self, qc: dict, online: bool = False):
        groups = qc.get("config_groups") or {}
        kv = qc.get("kv_cache_scheme")
        if kv:  # its k/v scales go to the fp8 KV cache (runtime/model_runner.py) as e4m3 scales
            self._check_kv_scheme(_ct_args(kv))
        self.ignored = _ignored(qc)
        self.weights_dense = not groups and bool(kv)  # a KV-cache-only checkpoint: 16-bit weights
        if self.weights_dense:
            return
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: {len(groups)} config groups; one is supported")
        g = next(iter(groups.values()))
        g = {**g, "weights": _ct_args(g.get("weights")), "input_activations": _ct_args(g.get("input_activations"))}
        w = g.get("weights") or {}
        fmt = qc.get("format", "")
        w4 = w.get("type") == "int" and w.get("num_bits") == 4 and fmt == "pack-quantized"
        if not (w.get("type") == "float" and w.get("num_bits") == 8 or w4):
            raise ValueError(f"compressed-tensors scheme with {w.get('num_bits')}-bit {w.get('type')} "
                             f"weights (format {fmt!r}) is not supported; supported: 8-bit float (FP8), "
                             "4-bit int pack-quantized (W4A16)")
        self.targets = self._check_targets(g.get("targets") or ["Linear"])
        sparsity = qc.get("sparsity_config") or {}  # "dense": weights stored whole
        for field, value in (("output_activations", g.get("output_activations")),
                             ("transform_config", qc.get("transform_config")),
                             ("sparsity_config", sparsity if sparsity.get("format", "dense") != "dense" else None)):
            if value:
                raise ValueError(f"compressed-tensors {field} {value} is not supported")
        self.w4 = self._w4a16(w, g) if w4 else None
        if w4:
            return
        strategy = w.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not supported")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported for FP8 weights "
                             "(float-quantized, naive-quantized)")
        if w.get("symmetric", True) is False:  # its `weight_zero_point` tensors would be dropped
            raise ValueError("compressed-tensors FP8 weights with symmetric: false (zero points) are "
                             "not supported")
        self.block = w.get("block_structure") if strategy == "block" else None
        if strategy == "block" and not (isinstance(self.block, list) and len(self.block) == 2):
            raise ValueError(f"compressed-tensors FP8 block strategy needs block_structure [bn, bk], "
                             f"got {self.block!r}")
        self.strategy = strategy
        act = g.get("input_activations") or {}
        if not act:  # weight-only (W8A16): quantizing its activations would change its outputs
            raise ValueError("compressed-tensors FP8 weights without input_activations (weight-only, "
                             "W8A16) are not supported: rankserve runs FP8 weights with FP8 "
                             "activations (W8A8)")
        if not (act.get("type", "float") == "float" and act.get("num_bits", 8) == 8):
            raise ValueError(f"compressed-tensors input_activations of {act.get('num_bits')}-bit "
                             f"{act.get('type')} are not supported (activations run as dynamic e4m3)")
        self.static = not act.get("dynamic", False)  # compressed-tensors' default: static

    @staticmethod
    def _check_targets(targets) -> list[str] | None:
        """The group's `targets`: the class Linear (every linear layer), "re:" patterns or module
        names (llm-compressor recipes quantizing part of the model); None: every layer."""
        targets = [targets] if isinstance(targets, str) else list(targets)
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise ValueError(f"compressed-tensors targets {t!r} is not a valid regular "
                                     f"expression ({e})") from None
            elif t != "Linear" and "." not in t:  # a class name: which modules are of it is unknown here
                raise ValueError(f"compressed-tensors targets {t!r} is not supported (the class Linear, "
                                 "re: patterns or module names)")
        return None if "Linear" in targets else targets

    @staticmethod
    def _w4a16(w: dict, g: dict) -> W4A16:
        """llm-compressor's W4A16 / W4A16_ASYM (pack-quantized, group or channel scales): the w4a16
        GEMM GPTQ runs; `actorder: group` reads `weight_g_idx` as GPTQ's desc_act reads g_idx."""
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors 4-bit weight strategy {strategy!r} is not supported "
                             "(group, channel)")
        # "group" (alias "dynamic"): a `weight_g_idx` per layer, as GPTQ's desc_act g_idx
        if w.get("actorder") not in (None, "weight", "static", "group", "dynamic"):
            raise ValueError(f"compressed-tensors 4-bit weights with actorder {w['actorder']!r} are not "
                             "supported (none, weight, group)")
        if g.get("input_activations"):
            raise ValueError(f"compressed-tensors 4-bit weights with input_activations "
                             f"{g['input_activations']} are not supported (W4A16: 16-bit activations)")
        group = int(w.get("group_size") or 0) if strategy == "group" else -1
        if strategy == "group" and group <= 0:
            raise ValueError(f"compressed-tensors 4-bit group strategy needs a group_size, got "
                             f"{w.get('group_size')!r}")
        return W4A16("compressed-tensors", group, sym=w.get("symmetric", True) is not False,
                     desc_act=w.get("actorder") in ("group", "dynamic"))

    @staticmethod
    def _check_kv_scheme(kv: dict) -> None:
        if not (kv.get("type", "float") == "float" and kv.get("num_bits", 8) == 8):
            raise ValueError(f"compressed-tensors kv_cache_scheme of {kv.get('num_bits')}-bit "
                             f"{kv.get('type')} is not supported (only 8-bit float: an e4m3 KV cache)")
        if kv.get("symmetric", True) is False:
            raise ValueError("compressed-tensors kv_cache_scheme with symmetric: false (zero points) "
                             "is not supported")
        if kv.get("strategy", "tensor") != "tensor":
            raise ValueError(f"compressed-tensors kv_cache_scheme strategy {kv['strategy']!r} is not "
                             "supported (only tensor: one k and one v scale per layer)")

    def linear(self, prefix):
        if self.weights_dense:
            return Unquantized()
        if self.w4 is not None:
            return self.w4
        return Fp8Linear(self.block, "weight_scale", input_scale=self.static,
                         per_tensor=self.strategy == "tensor")

    def moe(self):
        if self.weights_dense:  # 16-bit experts
            return None
        if self.w4 is not None:
            return MoEQuant(None, w4=self.w4)
        return MoEQuant(self.block, per_tensor=self.strategy == "tensor", static=self.static)


@QUANT_METHODS.register("gptq")
class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, qc: dict, online: bool = False):
        if qc.get("bits", 4) != 4:
            raise ValueError(f"gptq with {qc.get('bits')} bits is not supported (only 4)")
        # AutoGPTQ / transformers write checkpoint_format, GPTQModel format (v2: zeros as they are)
        given = {k: qc[k] for k in ("checkpoint_format", "format") if qc.get(k)}
        if len(set(given.values())) > 1:
            raise ValueError(f"gptq checkpoint_format {given['checkpoint_format']!r} and format "
                             f"{given['format']!r} disagree")
        key, fmt = next(iter(given.items()), ("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq {key} {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("lm_head"):
            raise ValueError("gptq lm_head: true (a quantized LM head) is not supported")
        if qc.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"gptq pack_dtype {qc['pack_dtype']!r} is not supported (only int32)")
        if qc.get("is_marlin_format"):
            raise ValueError("gptq is_marlin_format: true (AutoGPTQ's Marlin layout) is not supported")
        self.method = W4A16("gptq", int(qc.get("group_size", 128)), bool(qc.get("sym", True)),
                            bool(qc.get("desc_act", False)), zero_plus_one=fmt == "gptq")
        self.ignored = _ignored(qc)
        blocks = qc.get("modules_in_block_to_quantize")  # transformers / optimum: an allow list
        if blocks:
            self.only = [m for group in blocks for m in group]
        # GPTQModel's per-module rules: "-:pattern" leaves modules dense; overrides are refused
        for rule, override in (qc.get("dynamic") or {}).items():
            if rule.startswith("-:"):
                self.ignored.append("re:" + rule[2:])
            elif any(qc.get(k) != v for k, v in override.items()):
                raise ValueError(f"gptq dynamic override {rule!r} ({override}) is not supported: "
                                 "every module must share the config's bits / group_size / sym / desc_act")

    def linear(self, prefix):
        return self.method

    def moe(self):
        return MoEQuant(None, w4=self.method)


@QUANT_METHODS.register("awq")
class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, qc: dict, online: bool = False):
        if qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise ValueError("awq: only 4-bit weights are supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (only the GEMM layout)")
        # the GEMM layout always stores `qzeros` (AutoAWQ's packer needs them): read them even
        # where `zero_point` is false, as vLLM does; a fixed zero of 8 would be silently wrong
        self.method = W4A16("awq", int(qc.get("group_size", qc.get("q_group_size", 128))), sym=False)
        self.ignored = _ignored(qc)

    def linear(self, prefix):
        return self.method

    def moe(self):
        return MoEQuant(None, w4=self.method)


# vLLM's kernel-named --quantization values for a checkpoint format: here, that format
FLAG_FORMATS = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


def quant_config_of(hf_config, flag: str | None) -> QuantConfig | None:
    """The checkpoint's scheme, or `--quantization`'s; a disagreement is an error."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if qc:
        method = str(qc.get("quant_method", "")).lower()
        if not method:
            raise ValueError(f"the checkpoint's quantization_config has no quant_method (its fields: "
                             f"{', '.join(sorted(qc))}); supported: {', '.join(QUANT_METHODS.names())}")
        if flag and FLAG_FORMATS.get(flag, flag) != method:
            raise ValueError(f"--quantization {flag} does not match the checkpoint's "
                             f"quantization_config (quant_method {method!r})")
        return QUANT_METHODS.get(method)(qc)
    if flag:
        if flag != "fp8":
            raise ValueError(f"--quantization {flag} needs a checkpoint quantized that way; only "
                             "fp8 can quantize a 16-bit checkpoint at load time")
        return Fp8Config({}, online=True)
    return None


class _Current:
    config: QuantConfig | None = None


_CURRENT = _Current()


class building:
    """`with building(qconfig): model = cls(...)`: the parallel linear layers made inside take
    their method from the scheme (the model definitions stay scheme-agnostic)."""

    def __init__(self, config: QuantConfig | None):
        self.config = config

    def __enter__(self):
        self.prev, _CURRENT.config = _CURRENT.config, self.config

    def __exit__(self, *exc):
        _CURRENT.config = self.prev


def current_linear_method() -> LinearMethod:
    cfg = _CURRENT.config
    return Unquantized() if cfg is None else cfg.linear("")


def current_moe_quant(prefix: str = "") -> MoEQuant | None:
    """How the experts of checkpoint module `prefix` (`model.layers.N.mlp.experts`) are stored:
    dense (None) where the config leaves them unquantized (its ignore list names the module, or
    every part of its first expert; or `modules_in_block_to_quantize` lists none of them), as
    vLLM skips such a layer; a checkpoint quantizing some experts but not others then fails on
    the first quantized tensor it stores for them, by name."""
    cfg = _CURRENT.config
    if cfg is None:
        return None
    if prefix and (any(_listed(prefix, m) for m in cfg.ignored) or any(
            all(cfg._dense(f"{prefix}.0.{p}") for p in parts) for parts in _EXPERT_PARTS)):
        return None
    m = cfg.moe()
    if m is None and not getattr(cfg, "weights_dense", False):
        raise ValueError(f"{cfg.name} quantization does not support MoE experts")
    return m


_EXPERT_PARTS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # Qwen3-MoE / DeepSeek, Mixtral


def apply_ignored(model: nn.Module, config: QuantConfig | None) -> None:
    """Layers the checkpoint left unquantized (`modules_to_not_convert` / `ignore` /
    `modules_in_block_to_quantize`, or compressed-tensors `targets` that do not match them) get
    dense weights again; they were built with the scheme's method."""
    if config is None or not config.ignored and config.only is None and config.targets is None:
        return
    for name, mod in model.named_modules():
        if hasattr(mod, "set_method") and not mod.quant.dense and config.skips(name):
            mod.set_method(Unquantized())


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return silu_mul_triton(gu) if gu.is_cuda else silu_mul_ref(gu)
