"""Fused mixture-of-experts MLP (Qwen3-MoE, Mixtral): out = sum_k w_k * W2_e (silu(G_e x) * U_e x).

Weights: w13 [E, 2I, H] (gate rows [:I], up rows [I:]), w2 [E, H, I]. topk_ids == -1 marks an
expert that lives on another rank (expert parallelism): it contributes nothing here.

Triton path: the T*K (token, expert) pairs are sorted by expert into groups padded to BLOCK_M rows
(two small Triton kernels, shape-bounded, no host sync: CUDA-graph capturable); one grouped GEMM
computes silu(gate) * up per pair, a second multiplies by w2 and the routing weight; the K rows of
each token are summed at the end.

FP8 experts (w13 / w2 float8_e4m3fn, scales per output channel or per [bn, bk] block, as in
kernels/quant.py): x is quantized once per token (per token, or per 1 x bk group) by the
quantization kernel of kernels/quant.py, the grouped GEMMs run tl.dot on FP8 operands with fp32
accumulation (block scales applied per K block, per-channel ones at the end), and the
silu(gate) * up activation is stored in x.dtype and quantized the same way before the down GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import FP8, _quant_act_ref, dequant_fp8_weight, quant_fp8_triton
from .custom_op import custom_op


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_size: list[int] | None = None) -> torch.Tensor:
    """Plain torch, computed in fp32. FP8 experts (w13 / w2 float8_e4m3fn with their scales):
    the activations are quantized as the kernels do (x per token or per 1 x bk group; the
    silu(gate) * up activation rounded to x.dtype, then quantized the same way), the weights
    dequantized, and the products computed in fp32."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    fp8 = w13.dtype == FP8
    if fp8:
        assert w13_scale is not None and w2_scale is not None, "fused_moe: FP8 experts need scales"
        xf = _quant_act_ref(x, block_size)
    else:
        xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if fp8:
            w13e = dequant_fp8_weight(w13[e], w13_scale[e], block_size)
            w2e = dequant_fp8_weight(w2[e], w2_scale[e], block_size)
        else:
            w13e, w2e = w13[e].float(), w2[e].float()
        h = xf[tok] @ w13e.T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        if fp8:  # the kernels store the activation in x.dtype, then quantize it
            act = _quant_act_ref(act.to(x.dtype), block_size)
        y = (act @ w2e.T) * topk_weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# routing: sort (token, expert) pairs into per-expert groups padded to BLOCK_M
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    tl.atomic_add(counts_ptr + e, 1, mask=(e >= 0) & (e < NUM_EXPERTS))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_scatter_kernel(ids_ptr, counts_ptr, cursor_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                        num_blocks, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # Every program rebuilds the (tiny) padded group layout from the counts, then places its
    # pairs (slot within the group from an atomic cursor: order inside a group is irrelevant,
    # each pair's result row is addressed by the pair index) and labels its row blocks.
    ex = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ex, mask=ex < NUM_EXPERTS, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)

    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # expert of a block = number of groups ending at or before its first row (>= E: unused)
    b_exp = tl.sum((pad_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
    tl.store(block_expert_ptr + blocks, b_exp, mask=blocks < num_blocks)

    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = (e >= 0) & (e < NUM_EXPERTS)
    slot = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    pad_start = tl.sum(tl.where(ex[None, :] < e[:, None], padded[None, :], 0), 1)
    tl.store(pairs_ptr + pad_start + slot, offs, mask=valid)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sorted_pairs [L], block_expert [L // block_m]).

    sorted_pairs holds flat pair indices (token * K + k) grouped by expert, each group padded to
    a multiple of block_m with the sentinel T*K; block_expert[b] is the expert of rows
    [b*block_m, (b+1)*block_m), or >= num_experts for unused blocks. L depends on shapes only.
    Two small Triton kernels (count, place) instead of a chain of torch ops: fewer launches.
    """
    ids = topk_ids.reshape(-1).contiguous()
    n = ids.numel()
    # at most min(E, n) groups, each padded by < block_m rows
    cap = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    num_blocks = cap // block_m
    counters = torch.zeros(2, num_experts, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.full((cap,), n, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    block = 64
    _moe_count_kernel[(triton.cdiv(n, block),)](ids, counters[0], n, NUM_EXPERTS=num_experts,
                                                 BLOCK=block)
    _moe_scatter_kernel[(triton.cdiv(max(n, num_blocks), block),)](
        ids, counters[0], counters[1], sorted_pairs, block_expert, n, num_blocks,
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
        BLOCK=block)
    return sorted_pairs, block_expert


@triton.jit
def _fp8_scales(s_ptr, rows, row_mask, ws_ptr, cols, col_mask, k0, stride_s, stride_wsn,
                GROUP_N: tl.constexpr, GROUP_K: tl.constexpr):
    """(row scales [BLOCK_M], column scales [BLOCK_N]) of the K block at k0 (GROUP_K > 0: block
    scales) or of the whole product (GROUP_K 0: per token x per channel; k0 unused)."""
    if GROUP_K == 0:
        sa = tl.load(s_ptr + rows * stride_s, mask=row_mask, other=0.0)
        sw = tl.load(ws_ptr + cols, mask=col_mask, other=0.0)
    else:
        sa = tl.load(s_ptr + rows * stride_s + k0 // GROUP_K, mask=row_mask, other=0.0)
        sw = tl.load(ws_ptr + (cols // GROUP_N) * stride_wsn + k0 // GROUP_K, mask=col_mask,
                     other=0.0)
    return sa, sw


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                        stride_xt, stride_we, stride_wn, stride_at,
                        xs_ptr, ws_ptr, stride_xst, stride_wse, stride_wsn,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
                        NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP8: tl.constexpr = False,
                        GROUP_N: tl.constexpr = 1, GROUP_K: tl.constexpr = 0):
    # act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, INTER + n]) for one row block.
    # FP8: x is the quantized activation (scales xs [T, 1] or [T, ceil(H / GROUP_K)]), w13 FP8
    # with scales ws [E, 2I] or [E, ceil(2I / GROUP_N), ceil(H / GROUP_K)]; block scales are
    # applied per K block (BLOCK_K divides GROUP_K), per-channel ones after the loop.
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_mask = offs_k < HIDDEN - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if FP8 and GROUP_K > 0:
            sa, sg = _fp8_scales(xs_ptr, tok, row_mask, ws_ptr + e * stride_wse, offs_n, n_mask, k0, stride_xst,
                                 stride_wsn, GROUP_N, GROUP_K)
            _, su = _fp8_scales(xs_ptr, tok, row_mask, ws_ptr + e * stride_wse, INTER + offs_n, n_mask, k0,
                                stride_xst, stride_wsn, GROUP_N, GROUP_K)
            acc_g += tl.dot(a, tl.load(g_ptrs + k0, mask=w_mask, other=0.0)) * sa[:, None] * sg
            acc_u += tl.dot(a, tl.load(u_ptrs + k0, mask=w_mask, other=0.0)) * sa[:, None] * su
        else:
            # summed in fp32 per K step: Hopper's FP8 MMA accumulates in reduced precision (a
            # 16-bit dot folds the add back into the MMA)
            acc_g += tl.dot(a, tl.load(g_ptrs + k0, mask=w_mask, other=0.0))
            acc_u += tl.dot(a, tl.load(u_ptrs + k0, mask=w_mask, other=0.0))
    if FP8 and GROUP_K == 0:
        sa, sg = _fp8_scales(xs_ptr, tok, row_mask, ws_ptr + e * stride_wse, offs_n, n_mask, 0, stride_xst,
                             stride_wsn, GROUP_N, GROUP_K)
        _, su = _fp8_scales(xs_ptr, tok, row_mask, ws_ptr + e * stride_wse, INTER + offs_n, n_mask, 0, stride_xst,
                            stride_wsn, GROUP_N, GROUP_K)
        acc_g *= sa[:, None] * sg[None, :]
        acc_u *= sa[:, None] * su[None, :]
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_at + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(act_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, num_pairs,
                     stride_at, stride_we, stride_wn, stride_ot,
                     as_ptr, ws_ptr, stride_ast, stride_wse, stride_wsn,
                     HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP8: tl.constexpr = False, GROUP_N: tl.constexpr = 1,
                     GROUP_K: tl.constexpr = 0):
    # out[pair, n] = weight[pair] * act[pair] . w2[e, n]  (FP8: as in the gate-up kernel, the
    # activation quantized per pair row, or per row and 1 x GROUP_K group)
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    pair64 = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair64[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_mask = offs_k < INTER - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8 and GROUP_K > 0:
            sa, sw = _fp8_scales(as_ptr, pair64, row_mask, ws_ptr + e * stride_wse, offs_n, n_mask, k0, stride_ast,
                                 stride_wsn, GROUP_N, GROUP_K)
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        else:
            acc += tl.dot(a, w)
    if FP8 and GROUP_K == 0:
        sa, sw = _fp8_scales(as_ptr, pair64, row_mask, ws_ptr + e * stride_wse, offs_n, n_mask, 0, stride_ast,
                             stride_wsn, GROUP_N, GROUP_K)
        acc *= sa[:, None] * sw[None, :]
    acc *= tl.load(weights_ptr + pair64, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair64[:, None] * stride_ot + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _moe_config(num_pairs: int, on_gpu: bool) -> dict:
    """Row-block height from the pair count (shape-only). Few pairs per expert (decode) want
    short blocks (less padding); large batches want tall ones (H200: 272 vs 239 TFLOP/s at
    T=4096, top-8 of 128 experts, H 2048, I 768)."""
    if not on_gpu:  # interpreter
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    if num_pairs <= 256:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    if num_pairs <= 8192:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     block_size: list[int] | None = None) -> torch.Tensor:
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    K = topk_ids.shape[1]
    assert w13.shape[2] == H and w2.shape == (E, H, inter), "fused_moe: weight shapes mismatch"
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    n = T * K
    if n == 0:
        return torch.zeros_like(x)
    cfg = _moe_config(n, x.is_cuda)
    fp8 = w13.dtype == FP8
    if fp8:
        assert w2.dtype == FP8 and w13_scale is not None and w2_scale is not None, \
            "fused_moe: FP8 experts need w13 and w2 in float8_e4m3fn and both scales"
        group_n, group_k = block_size if block_size is not None else (1, 0)
        if group_k:  # each K block within one scale group
            assert group_k % 16 == 0, f"fused_moe: block bk={group_k} must be a multiple of 16"
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_k & -group_k)
        w13_scale, w2_scale = w13_scale.float().contiguous(), w2_scale.float().contiguous()
        # the kernels index per-channel scales as [E, rows] and block scales as [E, nb, kb]
        sw13 = (w13_scale.stride(0), w13_scale.stride(1) if group_k else 0)
        sw2 = (w2_scale.stride(0), w2_scale.stride(1) if group_k else 0)
        fp8_kw = dict(FP8=True, GROUP_N=group_n, GROUP_K=group_k)
        a_in, a_scale = quant_fp8_triton(x, group_k)  # once per token, shared by its experts
    else:
        fp8_kw = {}
        a_in, a_scale, sw13, sw2 = x, None, (0, 0), (0, 0)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {k: v for k, v in cfg.items() if k.startswith("num_")}
    pairs, block_expert = moe_align(topk_ids, E, bm)
    num_blocks = block_expert.shape[0]
    weights = topk_weights.reshape(-1).contiguous()

    # FP8: zeros, as the rows of off-rank pairs (never written) are quantized too
    act = (torch.zeros if fp8 else torch.empty)(n, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        a_in, w13, act, pairs, block_expert, n, a_in.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), a_scale, w13_scale, a_scale.stride(0) if fp8 else 0, *sw13,
        HIDDEN=H, INTER=inter, TOP_K=K, NUM_EXPERTS=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **fp8_kw, **launch)
    if fp8:
        act, act_scale = quant_fp8_triton(act, group_k)
    else:
        act_scale = None
    # pairs routed off-rank (-1) are never written: start from zeros
    y = torch.zeros(n, H, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(H, bn))](
        act, w2, y, pairs, block_expert, weights, n, act.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), act_scale, w2_scale, act_scale.stride(0) if fp8 else 0, *sw2,
        HIDDEN=H, INTER=inter, NUM_EXPERTS=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **fp8_kw, **launch)
    return y.view(T, K, H).sum(1)  # accumulates in fp32 internally


@custom_op("rankserve::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block_size: list[int] | None = None
              ) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] (-1: off-rank).
    FP8 experts (float8_e4m3fn): w13_scale [E, 2I] / w2_scale [E, H] per channel, or
    [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)] with block_size [bn, bk]."""
    kw = dict(w13_scale=w13_scale, w2_scale=w2_scale, block_size=block_size)
    if x.is_cuda:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, **kw)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, **kw)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block_size=None):
    return torch.empty_like(x)
