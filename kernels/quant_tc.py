"""Tensor-core skinny GEMMs for decode-sized batches (M <= TC_MAX_M rows) of the quantized linear
layers (issue #14), beside the CUDA-core skinny kernels of kernels/quant.py:

  fp8_tc(x2, w, w_scale, bias, block_size, out, split=None)     FP8 W8A8
  w4_tc(x2, qweight, scales, zeros, g_idx, group_size, bias, out, split=None)   w4a16

Swapped operands: each program computes y^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, K] @ x^T[K, BLOCK_M]
with tl.dot, the weight tile the wide MMA operand (BLOCK_N >= 64 lets Hopper use wgmma) and the
few activation rows padded to the MMA minimum of 16. So the FP8 weight bytes go into the tensor
cores as they are (fp8 x fp8, fp32 accumulation): no per-element fp8 -> fp32 conversion on the
CUDA cores, which is what bounds the CUDA-core skinny kernel (benchmarks/2026-12-03-h200-s3).

FP8: the activations are quantized in the kernel's prologue from x (M <= FUSE_QUANT_M rows):
per token, a pre-pass over the row (from L2) gives the amax; per 1 x bk group (block weights,
BLOCK_K = bk) the group's amax comes from the loaded chunk itself. Larger M: one quant kernel
(kernels/quant.py) first. Scales: per-channel weight x per-token activation in the epilogue;
block-wise, per K block (BLOCK_K divides bk): the dot's fp32 result times the block's weight
scale (per row of the tile) and the rows' group scales.
w4a16: the int4 tile [BLOCK_K, BLOCK_N] is unpacked in registers (the 2^23 exponent trick, no
int -> float conversion) to (q - zero) in x's dtype (exact), the tl.dot result times the group
scale when the K block lies in one group, else a fully dequantized tile (g_idx, small groups).

Split-K (program_id(1)): fp32 partials [split, M, N]; the last program of each column tile to
finish (a per-tile counter, acq_rel atomics) sums them (+ bias, cast): no second launch
(SPLITK_IN_KERNEL False: one small sum kernel instead).
Configs come from a static table of shapes (`tc_config`), not autotuning (nothing is
benchmarked under CUDA-graph capture); `benchmarks/2026-12-04-h200-s8/tune_tc.py` sweeps them,
`benchmarks/2026-12-03-h200-s3/tune.py tc` compares them with the CUDA-core kernels.
Under TRITON_INTERPRET=1 the same kernels run on CPU (fp8 tl.dot included); the interpreter's
bf16 tl.dot is wrong (numpy has no bf16), so the w4 kernel is checked in fp16 / fp32 there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import _INTERPRET, _act_scale, _num_sms, _to_fp8, quant_fp8_triton

FUSE_QUANT_M = 4  # rows up to which fp8_tc quantizes the activations in its own prologue
SPLITK_IN_KERNEL = True  # split-K partials summed by each tile's last program (else one more kernel)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _epilogue(acc, bias_ptr, y_ptr, out_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, pid_n,
              pid_k, stride_ym, stride_ys, HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr):
    """acc = y^T [BLOCK_N, BLOCK_M] of this program -> y (+ bias). REDUCE (split-K in the kernel):
    y is the fp32 workspace [split, M, N]; the last program of a column tile (a counter per tile,
    acq_rel atomics) sums the partials into out [M, N] and resets the counter to 0."""
    mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if REDUCE:
        tl.store(y_ptrs + pid_k * stride_ys, acc, mask=mask)
        # every thread's stores before the one thread's release (cumulative through the barrier)
        tl.debug_barrier()
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if count == tl.num_programs(1) - 1:
            tl.debug_barrier()  # the acquire before any thread's loads
            total = tl.zeros_like(acc)
            for s in range(0, tl.num_programs(1)):
                total += tl.load(y_ptrs + s * stride_ys, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None],
                     total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs + pid_k * stride_ys, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compile for every decode batch size
def _fp8_tc_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, out_ptr, cnt_ptr, M, N, K,
                   k_per_split,
                   stride_xm, stride_xsm, stride_wsn, stride_ym, stride_ys, GROUP_N: tl.constexpr,
                   GROUP_K: tl.constexpr, QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr,
                   REDUCE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   PRE_BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    # QUANT_X: x is the 16-bit activation, quantized here (GROUP_K 0: per token, else
    # BLOCK_K == GROUP_K, one group a step); else x is fp8 with scales xs [M, 1 or K/GROUP_K].
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask, m_mask = offs_n < N, offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]        # [BN, BK]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]
    if QUANT_X and GROUP_K == 0:  # per-token amax of the whole row (L2-resident), each row in
        offs_p = tl.arange(0, PRE_BLOCK)  # few wide loads (a chain of small ones is latency)
        amax = tl.zeros([BLOCK_M], tl.float32)
        for m in range(0, M):
            am = tl.zeros([PRE_BLOCK], tl.float32)
            for k0 in range(0, K, PRE_BLOCK):
                xr = tl.load(x_ptr + m * stride_xm + k0 + offs_p, mask=offs_p < K - k0, other=0.0)
                am = tl.maximum(am, tl.abs(xr.to(tl.float32)))
            amax = tl.where(offs_m == m, tl.max(am, 0), amax)
        xs, x_inv = _act_scale(amax)  # [BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xa = tl.load(x_ptrs + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if QUANT_X:
            xf = xa.to(tl.float32)
            if GROUP_K != 0:
                xs, x_inv = _act_scale(tl.max(tl.abs(xf), 0))
            xa = _to_fp8(xf * x_inv[None, :], EMULATE)
        if GROUP_K == 0:  # a dot per K step, summed in fp32: Hopper's FP8 MMA accumulates in
            acc += tl.dot(w, xa)  # reduced precision, over a whole row 1-2 % off (as DeepSeek-V3 notes)
        else:
            g = k0 // GROUP_K
            if not QUANT_X:
                xs = tl.load(xs_ptr + offs_m * stride_xsm + g, mask=m_mask, other=0.0)
            sw = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_wsn + g, mask=n_mask, other=0.0)
            acc += tl.dot(w, xa) * sw[:, None] * xs[None, :]
    if GROUP_K == 0:
        if not QUANT_X:
            xs = tl.load(xs_ptr + offs_m * stride_xsm, mask=m_mask, other=0.0)
        acc *= tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None] * xs[None, :]
    _epilogue(acc, bias_ptr, y_ptr, out_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, pid_n,
              pid_k, stride_ym, stride_ys, HAS_BIAS, REDUCE)


@triton.jit(do_not_specialize=["M"])
def _w4_tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr, out_ptr, cnt_ptr, M, N, K,
                  k_per_split, group_size, stride_xm, stride_ym, stride_ys, HAS_ZERO: tl.constexpr,
                  HAS_GIDX: tl.constexpr, CHUNK_GROUP: tl.constexpr, DOT_IEEE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # y^T [BN, BM] += W [BN, BK] @ x^T [BK, BM]; W^T's tile [BK, BN] is unpacked from qweight
    # [K/8, N] (row k0 + 8i + j in nibble j of packed row k0/8 + i) and transposed for the dot.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_i = tl.arange(0, BLOCK_K // 8)
    shifts = 4 * tl.arange(0, 8)
    n_mask, m_mask = offs_n < N, offs_m < M
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        xa = tl.load(x_ptrs + k0, mask=(offs_k[:, None] < K - k0) & m_mask[None, :], other=0.0)
        i_mask = offs_i < (K - k0) // 8
        p = tl.load(qw_ptr + (k0 // 8 + offs_i).to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=i_mask[:, None] & n_mask[None, :], other=0)
        q = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
        if CHUNK_GROUP:  # one group: dot on the exact (q - zero), the scale on the result
            idx = (k0 // group_size) * N + offs_n
            s = tl.load(s_ptr + idx, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_ptr + idx, mask=n_mask, other=0).to(tl.float32) + 8388608.0
            else:
                z = tl.zeros_like(s) + 8388616.0
            wt = tl.trans((qf - z[None, :]).to(xa.dtype))
            if DOT_IEEE:
                part = tl.dot(wt, xa, input_precision="ieee")
            else:
                part = tl.dot(wt, xa)
            acc += part * s[:, None]
        else:  # per-row groups (g_idx or groups smaller than BLOCK_K): dequantized tile
            rows = tl.minimum(k0 + offs_k, K - 1)
            if HAS_GIDX:
                g = tl.load(g_ptr + rows)
            else:
                g = rows // group_size
            idx = g.to(tl.int64)[:, None] * N + offs_n[None, :]
            s = tl.load(s_ptr + idx, mask=n_mask[None, :], other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_ptr + idx, mask=n_mask[None, :], other=0).to(tl.float32) + 8388608.0
            else:
                z = tl.zeros_like(s) + 8388616.0
            wt = tl.trans(((qf - z) * s).to(xa.dtype))
            if DOT_IEEE:
                acc = tl.dot(wt, xa, acc, input_precision="ieee")
            else:
                acc = tl.dot(wt, xa, acc)
    _epilogue(acc, bias_ptr, y_ptr, out_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, pid_n,
              pid_k, stride_ym, stride_ys, HAS_BIAS, REDUCE)


@triton.jit
def _splitk_sum_kernel(part_ptr, bias_ptr, y_ptr, MN, N, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y [M, N] = sum over SPLIT fp32 partials [SPLIT, M, N] (+ bias), cast: one launch
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# configs and launchers
# ----------------------------------------------------------------------------------------------

def tc_config(kind: str, M: int, N: int, K: int, on_gpu: bool, prologue: bool = False) -> dict:
    """Tile shapes and split-K for kind 'fp8' / 'fp8blk' / 'w4' from the shape (static table).
    `prologue`: every program first reads the whole activation row (FP8 quantized in the
    kernel). Measured on an H200 at Llama-8B decode shapes, M = 1, every config of a wide sweep
    (benchmarks/2026-12-04-h200-s8/tune_tc.py): split-K pays only where the column tiles leave
    most SMs idle (its fp32 partials and last-program sum cost more than they save on qkv's 96
    tiles), deep pipelines pay on the long K loops; BLOCK_N 64 keeps the weight the
    wgmma-sized operand, 128 on the widest layers (gate_up) and block-FP8 prologues."""
    block_m = max(16, triton.next_power_of_2(M))
    if not on_gpu:  # interpreter: small tiles, several K steps and ragged edges on small tests
        return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=32, NUM_STAGES=1, num_warps=4, SPLIT=1)
    sms = _num_sms(torch.cuda.current_device())

    def doubling(tiles, k_blocks, cap):  # fill about two waves, >= 4 K blocks a split
        split = 1
        while tiles * split < 2 * sms and k_blocks // (2 * split) >= 4 and split < cap:
            split *= 2
        return split

    if kind == "fp8" and not prologue:  # qkv 8.9 (was 12.5) us, gate_up 30.2, down 17.6 (20.5)
        bn = 128 if N >= 16384 else 64
        split = 2 if triton.cdiv(N, bn) < sms // 2 and triton.cdiv(K, 256) >= 32 else 1
        return dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=256, NUM_STAGES=3 if bn == 128 else 6,
                    num_warps=4, SPLIT=split)
    if kind == "fp8":  # o_proj quantizing its input: 9.5 (10.3) us
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, num_warps=4,
                    SPLIT=doubling(triton.cdiv(N, 64), triton.cdiv(K, 128), 4))
    if kind == "fp8blk":  # BLOCK_K = the block's 128: qkv 10.3, o 9.7, gate_up 31.0, down 18.6 us
        bn = 128 if N >= 16384 or prologue else 64
        tiles = triton.cdiv(N, bn)
        split = doubling(tiles, triton.cdiv(K, 128), 8 if prologue else 4) if prologue or tiles < sms else 1
        return dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=128, NUM_STAGES=6 if K >= 8192 else 4,
                    num_warps=4, SPLIT=split)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, num_warps=4,
                SPLIT=doubling(triton.cdiv(N, 64), triton.cdiv(K, 128), 8))


_COUNTERS: dict = {}  # device -> int32 zeros, one per column tile (split-K in the kernel)
MAX_TILES = 1 << 16


def _counters(device: torch.device) -> torch.Tensor | None:
    """The split-K tile counters of a device: allocated once, outside CUDA-graph capture (every
    kernel leaves them at 0); None while capturing before that (the sum kernel serves then).
    Kernels on one stream run one after another; two split-K GEMMs on concurrent streams of a
    device would share them (none do)."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return c


