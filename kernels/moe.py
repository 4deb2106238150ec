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

4-bit weight-only experts (`fused_moe_w4a16`: GPTQ / AWQ / compressed-tensors W4A16): the same two
grouped GEMMs, each [BLOCK_K, BLOCK_N] int4 tile dequantized in registers with its group's scale
and zero point (kernels/quant.py `_w4_dot`, the w4a16 GEMM's step), then tl.dot in x.dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import (FP8, _quant_act_ref, _w4_consts, _w4_dot, dequant_fp8_weight, dequant_w4,
                    quant_fp8_triton)
from .custom_op import custom_op


def _experts_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert,
                 quant_act=None) -> torch.Tensor:
    """The reference's math, in fp32: `expert(e)` gives expert e's (w13 [2I, H], w2 [H, I]) in
    fp32 (called only for the experts routed to); `quant_act` (FP8) quantizes x, and the
    silu(gate) * up activation rounded to x.dtype, as the kernels do."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = quant_act(x) if quant_act is not None else x.float()
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13e, w2e = expert(e)
        inter = w2e.shape[1]
        h = xf[tok] @ w13e.T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        if quant_act is not None:  # the kernels store the activation in x.dtype, then quantize it
            act = quant_act(act.to(x.dtype))
        y = (act @ w2e.T) * topk_weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_size: list[int] | None = None) -> torch.Tensor:
    """Plain torch, computed in fp32. FP8 experts (w13 / w2 float8_e4m3fn with their scales):
    the activations are quantized as the kernels do (x per token or per 1 x bk group; the
    silu(gate) * up activation rounded to x.dtype, then quantized the same way), the weights
    dequantized, and the products computed in fp32."""
    if w13.dtype != FP8:
        return _experts_ref(x, topk_weights, topk_ids, lambda e: (w13[e].float(), w2[e].float()))
    assert w13_scale is not None and w2_scale is not None, "fused_moe: FP8 experts need scales"
    return _experts_ref(x, topk_weights, topk_ids,
                        lambda e: (dequant_fp8_weight(w13[e], w13_scale[e], block_size),
                                   dequant_fp8_weight(w2[e], w2_scale[e], block_size)),
                        lambda t: _quant_act_ref(t, block_size))


def _pick(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if t is None else t[e]


def fused_moe_w4a16_ref(x: torch.Tensor, w13_qweight: torch.Tensor, w13_scales: torch.Tensor,
                        w13_zeros: torch.Tensor | None, w13_g_idx: torch.Tensor | None,
                        w2_qweight: torch.Tensor, w2_scales: torch.Tensor,
                        w2_zeros: torch.Tensor | None, w2_g_idx: torch.Tensor | None,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_size13: int,
                        group_size2: int) -> torch.Tensor:
    """Plain torch: each expert routed to dequantized exactly (kernels/quant.py dequant_w4),
    then fused_moe_ref's fp32 math."""
    return _experts_ref(x, topk_weights, topk_ids, lambda e: (
        dequant_w4(w13_qweight[e], w13_scales[e], _pick(w13_zeros, e), _pick(w13_g_idx, e), group_size13),
        dequant_w4(w2_qweight[e], w2_scales[e], _pick(w2_zeros, e), _pick(w2_g_idx, e), group_size2)))


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
                        GROUP_N: tl.constexpr = 1, GROUP_K: tl.constexpr = 0,
                        wz_ptr=None, wg_ptr=None, stride_wge=0, W4: tl.constexpr = False,
                        HAS_ZERO: tl.constexpr = False, HAS_GIDX: tl.constexpr = False,
                        CHUNK_GROUP: tl.constexpr = False, DOT_IEEE: tl.constexpr = False):
    # act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, INTER + n]) for one row block.
    # FP8: x is the quantized activation (scales xs [T, 1] or [T, ceil(H / GROUP_K)]), w13 FP8
    # with scales ws [E, 2I] or [E, ceil(2I / GROUP_N), ceil(H / GROUP_K)]; block scales are
    # applied per K block (BLOCK_K divides GROUP_K), per-channel ones after the loop.
    # W4 (w4a16): w13 is qweight int32 [E, H / 8, 2I] (kernels/quant.py's layout per expert),
    # scales ws / zeros wz [E, G, 2I] (group GROUP_K), g_idx wg [E, H]; each tile dequantized
    # in registers by quant.py's _w4_dot.
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
    if W4:
        offs_i = tl.arange(0, BLOCK_K // 8)
        q_ptrs = w_ptr + e * stride_we + offs_i[:, None] * (2 * INTER) + offs_n[None, :]
        ws_e, wz_e, wg_e = ws_ptr + e * stride_wse, wz_ptr + e * stride_wse, wg_ptr + e * stride_wge
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_mask = offs_k < HIDDEN - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if W4:
            p_mask = (offs_i < (HIDDEN - k0) // 8)[:, None] & n_mask[None, :]
            pg = tl.load(q_ptrs + (k0 // 8) * (2 * INTER), mask=p_mask, other=0)
            pu = tl.load(q_ptrs + (k0 // 8) * (2 * INTER) + INTER, mask=p_mask, other=0)
            acc_g = _w4_dot(acc_g, a, pg, ws_e, wz_e, wg_e, k0, HIDDEN, 2 * INTER, offs_n, n_mask,
                            GROUP_K, HAS_ZERO, HAS_GIDX, CHUNK_GROUP, DOT_IEEE, BLOCK_K, BLOCK_N)
            acc_u = _w4_dot(acc_u, a, pu, ws_e, wz_e, wg_e, k0, HIDDEN, 2 * INTER, INTER + offs_n,
                            n_mask, GROUP_K, HAS_ZERO, HAS_GIDX, CHUNK_GROUP, DOT_IEEE, BLOCK_K,
                            BLOCK_N)
        elif FP8 and GROUP_K > 0:
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
                     GROUP_K: tl.constexpr = 0, wz_ptr=None, wg_ptr=None, stride_wge=0,
                     W4: tl.constexpr = False, HAS_ZERO: tl.constexpr = False,
                     HAS_GIDX: tl.constexpr = False, CHUNK_GROUP: tl.constexpr = False,
                     DOT_IEEE: tl.constexpr = False):
    # out[pair, n] = weight[pair] * act[pair] . w2[e, n]  (FP8: as in the gate-up kernel, the
    # activation quantized per pair row, or per row and 1 x GROUP_K group; W4: w2 is qweight
    # int32 [E, I / 8, H], scales / zeros [E, G, H], g_idx [E, I], as in the gate-up kernel)
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
    if W4:
        offs_i = tl.arange(0, BLOCK_K // 8)
        q_ptrs = w_ptr + e * stride_we + offs_i[:, None] * HIDDEN + offs_n[None, :]
    for k0 in range(0, INTER, BLOCK_K):
        k_mask = offs_k < INTER - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if W4:
            p = tl.load(q_ptrs + (k0 // 8) * HIDDEN,
                        mask=(offs_i < (INTER - k0) // 8)[:, None] & n_mask[None, :], other=0)
            acc = _w4_dot(acc, a, p, ws_ptr + e * stride_wse, wz_ptr + e * stride_wse,
                          wg_ptr + e * stride_wge, k0, INTER, HIDDEN, offs_n, n_mask, GROUP_K,
                          HAS_ZERO, HAS_GIDX, CHUNK_GROUP, DOT_IEEE, BLOCK_K, BLOCK_N)
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8 and GROUP_K > 0:
                sa, sw = _fp8_scales(as_ptr, pair64, row_mask, ws_ptr + e * stride_wse, offs_n, n_mask, k0,
                                     stride_ast, stride_wsn, GROUP_N, GROUP_K)
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


def _w4_kernel_args(qweight, scales, zeros, g_idx, group_size, block_k, dtype) -> dict:
    """The W4 keyword arguments of the fused-MoE kernels for one stacked 4-bit weight (absent
    zeros / g_idx: the scales stand in as pointers never read)."""
    return dict(wz_ptr=zeros if zeros is not None else scales,
                wg_ptr=g_idx if g_idx is not None else scales,
                stride_wge=g_idx.stride(0) if g_idx is not None else 0, W4=True, GROUP_K=group_size,
                DOT_IEEE=dtype == torch.float32, **_w4_consts(zeros, g_idx, group_size, block_k))


def fused_moe_w4a16_triton(x: torch.Tensor, w13_qweight: torch.Tensor, w13_scales: torch.Tensor,
                           w13_zeros: torch.Tensor | None, w13_g_idx: torch.Tensor | None,
                           w2_qweight: torch.Tensor, w2_scales: torch.Tensor,
                           w2_zeros: torch.Tensor | None, w2_g_idx: torch.Tensor | None,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_size13: int,
                           group_size2: int) -> torch.Tensor:
    T, H = x.shape
    E, hp, two_i = w13_qweight.shape
    inter = two_i // 2
    K = topk_ids.shape[1]
    assert w13_qweight.dtype == w2_qweight.dtype == torch.int32, "fused_moe_w4a16: qweight must be int32"
    assert hp * 8 == H and w2_qweight.shape == (E, inter // 8, H) and inter % 8 == 0, \
        "fused_moe_w4a16: weight shapes mismatch"
    for s_, z_ in ((w13_scales, w13_zeros), (w2_scales, w2_zeros)):
        assert z_ is None or z_.shape == s_.shape, "fused_moe_w4a16: zeros must be shaped as scales"
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    x = x.contiguous()
    w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros = map(
        c, (w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros))
    w13_g_idx = None if w13_g_idx is None else w13_g_idx.to(torch.int32).contiguous()
    w2_g_idx = None if w2_g_idx is None else w2_g_idx.to(torch.int32).contiguous()
    n = T * K
    if n == 0:
        return torch.zeros_like(x)
    cfg = _moe_config(n, x.is_cuda)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {k: v for k, v in cfg.items() if k.startswith("num_")}
    pairs, block_expert = moe_align(topk_ids, E, bm)
    num_blocks = block_expert.shape[0]
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w13_qweight, act, pairs, block_expert, n, x.stride(0), w13_qweight.stride(0), 0,
        act.stride(0), None, w13_scales, 0, w13_scales.stride(0), 0,
        HIDDEN=H, INTER=inter, TOP_K=K, NUM_EXPERTS=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **_w4_kernel_args(w13_qweight, w13_scales, w13_zeros, w13_g_idx, group_size13, bk, x.dtype),
        **launch)
    y = torch.zeros(n, H, dtype=x.dtype, device=x.device)  # pairs routed off-rank: never written
    _moe_down_kernel[(num_blocks, triton.cdiv(H, bn))](
        act, w2_qweight, y, pairs, block_expert, weights, n, act.stride(0), w2_qweight.stride(0), 0,
        y.stride(0), None, w2_scales, 0, w2_scales.stride(0), 0,
        HIDDEN=H, INTER=inter, NUM_EXPERTS=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **_w4_kernel_args(w2_qweight, w2_scales, w2_zeros, w2_g_idx, group_size2, bk, x.dtype),
        **launch)
    return y.view(T, K, H).sum(1)


@custom_op("rankserve::fused_moe_w4a16", mutates_args=())
def fused_moe_w4a16(x: torch.Tensor, w13_qweight: torch.Tensor, w13_scales: torch.Tensor,
                    w13_zeros: torch.Tensor | None, w13_g_idx: torch.Tensor | None,
                    w2_qweight: torch.Tensor, w2_scales: torch.Tensor, w2_zeros: torch.Tensor | None,
                    w2_g_idx: torch.Tensor | None, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, group_size13: int, group_size2: int) -> torch.Tensor:
    """4-bit weight-only experts (GPTQ / AWQ / compressed-tensors W4A16, repacked at load time to
    kernels/quant.py's layout per expert): x [T, H]; w13_qweight int32 [E, H/8, 2I] (gate
    columns [:I], up [I:]), w13_scales [E, G13, 2I] in x.dtype, w13_zeros uint8 like them or
    None (symmetric: 8), w13_g_idx int32 [E, H] or None (k // group_size13); w2 likewise
    [E, I/8, H], [E, G2, H], g_idx [E, I]; topk as fused_moe."""
    args = (x, w13_qweight, w13_scales, w13_zeros, w13_g_idx, w2_qweight, w2_scales, w2_zeros,
            w2_g_idx, topk_weights, topk_ids, group_size13, group_size2)
    if x.is_cuda:
        return fused_moe_w4a16_triton(*args)
    return fused_moe_w4a16_ref(*args)


@fused_moe_w4a16.register_fake
def _(x, *args):
    return torch.empty_like(x)


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
