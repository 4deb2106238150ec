"""Kernel benchmark: `python -m rankserve.kernels.benchmark [--json PATH] [--quick]` (CUDA only).

Measures two ceilings first (HBM copy bandwidth, bf16 matmul rate), then times F.linear (cuBLAS)
at Llama-8B decode sizes, the skinny decode GEMMs of gemv.py (vs cuBLAS, and their fused prologues
vs the unfused sequences), decode and prefill attention, prepare_qkv (q/k norm + RoPE + KV store)
and fused MoE at real model sizes
(32 q / 8 kv heads, head_dim 128, block 16; MoE with 128 experts top-8, H 2048, I 768), and the
quantized GEMMs of quant.py (FP8 W8A8, 4-bit weight-only, FP8 MoE) against bf16 at Llama-3.1-8B
sizes, and the Mamba2 ops of triton_mamba.py at Nemotron-H-8B layer sizes (128 heads x 64, state
128, 8 groups, conv width 4; fp32 SSM state), with triton.testing.do_bench (median), and reports
each against the ceiling that bounds it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton

from . import gemv, moe, quant, triton_attention as ta, triton_mamba as tm

H, KH, D, BLOCK = 32, 8, 128, 16
E, TOPK, HID, INTER = 128, 8, 2048, 768
DT = torch.bfloat16


def bench(fn) -> float:
    """Median milliseconds, L2 flushed between runs, launch overhead included."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float | None:
    """Median milliseconds replaying a CUDA graph (what a graph-captured server sees: no launch
    overhead, but L2 is not flushed, so small working sets read partly from cache)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # report, don't abort the table
        print(f"cuda graph timing failed: {e!r}", file=sys.stderr)
        return None


def ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6
    n = 8192
    a = torch.randn(n, n, dtype=DT, device="cuda")
    b = torch.randn(n, n, dtype=DT, device="cuda")
    tflops = 2 * n ** 3 / bench(lambda: a @ b) / 1e9
    return gbps, tflops


def attention_inputs(q_lens, seq_lens):
    B = len(seq_lens)
    nblk = [triton.cdiv(s, BLOCK) for s in seq_lens]
    max_blocks = max(nblk)
    total = sum(nblk)
    perm = torch.randperm(total, device="cuda").int()  # scattered blocks, as in a live cache
    block_table = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(nblk):
        block_table[i, :n] = perm[start:start + n]
        start += n
    k_cache = torch.randn(total, BLOCK, KH, D, dtype=DT, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), H, D, dtype=DT, device="cuda")
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return (q, k_cache, v_cache, qsl.cuda(), torch.tensor(seq_lens, dtype=torch.int32,
                                                           device="cuda"), block_table)


def row(name, shape, fn, nbytes, flops, ceil):
    ms = bench(fn)
    gbps, tflops = nbytes / ms / 1e6, flops / ms / 1e9
    frac_bw, frac_fl = gbps / ceil[0], tflops / ceil[1]
    return dict(kernel=name, shape=shape, ms=ms, graph_ms=bench_graph(fn), gbps=gbps,
                tflops=tflops, bound="memory" if frac_bw >= frac_fl else "compute",
                frac_of_ceiling=max(frac_bw, frac_fl))


def bench_decode(ceil, quick):
    rows = []
    for ctx in ([1024, 8192] if quick else [1024, 2048, 4096, 8192]):
        for B in ([1, 64, 256] if quick else [1, 4, 16, 64, 128, 256]):
            args = attention_inputs([1] * B, [ctx] * B)
            fn = lambda: ta.paged_attention(*args, D ** -0.5, is_decode=True)  # noqa: E731
            nbytes = 2 * B * ctx * KH * D * 2 + 2 * B * H * D * 2  # K+V read, q read, out write
            flops = 4 * B * ctx * H * D
            rows.append(row("decode_attention", f"B={B} ctx={ctx}", fn, nbytes, flops, ceil))
            args = None  # free the inputs before the next size
    return rows


def bench_prefill(ceil, quick):
    rows = []
    cases = [(1, 2048), (1, 8192), (8, 1024)] if quick else \
        [(1, 1024), (1, 2048), (1, 4096), (1, 8192), (8, 1024), (4, 4096)]
    for B, L in cases:
        args = attention_inputs([L] * B, [L] * B)
        fn = lambda: ta.paged_attention(*args, D ** -0.5, is_decode=False)  # noqa: E731
        flops = 4 * B * H * D * L * (L + 1) / 2  # causal: QK^T and PV over the lower triangle
        nbytes = B * L * (2 * H + 2 * KH) * D * 2  # q, out, k, v once each (lower bound)
        rows.append(row("prefill_attention", f"B={B} L={L}", fn, nbytes, flops, ceil))
    # chunked prefill: 2048 new tokens after 6144 cached, mixed with 64 decodes at 4k
    args = attention_inputs([2048] + [1] * 64, [8192] + [4096] * 64)
    fn = lambda: ta.paged_attention(*args, D ** -0.5, is_decode=False)  # noqa: E731
    flops = 4 * H * D * (2048 * (6144 + 1024.5) + 64 * 4096)
    nbytes = (8192 + 64 * 4096) * 2 * KH * D * 2
    rows.append(row("mixed_attention", "chunk 2048@8k + 64 decodes@4k", fn, nbytes, flops, ceil))
    return rows


def bench_prepare_qkv(ceil, quick):
    """q/k norm + RoPE + KV store (Qwen3 shapes: 32 q / 8 kv heads): reads qkv, writes q, k, v."""
    rows = []
    for T in ([1, 8192] if quick else [1, 64, 256, 1024, 8192]):
        qkv = torch.randn(T, (H + 2 * KH) * D, dtype=DT, device="cuda")
        pos = torch.randint(0, 4096, (T,), device="cuda")
        cos_sin = torch.randn(4096, D, device="cuda")
        qn, kn = torch.ones(D, dtype=DT, device="cuda"), torch.ones(D, dtype=DT, device="cuda")
        nb = triton.cdiv(T, BLOCK) + 1
        k_cache = torch.empty(nb, BLOCK, KH, D, dtype=DT, device="cuda")
        v_cache = torch.empty_like(k_cache)
        slots = torch.randperm(nb * BLOCK, device="cuda")[:T]
        fn = lambda: ta.prepare_qkv(qkv, pos, cos_sin, qn, kn, 1e-6, k_cache, v_cache, slots, H)  # noqa: E731
        nbytes = 2 * T * (H + 2 * KH) * D * 2 + T * (D * 4 + 16)
        rows.append(row("prepare_qkv", f"T={T}", fn, nbytes, 0, ceil))
        if T <= ta.PREPARE_SPLIT_T:  # A/B: a whole token a program, as above PREPARE_SPLIT_T
            split, ta.PREPARE_SPLIT_T = ta.PREPARE_SPLIT_T, 0
            rows.append(row("prepare_qkv", f"T={T} token/program", fn, nbytes, 0, ceil))
            ta.PREPARE_SPLIT_T = split
    return rows


def bench_moe(ceil, quick):
    rows = []
    w13 = torch.randn(E, 2 * INTER, HID, dtype=DT, device="cuda") * HID ** -0.5
    w2 = torch.randn(E, HID, INTER, dtype=DT, device="cuda") * INTER ** -0.5
    for T in ([1, 64, 4096] if quick else [1, 16, 64, 256, 1024, 4096, 16384]):
        x = torch.randn(T, HID, dtype=DT, device="cuda")
        logits = torch.randn(T, E, device="cuda")
        weights, ids = torch.topk(logits.softmax(-1), TOPK)
        ids = ids.int()
        fn = lambda: moe.fused_moe_triton(x, w13, w2, weights, ids)  # noqa: E731
        touched = int(torch.unique(ids).numel())  # experts whose weights are read
        nbytes = touched * 3 * HID * INTER * 2 + 2 * T * HID * 2
        flops = T * TOPK * 6 * HID * INTER
        rows.append(row("fused_moe", f"T={T} E={E} top{TOPK}", fn, nbytes, flops, ceil))
    return rows


# Llama-3.1-8B projections (out, in): fused qkv, o, fused gate-up, down, lm_head
LINEARS = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
           ("down", 4096, 14336), ("lm_head", 128256, 4096)]


def bench_linear(ceil, quick):
    """cuBLAS through F.linear at decode sizes: weight bandwidth is the whole story at M=1."""
    rows = []
    for M in ([1, 256] if quick else [1, 8, 64, 256]):
        for name, N, K in LINEARS:
            w = torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5
            x = torch.randn(M, K, dtype=DT, device="cuda")
            fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            rows.append(row("linear", f"{name} M={M} {N}x{K}", fn, (N * K + M * (N + K)) * 2,
                            2 * M * N * K, ceil))
            w = None
    return rows


# Llama-3.1-8B decode GEMMs (out, in) with the op fused in front of each
SKINNY = [("qkv", 6144, 4096, "add_rms_norm"), ("o_proj", 4096, 4096, None),
          ("gate_up", 28672, 4096, "add_rms_norm"), ("down", 4096, 14336, "silu_mul")]


def weight_copies(N, K):
    """Copies of a weight that together exceed 3x L2, used in turn: graph replay does not flush
    L2, and a decode step reads every layer's weights from HBM, never a cached one."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = max(1, triton.cdiv(3 * l2, N * K * 2))
    ws = [torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5 for _ in range(n)]
    return itertools.cycle(ws).__next__