def reserve(device: torch.device) -> None:
    """Allocate the device's split-K counters now (the runtime calls it at start-up, before any
    CUDA graph is captured)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    _counters(d)


def _run(kernel, args, M, N, K, out, bias, cfg, split, **consts):
    """Launches a split-K-capable tc kernel into out [M, N]: args are the kernel's arguments
    before bias_ptr; after y_ptr, out_ptr, cnt_ptr come M, N, K, k_per_split, `consts['after']`
    and the y strides. Split-K: fp32 partials in a workspace, summed by the kernel's last program
    of each column tile (SPLITK_IN_KERNEL) or by one more small kernel."""
    cfg = dict(cfg)
    table_split = cfg.pop("SPLIT")  # never a kernel argument
    split = table_split if split is None else split
    bk = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_per_split)
    after = consts.pop("after")
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
    assert out.is_contiguous()
    if split == 1:
        kernel[grid](*args, bias, out, None, None, M, N, K, k_per_split, *after, out.stride(0), 0,
                     HAS_BIAS=bias is not None, REDUCE=False, **consts, **cfg)
        return out
    part = torch.empty(split, M, N, dtype=torch.float32, device=out.device)
    counters = _counters(out.device) if SPLITK_IN_KERNEL else None
    if counters is not None:
        assert grid[0] <= MAX_TILES
        kernel[grid](*args, bias, part, out, counters, M, N, K, k_per_split, *after, N, M * N,
                     HAS_BIAS=bias is not None, REDUCE=True, **consts, **cfg)
        return out
    kernel[grid](*args, None, part, None, None, M, N, K, k_per_split, *after, N, M * N,
                 HAS_BIAS=False, REDUCE=False, **consts, **cfg)
    block = 64 if _INTERPRET else 1024
    _splitk_sum_kernel[(triton.cdiv(M * N, block),)](part, bias, out, M * N, N, SPLIT=split,
                                                     HAS_BIAS=bias is not None, BLOCK=block)
    return out


def fp8_tc(x2: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           block_size: list[int] | None, out: torch.Tensor, split: int | None = None,
           fuse_quant: bool | None = None, prequant: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = fp8_linear(x2, ...) on the tensor cores; x2 [M, K] unit stride along K.
    prequant: x2 is already e4m3 and this is its scale [M, 1] (per token) or [M, K / bk]
    (kernels/fp8_prologue.py)."""
    M, K = x2.shape
    N = w.shape[0]
    group_n, group_k = (1, 0) if block_size is None else block_size
    if fuse_quant is None:
        fuse_quant = M <= FUSE_QUANT_M
    cfg = tc_config("fp8blk" if group_k else "fp8", M, N, K, x2.is_cuda,
                    prologue=fuse_quant and prequant is None)
    if group_k:  # one (activation, weight) block scale per step: BLOCK_K divides bk
        cfg["BLOCK_K"] = min(group_k & -group_k, 128)
        assert cfg["BLOCK_K"] >= 16, f"fp8_tc: block bk={group_k} needs a factor of 16"
    if fuse_quant and group_k and cfg["BLOCK_K"] != group_k:
        fuse_quant = False  # a group wider than a step: quantize first
    if prequant is not None:
        xq, xs, stride_xs, fuse_quant = x2, prequant, prequant.stride(0), False
    elif fuse_quant:
        xq, xs, stride_xs = x2, None, 0
    else:
        xq, xs = quant_fp8_triton(x2, group_k)
        stride_xs = xs.stride(0)
    ws = w_scale.reshape(N) if block_size is None else w_scale
    return _run(_fp8_tc_kernel, (xq, xs, w, ws), M, N, K, out, bias, cfg, split,
                after=(xq.stride(0), stride_xs, ws.stride(0) if group_k else 0),
                GROUP_N=group_n, GROUP_K=group_k, QUANT_X=fuse_quant, EMULATE=_INTERPRET,
                PRE_BLOCK=min(triton.next_power_of_2(K), 64 if _INTERPRET else 4096))


def w4_tc(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
          zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
          bias: torch.Tensor | None, out: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """out [M, N] = w4a16_linear(x2, ...) on the tensor cores (dequantized in registers)."""
    M, K = x2.shape
    N = qweight.shape[1]
    cfg = tc_config("w4", M, N, K, x2.is_cuda)
    assert g_idx is not None or group_size % 8 == 0, f"w4a16: group_size {group_size} % 8 != 0"
    return _run(_w4_tc_kernel, (x2, qweight, scales, zeros, g_idx), M, N, K, out, bias, cfg,
                split, after=(group_size, x2.stride(0)), HAS_ZERO=zeros is not None,
                HAS_GIDX=g_idx is not None,
                CHUNK_GROUP=g_idx is None and group_size % cfg["BLOCK_K"] == 0,
                DOT_IEEE=x2.dtype == torch.float32)