def bench_skinny(ceil, quick):
    """gemv.py at decode batch sizes: cuBLAS vs skinny_linear, and each fused op vs the sequence
    it replaces, eager (one kernel per torch op) and torch.compile'd (the fused norm / silu*mul
    kernel the compiled model gets, then cuBLAS). GB/s counts the bytes that must move (weight,
    activations in and out) for every variant, so the columns compare directly."""
    rows = []
    unfused = {"add_rms_norm": gemv.ref_add_rms_norm_linear, "silu_mul": gemv.ref_silu_mul_linear}
    compiled = {k: torch.compile(f, dynamic=True) for k, f in unfused.items()}
    fused = {"add_rms_norm": gemv.add_rms_norm_linear_triton,
             "silu_mul": gemv.silu_mul_linear_triton}
    for M in ([1, 2] if quick else [1, 2, 4]):
        for name, N, K, pre in SKINNY:
            w = weight_copies(N, K)
            shape, flops = f"{name} M={M} {N}x{K}", 2 * M * N * K
            x = torch.randn(M, K, dtype=DT, device="cuda")
            nbytes = (N * K + M * (K + N)) * 2
            rows.append(row("cublas_linear", shape, lambda: torch.nn.functional.linear(x, w()),
                            nbytes, flops, ceil))
            fn = lambda: gemv.skinny_linear_triton(x, w())  # noqa: E731
            rows.append(row("skinny_linear", shape, fn, nbytes, flops, ceil))
            if pre == "add_rms_norm":
                args = (x, torch.randn_like(x), torch.rand(K, dtype=DT, device="cuda") + 0.5,
                        1e-5)
                nbytes += 2 * M * K * 2  # delta read, h_new written
            elif pre == "silu_mul":
                args = (torch.randn(M, 2 * K, dtype=DT, device="cuda"),)
                nbytes += M * K * 2  # gu is twice as wide as the GEMM input
            else:
                continue
            for kernel, fn in ((f"{pre}_linear", fused[pre]), ("unfused_eager", unfused[pre]),
                               ("unfused_compiled", compiled[pre])):
                rows.append(row(kernel, shape, lambda: fn(*args, w()), nbytes, flops, ceil))
    return rows


# ----------------------------------------------------------------------------------------------
# quantized GEMMs (quant.py): every path against bf16 cuBLAS on the same shapes
# ----------------------------------------------------------------------------------------------

QUANT_LINEARS = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                 ("down", 4096, 14336)]


def cycled(make, nbytes):
    """Enough copies of make()'s weights to exceed 3x L2, used in turn (see weight_copies)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return itertools.cycle([make() for _ in range(max(1, triton.cdiv(3 * l2, nbytes)))]).__next__


def bench_fp8(ceil, quick):
    """fp8_linear (the op, whatever path its thresholds pick) and each of its paths: the skinny
    kernel (M <= 16), the quant + tl.dot GEMM, torch._scaled_mm (per channel), per channel and
    with 128 x 128 blocks, next to bf16 F.linear. GB/s counts weights (+ scales) and activations
    in and out, so a path at the bandwidth ceiling reads the FP8 weight at ~4.8 TB/s on an H200:
    twice the bf16 rows' tokens per second."""
    rows = []
    for M in ([1, 256] if quick else [1, 2, 4, 8, 16, 64, 256]):
        for name, N, K in QUANT_LINEARS:
            shape, flops = f"{name} M={M} {N}x{K}", 2 * M * N * K
            x = torch.randn(M, K, dtype=DT, device="cuda")
            act = M * (K + N) * 2
            w = cycled(lambda: torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, N * K * 2)
            rows.append(row("bf16_linear", shape, lambda: torch.nn.functional.linear(x, w()),
                            N * K * 2 + act, flops, ceil))
            for bs in (None, [128, 128]):
                tag = "fp8_block" if bs else "fp8_chan"
                wq = cycled(lambda: quant.quant_fp8_weight(
                    torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, bs), N * K)
                nbytes = N * K + act
                out = torch.empty(M, N, dtype=DT, device="cuda")
                paths = [(tag, lambda: quant.fp8_linear(x, *wq(), None, bs)),
                         (f"{tag}_gemm", lambda: quant.fp8_gemm(x, *wq(), None, bs, out))]
                if M <= 16:
                    paths.append((f"{tag}_skinny",
                                  lambda: quant.fp8_skinny(x, *wq(), None, bs, out)))
                if quant._scaled_mm_ok(x, torch.empty(N, K, device="meta"), bs):
                    def scaled_mm(bs=bs):
                        q, s = wq()
                        xq, xs = quant.quant_fp8_triton(x)
                        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, N),
                                                out_dtype=DT)
                    paths.append((f"{tag}_scaled_mm", scaled_mm))
                for kernel, fn in paths:
                    rows.append(row(kernel, shape, fn, nbytes, flops, ceil))
            x = w = wq = None
    return rows


def bench_w4a16(ceil, quick):
    """w4a16_linear (group 128, zero points; the op and each path: skinny, tl.dot GEMM,
    dequantize + cuBLAS) next to bf16 F.linear. GB/s counts the packed weight, scales, zeros and
    activations: the ceiling is ~4x the bf16 rows' tokens per second."""
    rows = []
    G = 128
    for M in ([1, 256] if quick else [1, 2, 4, 8, 16, 64, 256, 1024]):
        for name, N, K in QUANT_LINEARS:
            shape, flops = f"{name} M={M} {N}x{K}", 2 * M * N * K
            x = torch.randn(M, K, dtype=DT, device="cuda")
            act = M * (K + N) * 2
            w = cycled(lambda: torch.randn(N, K, dtype=DT, device="cuda") * K ** -0.5, N * K * 2)
            rows.append(row("bf16_linear", shape, lambda: torch.nn.functional.linear(x, w()),
                            N * K * 2 + act, flops, ceil))

            def make():
                qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32,
                                   device="cuda")
                sc = torch.rand(K // G, N, dtype=DT, device="cuda") * 0.01
                z = torch.randint(0, 16, (K // G, N), dtype=torch.uint8, device="cuda")
                return qw, sc, z, None, G
            wq = cycled(make, N * K // 2)
            nbytes = N * K // 2 + (K // G) * N * 3 + act
            out = torch.empty(M, N, dtype=DT, device="cuda")
            paths = [("w4a16", lambda: quant.w4a16_linear(x, *wq())),
                     ("w4a16_gemm", lambda: quant.w4_gemm(x, *wq(), None, out))]
            if M <= 16:
                paths.append(("w4a16_skinny", lambda: quant.w4_skinny(x, *wq(), None, out)))
            if M >= 16:
                paths.append(("w4a16_dequant_mm",
                              lambda: x @ quant.w4_dequant_t(*wq(), dtype=DT)))
            for kernel, fn in paths:
                rows.append(row(kernel, shape, fn, nbytes, flops, ceil))
            x = w = wq = None
    return rows


def bench_moe_fp8(ceil, quick):
    """fused_moe with FP8 experts (per channel and 128 x 128 blocks) next to bf16 experts."""
    rows = []
    for bs in (None, [128, 128]):
        w13, s13 = zip(*(quant.quant_fp8_weight(
            torch.randn(2 * INTER, HID, dtype=DT, device="cuda") * HID ** -0.5, bs)
            for _ in range(E)))
        w2, s2 = zip(*(quant.quant_fp8_weight(
            torch.randn(HID, INTER, dtype=DT, device="cuda") * INTER ** -0.5, bs)
            for _ in range(E)))
        w13, w2, s13, s2 = (torch.stack(t) for t in (w13, w2, s13, s2))
        for T in ([1, 64, 4096] if quick else [1, 16, 64, 256, 1024, 4096]):
            x = torch.randn(T, HID, dtype=DT, device="cuda")
            weights, ids = torch.topk(torch.randn(T, E, device="cuda").softmax(-1), TOPK)
            ids = ids.int()
            fn = lambda: moe.fused_moe_triton(x, w13, w2, weights, ids, w13_scale=s13,  # noqa: E731
                                              w2_scale=s2, block_size=bs)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * 3 * HID * INTER + 2 * T * HID * 2
            rows.append(row("fused_moe_fp8_block" if bs else "fused_moe_fp8_chan",
                            f"T={T} E={E} top{TOPK}", fn, nbytes, T * TOPK * 6 * HID * INTER,
                            ceil))
    return rows


def bench_moe_w4a16(ceil, quick):
    """fused_moe_w4a16: 4-bit experts, group 128 (Qwen3-30B-A3B-GPTQ-Int4's format), symmetric
    and with zero points."""
    rows = []
    G = 128

    def stacked(k, n, zero):
        qw = torch.randint(-2**31, 2**31 - 1, (E, k // 8, n), dtype=torch.int32, device="cuda")
        s = torch.rand(E, k // G, n, dtype=DT, device="cuda") * 0.02
        z = torch.randint(0, 16, (E, k // G, n), dtype=torch.uint8, device="cuda") if zero else None
        return qw, s, z, None
    for zero in (False, True):
        w13, w2 = stacked(HID, 2 * INTER, zero), stacked(INTER, HID, zero)
        for T in ([1, 64, 4096] if quick else [1, 16, 64, 256, 1024, 4096]):
            x = torch.randn(T, HID, dtype=DT, device="cuda")
            weights, ids = torch.topk(torch.randn(T, E, device="cuda").softmax(-1), TOPK)
            ids = ids.int()
            fn = lambda: moe.fused_moe_w4a16_triton(x, *w13, *w2, weights, ids, G, G)  # noqa: E731
            touched = int(torch.unique(ids).numel())
            nbytes = touched * 3 * HID * INTER // 2 + 2 * T * HID * 2
            rows.append(row("fused_moe_w4a16_zp" if zero else "fused_moe_w4a16_sym",
                            f"T={T} E={E} top{TOPK}", fn, nbytes, T * TOPK * 6 * HID * INTER, ceil))
    return rows


def bench_mla(ceil, quick):
    """MLA (DeepSeek-V3 widths: latent 512 + 64, 128 heads) over a paged latent cache: decode
    (bytes: the latent of every context token once) and prefill (FLOPs of the absorbed form)."""
    from . import triton_mla
    L, R, HM = 512, 64, 128
    rows = []

    def inputs(q_lens, seq_lens):
        _, k_cache, _, qsl, lens, table = attention_inputs(q_lens, seq_lens)
        cache = torch.randn(k_cache.shape[0], BLOCK, 1, L + R, dtype=DT, device="cuda")
        q = torch.randn(sum(q_lens), HM, L + R, dtype=DT, device="cuda")
        return q, cache, qsl, lens, table
    for ctx in ([1024, 8192] if quick else [1024, 4096, 8192]):
        for B in ([1, 64, 256] if quick else [1, 16, 64, 256]):
            args = inputs([1] * B, [ctx] * B)
            fn = lambda: triton_mla.mla_attention_triton(*args, 0.1, L, is_decode=True)  # noqa: E731
            nbytes = B * ctx * (L + R) * 2 + B * HM * (2 * L + R) * 2
            flops = 2 * B * ctx * HM * (2 * L + R)
            rows.append(row("mla_decode", f"B={B} ctx={ctx}", fn, nbytes, flops, ceil))
            args = None
    for B, n in ([(1, 2048)] if quick else [(1, 1024), (1, 4096), (8, 1024)]):
        args = inputs([n] * B, [n] * B)
        fn = lambda: triton_mla.mla_attention_triton(*args, 0.1, L, is_decode=False)  # noqa: E731
        flops = 2 * B * HM * (2 * L + R) * n * (n + 1) / 2
        rows.append(row("mla_prefill", f"B={B} L={n}", fn, B * n * (L + R) * 2, flops, ceil))
        args = None


MH, MP, MN, MG, MK = 128, 64, 128, 8, 4  # Nemotron-H-8B's Mamba2 layer
MC = MH * MP + 2 * MG * MN  # conv channels (x, B, C)


def mamba_inputs(q_lens, cont: bool, device="cuda"):
    """A step of requests with `q_lens` tokens each (continuing from a saved state if `cont`),
    one state slot per request: (conv args, scan args) for triton_mamba."""
    B, T = len(q_lens), sum(q_lens)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    lens = torch.tensor(q_lens, dtype=torch.int32) + (100 if cont else 0)
    qsl, lens, idx = qsl.to(device), lens.to(device), torch.arange(B, dtype=torch.int32, device=device)
    r = lambda *shape, dt=DT: torch.randn(*shape, dtype=dt, device=device)  # noqa: E731
    conv = (r(T, MC), r(MC, MK), r(MC), r(B, MK - 1, MC), qsl, lens, idx)
    xbc = r(T, MC)
    x, Bm, Cm = xbc.split([MH * MP, MG * MN, MG * MN], -1)
    scan = (x.view(T, MH, MP), r(T, MH), r(MH), -torch.rand(MH, device=device), Bm.view(T, MG, MN),
            Cm.view(T, MG, MN), r(MH), r(B, MH, MP, MN, dt=torch.float32), qsl, lens, idx)
    return conv, scan


def bench_mamba(ceil, quick):
    """Decode (one token per request: the state read and written is the traffic) and prefill
    (B prompts of L tokens from zero states) at one Nemotron-H-8B layer's sizes."""
    rows = []
    state = MH * MP * MN * 4  # fp32 SSM state per request
    for B in ([1, 256] if quick else [1, 16, 64, 256]):
        conv, scan = mamba_inputs([1] * B, cont=True)
        rows.append(row("mamba_conv_update", f"B={B} C={MC}", lambda: tm.causal_conv1d_update(*conv),
                        B * MC * 2 * (2 * (MK - 1) + 2), 2 * B * MK * MC, ceil))
        rows.append(row("mamba_ssd_update", f"B={B} H={MH} P={MP} N={MN}",
                        lambda: tm.ssd_scan(*scan, is_decode=True), 2 * B * state, 4 * B * MH * MP * MN, ceil))
    for B, L in ([(1, 2048)] if quick else [(1, 2048), (1, 8192), (8, 1024)]):
        conv, scan = mamba_inputs([L] * B, cont=False)
        T = B * L
        rows.append(row("mamba_conv1d", f"B={B} L={L} C={MC}", lambda: tm.causal_conv1d(*conv),
                        2 * T * MC * 2, 2 * T * MK * MC, ceil))
        # per token and head: C B^T and M x over a 64-token chunk, C s and the state update
        flops = T * MH * (2 * 64 * (MN + MP) + 4 * MP * MN)
        nbytes = T * (2 * MH * MP + 2 * MG * MN + MH) * 2 + B * state
        rows.append(row("mamba_ssd_scan", f"B={B} L={L} H={MH} P={MP} N={MN}",
                        lambda: tm.ssd_scan(*scan, is_decode=False), nbytes, flops, ceil))
        conv = scan = None
    return rows


# ----------------------------------------------------------------------------------------------
# LoRA (lora.py, models/lora.py): one Llama-8B decoder layer's projections with and without
# adapters, on the decode path the runner takes (fused add + RMSNorm / SiLU-mul prologues)
# ----------------------------------------------------------------------------------------------

LORA_BS, LORA_RANK, LORA_LAYERS = (1, 16, 256), 16, 32


def lora_layer(slots: int, fold: bool):
    """Llama-3.1-8B's qkv / o / gate_up / down (attention left out: o_proj reads q), random
    weights; with `slots` rank-16 adapters in slots (A folded into the base weights or not)."""
    import torch.nn as nn

    from ..models import lora as ml
    from ..models.fused import add_norm_then
    from ..models.layers import GatedMLP, QKVParallelLinear, RMSNorm, RowParallelLinear
    from ..models.parallel import ParallelInfo

    class Attn(nn.Module):
        def __init__(self, pi):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(4096, D, H, KH, False, pi, DT)
            self.o_proj = RowParallelLinear(H * D, 4096, False, pi, DT)

        @property
        def in_proj(self):
            return self.qkv_proj

        def from_in_proj(self, qkv):
            return self.o_proj(qkv[:, :H * D])

        def forward(self, x):
            return self.from_in_proj(self.qkv_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            pi = ParallelInfo()
            self.self_attn, self.mlp = Attn(pi), GatedMLP(4096, 14336, pi, DT)
            self.input_layernorm = RMSNorm(4096, 1e-5, DT)
            self.post_attention_layernorm = RMSNorm(4096, 1e-5, DT)

        def forward(self, h, delta):
            a, h = add_norm_then(self.self_attn, h, delta, self.input_layernorm)
            return add_norm_then(self.mlp, h, a, self.post_attention_layernorm)

    with torch.device("cuda"):
        layer = Layer()
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    ctx = None
    if slots:
        ctx = ml.LoRAContext(max(LORA_BS), max(LORA_BS), "cuda")
        fold_max, ml.FOLD_MAX = ml.FOLD_MAX, ml.FOLD_MAX if fold else 0.0
        try:
            layers = ml.wrap_model(layer, ctx, slots, LORA_RANK, DT, "cuda")
        finally:
            ml.FOLD_MAX = fold_max
        assert all(m.quant.folded == fold for m in layers.values()), "fold rule"
        for m in layers.values():
            for sl in range(slots):
                ml.slot_a(m, sl).normal_(0, 0.02)
                m.lora_b[sl].normal_(0, 0.02)
    return layer, ctx


def bench_lora(ceil, quick):
    """The LoRA cost of one decoder layer's projections at decode batch sizes: the base layer
    against 1 adapter (W2) and 8 spread over the batch (W1), A folded into the base GEMM (the
    dense default) and with the separate shrink kernel (quantized bases); the graph-replay
    ratio is what a CUDA-graph step sees. Printed: per-layer overhead and x32 for a step."""
    variants = [("base", 0, True), ("lora1_folded", 1, True), ("lora8_folded", 8, True),
                ("lora1_shrink", 1, False), ("lora8_shrink", 8, False)]
    wbytes = (6144 + 4096 + 28672) * 4096 * 2 + 4096 * 14336 * 2
    rows, base_ms = [], {}
    for name, slots, fold in variants:
        layer, ctx = lora_layer(slots, fold)
        for bs in LORA_BS:
            if ctx is not None:
                ctx.token_slot[:bs].copy_(torch.arange(bs, device="cuda") % slots)
            h = torch.randn(bs, 4096, dtype=DT, device="cuda")
            delta = torch.randn_like(h)
            fn = lambda: layer(h, delta)  # noqa: E731
            with torch.inference_mode():
                fn()
                r = row(f"layer_{name}", f"bs={bs}", fn, wbytes, 2 * bs * wbytes // 2, ceil)
            rows.append(r)
            if slots == 0:
                base_ms[bs] = r
            else:
                b = base_ms[bs]
                g = (r["graph_ms"] or float("nan")) / (b["graph_ms"] or float("nan"))
                print(f"lora {name:<13} bs={bs:<4} graph {r['graph_ms'] or float('nan'):.4f} ms "
                      f"vs base {b['graph_ms'] or float('nan'):.4f} ms: x{g:.3f}, +"
                      f"{((r['graph_ms'] or 0) - (b['graph_ms'] or 0)) * 1e3:.1f} us a layer, "
                      f"+{((r['graph_ms'] or 0) - (b['graph_ms'] or 0)) * LORA_LAYERS:.3f} ms "
                      f"for {LORA_LAYERS} layers (eager x{r['ms'] / b['ms']:.3f})")
        layer = ctx = None
        torch.cuda.empty_cache()
    return rows


PARTS = {"linear": bench_linear, "skinny": bench_skinny, "decode": bench_decode,
         "prefill": bench_prefill, "prepare_qkv": bench_prepare_qkv, "moe": bench_moe,
         "fp8": bench_fp8, "w4a16": bench_w4a16, "moe_fp8": bench_moe_fp8,
         "moe_w4a16": bench_moe_w4a16, "mla": bench_mla,
         "mamba": bench_mamba, "lora": bench_lora}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--only", nargs="+", metavar="PART", choices=sorted(PARTS),
                        help="run only these parts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("rankserve.kernels.benchmark needs a CUDA GPU: torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gbps, tflops = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {gbps:.0f} GB/s, bf16 matmul {tflops:.0f} "
          f"TFLOP/s (ceilings)")
    rows = []
    for name in args.only or PARTS:
        rows += PARTS[name]((gbps, tflops), args.quick)
        torch.cuda.empty_cache()
    print(f"{'kernel':<20} {'shape':<30} {'ms':>9} {'graph ms':>9} {'GB/s':>8} {'TFLOP/s':>8}"
          "  of ceiling")
    for r in rows:
        graph = f"{r['graph_ms']:>9.4f}" if r["graph_ms"] is not None else f"{'-':>9}"
        print(f"{r['kernel']:<20} {r['shape']:<30} {r['ms']:>9.4f} {graph} {r['gbps']:>8.0f} "
              f"{r['tflops']:>8.1f}  {r['frac_of_ceiling']:>5.0%} {r['bound']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=gbps,
                           matmul_tflops=tflops, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
