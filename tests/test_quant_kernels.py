"""Quantized GEMMs (kernels/quant.py; FP8 experts in kernels/moe.py) vs their plain-torch
references.

CPU: the Triton kernels run in Triton's interpreter in one spawned worker (the `interp` fixture
of conftest.py: TRITON_INTERPRET must be set before triton is imported). Rounding: the
interpreter's own fp32 -> fp8 cast rounds ties away from zero and flushes subnormals, so under the
interpreter the kernels round onto the e4m3 grid themselves (RNE, kernels/quant.py `_rne_e4m3`;
the GPU uses the hardware's RNE cast): the quantized activations and their scales are checked
bit for bit against torch. GEMM outputs differ from the references only by summation order and
where the scales are applied: fp32 to 1e-5 of the output norm, fp16 to 2e-3 (one output
rounding; dequantized fp16 w4 tiles with g_idx / small groups add one more), bf16 to 2e-2 (the
interpreter truncates fp32 -> bf16). The interpreter's bf16 tl.dot is wrong (numpy has no bf16),
so the w4a16 tl.dot GEMM runs in fp32 / fp16 here and in bf16 on the GPU only (the FP8 GEMMs'
tl.dot takes FP8 operands whatever x's dtype).
GPU (`-m gpu`): bf16 at Llama-3.1-8B sizes vs the references, FP8 MoE at Qwen3-30B-A3B sizes,
CUDA-graph capture of fp8_linear and w4a16_linear.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rankserve.kernels import moe, quant as Q

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def close(out, ref, dtype):
    err = (out.float() - ref.float()).norm().item()
    tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
    assert err <= tol * ref.float().norm().item() + 1e-6, (err, ref.float().norm().item())


def same_fp8(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# activation quantization (interpreter) and the torch-side helpers
# ----------------------------------------------------------------------------------------------

def quant_case():
    assert Q._INTERPRET, "the kernels would compare the reference with itself"
    g = torch.Generator().manual_seed(0)
    for M, K, group, dtype in [(3, 200, 0, F32), (17, 1000, 0, BF16), (5, 256, 64, F32),
                               (2, 100, 32, F16), (4, 384, 128, BF16)]:
        # magnitudes over 6 decades: fp8 subnormals, ties, saturation at the row maximum
        x = (torch.randn(M, K, generator=g) * torch.logspace(-4, 2, K)[torch.randperm(K)]).to(dtype)
        x[-1] = 0  # an all-zero row: floor scale, q = 0
        q, s = Q.quant_fp8_triton(x, group)
        rq, rs = Q.quant_fp8_per_group_ref(x, group) if group else Q.quant_fp8_per_token_ref(x)
        assert same_fp8(q, rq) and torch.equal(s, rs), (M, K, group, dtype)
        if not group:  # the public entry points take the kernel here too
            assert same_fp8(Q.quant_fp8_per_token(x)[0], rq)
    # every tie between fp8 neighbours (and beyond +-448) rounds to even, like torch's cast
    grid = torch.arange(256, dtype=torch.uint8).view(Q.FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = torch.cat([(grid[1:] + grid[:-1]) / 2, torch.tensor([448.0, 460.0])])
    x = torch.cat([mids, -mids]).view(1, -1) * (448.0 / 460.0)  # row amax 460 -> scale 460/448
    q, s = Q.quant_fp8_triton(x)
    assert same_fp8(q, Q.quant_fp8_per_token_ref(x)[0])


def test_quant_matches_torch_bitwise(interp):
    interp(quant_case)


def test_quant_ref_semantics():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g) * 3
    q, s = Q.quant_fp8_per_token(x)
    assert q.dtype == Q.FP8 and s.shape == (4, 1) and s.dtype == F32
    assert torch.equal(s, x.abs().amax(1, keepdim=True) / Q.FP8_MAX)
    assert torch.equal(q.float().abs().amax(1), torch.full((4,), Q.FP8_MAX))  # amax -> 448
    assert ((q.float() * s - x).abs() <= x.abs() * 2 ** -4 + s * 2 ** -9).all()  # half an ulp
    q, s = Q.quant_fp8_per_group(x, 128)
    assert s.shape == (4, 2)
    assert torch.equal(s, x.view(4, 2, 128).abs().amax(2) / Q.FP8_MAX)


@pytest.mark.parametrize("block_size", [None, [128, 128], [48, 32]])
def test_quant_fp8_weight_roundtrip(block_size):
    g = torch.Generator().manual_seed(1)
    N, K = 100, 200  # ragged against the blocks
    w = torch.randn(N, K, generator=g).to(BF16)
    q, s = Q.quant_fp8_weight(w, block_size)
    assert q.shape == (N, K) and q.dtype == Q.FP8 and s.dtype == F32
    if block_size is None:
        assert s.shape == (N,)
    else:
        assert s.shape == (-(-N // block_size[0]), -(-K // block_size[1]))
    deq = Q.dequant_fp8_weight(q, s, block_size)
    assert (deq - w.float()).norm() < 0.03 * w.float().norm()
    # each scale's block maximum maps to +-448 exactly
    bn, bk = block_size or (1, K)
    full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K] if block_size else s[:, None]
    assert torch.allclose((w.float().abs() / full).amax(), torch.tensor(Q.FP8_MAX))


def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=g)
    packed = Q.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(Q.unpack_int4(packed), q.to(torch.uint8))
    # nibble j of qweight[i, n] is row 8i + j
    v = int(packed[1, 3]) & 0xFFFFFFFF
    assert [(v >> 4 * j) & 0xF for j in range(8)] == q[8:16, 3].tolist()
    assert torch.equal(Q.pack_int4(torch.full((8, 1), 15)), torch.tensor([[-1]], dtype=torch.int32))


def test_dequant_w4_formula():
    g = torch.Generator().manual_seed(2)
    K, N, group = 64, 8, 16
    q = torch.randint(0, 16, (K, N), generator=g)
    scales = torch.rand(K // group, N, generator=g).to(F16)
    zeros = torch.randint(0, 16, (K // group, N), generator=g).to(torch.uint8)
    g_idx = (torch.randperm(K, generator=g) // group).int()
    packed = Q.pack_int4(q)
    for z, gi in [(None, None), (zeros, None), (zeros, g_idx)]:
        W = Q.dequant_w4(packed, scales, z, gi, group)
        assert W.shape == (N, K) and W.dtype == F32
        for n, k in [(0, 0), (3, 17), (7, 63)]:
            grp = int(gi[k]) if gi is not None else k // group
            zero = int(z[grp, n]) if z is not None else 8
            assert W[n, k] == (int(q[k, n]) - zero) * scales[grp, n].float()


# ----------------------------------------------------------------------------------------------
# fp8_linear (interpreter)
# ----------------------------------------------------------------------------------------------

def make_fp8(M, N, K, dtype, block_size, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device)
    q, s = Q.quant_fp8_weight(w, block_size)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, q, s, b


def fp8_case(M, N, K, dtype, block_size, bias):
    assert Q._INTERPRET
    Q.FP8_SKINNY_M = 4  # the multi-row skinny kernel too (this worker only)
    x, q, s, b = make_fp8(M, N, K, dtype, block_size, bias, seed=M * 1000 + N + K)
    ref = Q.fp8_linear_ref(x, q, s, b, block_size)
    close(Q.fp8_linear(x, q, s, b, block_size), ref, dtype)  # the op: skinny (M <= 4) or GEMM
    out = torch.empty(M, N, dtype=dtype)
    close(Q.fp8_gemm(x, q, s, b, block_size, out, split=3), ref, dtype)  # split-K partials
    if M <= 16:
        close(Q.fp8_skinny(x, q, s, b, block_size, torch.empty(M, N, dtype=dtype)), ref, dtype)


# (M, N, K): ragged against the interpreter's tiles (skinny BLOCK_N 16 / BLOCK_K 32, GEMM
# 16 x 32 x 32) and, where the format allows, against the weight blocks
@pytest.mark.parametrize("M,N,K,dtype,block_size,bias", [
    (1, 72, 200, F32, None, True), (3, 40, 136, F16, None, False), (17, 24, 100, BF16, None, True),
    (64, 40, 96, F32, None, False),
    (1, 72, 200, F32, [32, 64], False), (3, 100, 160, F16, [48, 32], True),
    (17, 40, 128, F32, [16, 64], True), (64, 24, 96, BF16, [16, 32], False)])
def test_fp8_linear_matches_reference(interp, M, N, K, dtype, block_size, bias):
    interp(fp8_case, M, N, K, dtype, block_size, bias)


def fp8_shapes_case():
    x, q, s, b = make_fp8(6, 40, 64, F32, None, True, seed=7)
    x3 = x.view(2, 3, 64)
    y = Q.fp8_linear(x3, q, s, b)
    assert y.shape == (2, 3, 40)
    close(y, Q.fp8_linear_ref(x3, q, s, b), F32)
    wide = torch.randn(6, 128)
    wide[:, 32:96] = x
    xs = wide[:, 32:96]  # row stride 128: a strided view, like q out of qkv
    close(Q.fp8_linear(xs, q, s, b), Q.fp8_linear_ref(xs, q, s, b), F32)
    xt = torch.randn(64, 5).t()  # unit stride along M: copied
    close(Q.fp8_linear(xt, q, s, None), Q.fp8_linear_ref(xt, q, s, None), F32)
    assert Q.fp8_linear(x[:0], q, s, b).shape == (0, 40)
    qb, sb = Q.quant_fp8_weight(torch.randn(40, 64), [32, 32])
    assert Q.fp8_linear(x[:0], qb, sb, None, [32, 32]).shape == (0, 40)


def test_fp8_linear_shapes(interp):
    interp(fp8_shapes_case)


# ----------------------------------------------------------------------------------------------
# w4a16_linear (interpreter)
# ----------------------------------------------------------------------------------------------

def make_w4(M, K, N, group, zero, act_order, dtype, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    groups = -(-K // group)
    q = torch.randint(0, 16, (K, N), generator=g)
    scales = (torch.rand(groups, N, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (groups, N), generator=g).to(torch.uint8) if zero else None
    g_idx = (torch.randperm(K, generator=g) // group).int() if act_order else None
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    t = (x, Q.pack_int4(q), scales, zeros, g_idx, group, b)
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in t)


def w4_case(M, K, N, group, zero, act_order, dtype, bias):
    assert Q._INTERPRET
    args = make_w4(M, K, N, group, zero, act_order, dtype, bias, seed=M * 100 + K + N)
    x, qw, sc, z, gi, gs, b = args
    ref = Q.w4a16_linear_ref(*args)
    if M == 1 or dtype != BF16:
        close(Q.w4a16_linear(*args), ref, dtype)  # the op: skinny at M = 1, else the GEMM
    Q.W4_DEQUANT_M = 2  # the dequantize + matmul path from 2 rows (this worker only)
    close(Q.w4a16_linear(*args), ref, dtype)  # M >= 2: dequantize + matmul
    Q.W4_DEQUANT_M = 1024
    if dtype != BF16:  # the interpreter's bf16 tl.dot is broken (numpy has no bf16): GPU only
        close(Q.w4_gemm(x, qw, sc, z, gi, gs, b, torch.empty(M, N, dtype=dtype), split=2), ref,
              dtype)
    if M <= 4:
        close(Q.w4_skinny(x, qw, sc, z, gi, gs, b, torch.empty(M, N, dtype=dtype), split=2), ref,
              dtype)
    assert torch.equal(Q.w4_dequant_t(qw, sc, z, gi, gs, F32),
                       Q.dequant_w4(qw, sc, z, gi, gs).T)


@pytest.mark.parametrize("M,K,N,group,zero,act_order,dtype,bias", [
    (1, 256, 40, 64, False, False, F32, True),    # symmetric, one group a skinny step
    (3, 192, 24, 32, True, False, F16, False),    # zero points, several groups a GEMM step
    (17, 128, 72, 16, True, False, F32, True),    # groups smaller than every step
    (1, 256, 40, 64, True, True, F16, False),     # GPTQ act-order (g_idx)
    (64, 256, 24, 128, False, True, F32, False),  # g_idx, symmetric
    (3, 128, 40, 128, True, False, BF16, True)])  # bf16: skinny and dequant paths
def test_w4a16_linear_matches_reference(interp, M, K, N, group, zero, act_order, dtype, bias):
    interp(w4_case, M, K, N, group, zero, act_order, dtype, bias)


def w4_shapes_case():
    x, qw, sc, z, gi, gs, b = make_w4(6, 64, 24, 32, True, False, F32, True, seed=5)
    x3 = x.view(3, 2, 64)
    y = Q.w4a16_linear(x3, qw, sc, z, gi, gs, b)
    assert y.shape == (3, 2, 24)
    close(y, Q.w4a16_linear_ref(x3, qw, sc, z, gi, gs, b), F32)
    wide = torch.randn(6, 100)
    wide[:, 10:74] = x
    xs = wide[:, 10:74]
    close(Q.w4a16_linear(xs, qw, sc, z, gi, gs, b), Q.w4a16_linear_ref(xs, qw, sc, z, gi, gs, b),
          F32)
    close(Q.w4a16_linear(xs[:1], qw, sc, None, gi, gs, None),
          Q.w4a16_linear_ref(xs[:1], qw, sc, None, gi, gs, None), F32)
    assert Q.w4a16_linear(x[:0], qw, sc, z, gi, gs, b).shape == (0, 24)


def test_w4a16_linear_shapes(interp):
    interp(w4_shapes_case)


# ----------------------------------------------------------------------------------------------
# FP8 fused MoE (interpreter)
# ----------------------------------------------------------------------------------------------

def make_moe_fp8(T, E, K, H, inter, block_size, *, drop=0.0, dtype=F32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, inter, generator=g) * inter ** -0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[torch.rand(ids.shape, generator=g) < drop] = -1  # experts on other ranks
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    q13, s13 = zip(*(Q.quant_fp8_weight(w, block_size) for w in w13))
    q2, s2 = zip(*(Q.quant_fp8_weight(w, block_size) for w in w2))
    args = (x.to(dtype), torch.stack(q13), torch.stack(q2), weights, ids.to(torch.int32))
    kw = dict(w13_scale=torch.stack(s13), w2_scale=torch.stack(s2), block_size=block_size)
    args = tuple(a.to(device) for a in args)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return args, kw, (w13.to(dtype).to(device), w2.to(dtype).to(device))


def moe_fp8_case(T, E, K, H, inter, block_size, drop, dtype):
    args, kw, _ = make_moe_fp8(T, E, K, H, inter, block_size, drop=drop, dtype=dtype, seed=T)
    close(moe.fused_moe_triton(*args, **kw), moe.fused_moe_ref(*args, **kw), dtype)
    off = (*args[:4], torch.full_like(args[4], -1))  # every expert on another rank
    assert torch.equal(moe.fused_moe_triton(*off, **kw), torch.zeros_like(args[0]))


@pytest.mark.parametrize("T,E,K,H,inter,block_size,drop,dtype", [
    (1, 4, 2, 64, 32, None, 0.0, F32), (19, 8, 2, 64, 48, None, 0.3, F16),
    (1, 4, 2, 64, 32, [32, 32], 0.0, F16), (19, 8, 2, 96, 40, [16, 64], 0.3, F32)])
def test_fused_moe_fp8_matches_ref(interp, T, E, K, H, inter, block_size, drop, dtype):
    interp(moe_fp8_case, T, E, K, H, inter, block_size, drop, dtype)


def test_fused_moe_fp8_ref_close_to_bf16():
    args, kw, (w13, w2) = make_moe_fp8(7, 4, 2, 64, 32, [16, 32], drop=0.3, seed=4)
    out = torch.ops.rankserve.fused_moe(*args, **kw)  # CPU: the reference
    assert torch.equal(out, moe.fused_moe_ref(*args, **kw))
    bf = moe.fused_moe_ref(args[0], w13, w2, *args[3:])
    assert (out - bf).norm() < 0.1 * bf.norm()
    with FakeTensorMode() as mode:
        fake = torch.ops.rankserve.fused_moe(
            *(mode.from_tensor(a) for a in args),
            **{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert fake.shape == args[0].shape


# ----------------------------------------------------------------------------------------------
# 4-bit (w4a16) fused MoE (interpreter)
# ----------------------------------------------------------------------------------------------

def make_moe_w4(T, E, K, H, inter, group, zero, act_order, *, drop=0.0, dtype=F32, device="cpu",
                seed=0):
    """Random experts in the layout models/moe.py loads them into: w13 qweight [E, H/8, 2I]
    (gate columns, then up), w2 [E, I/8, H]; group -1: one group along all of K."""
    g = torch.Generator().manual_seed(seed)

    def stacked(k, n):  # E experts of a [k, n] (K x N) 4-bit weight
        gs = k if group < 0 else group
        groups = -(-k // gs)
        q = torch.randint(0, 16, (E, k, n), generator=g, dtype=torch.uint8)
        scales = (torch.rand(E, groups, n, generator=g) * 2 / (k ** 0.5 * 8)).to(dtype)
        zeros = torch.randint(0, 16, (E, groups, n), generator=g).to(torch.uint8) if zero else None
        g_idx = torch.stack([(torch.randperm(k, generator=g) // gs).int() for _ in range(E)]) \
            if act_order else None
        return torch.stack([Q.pack_int4(w) for w in q]), scales, zeros, g_idx, gs

    q13, s13, z13, g13, gs13 = stacked(H, 2 * inter)
    q2, s2, z2, g2, gs2 = stacked(inter, H)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[torch.rand(ids.shape, generator=g) < drop] = -1  # experts on other ranks
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype)
    args = (x, q13, s13, z13, g13, q2, s2, z2, g2, weights, ids.to(torch.int32), gs13, gs2)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def moe_w4_case(T, E, K, H, inter, group, zero, act_order, drop, dtype):
    assert Q._INTERPRET
    args = make_moe_w4(T, E, K, H, inter, group, zero, act_order, drop=drop, dtype=dtype, seed=T)
    ref = moe.fused_moe_w4a16_ref(*args)
    close(moe.fused_moe_w4a16_triton(*args), ref, dtype)
    # the reference is fused_moe_ref on the dequantized experts (to summation order: a
    # transposed operand takes another BLAS path)
    x, q13, s13, z13, g13, q2, s2, z2, g2, w, ids, gs13, gs2 = args
    deq = lambda q, s, z, gi, gs: torch.stack([Q.dequant_w4(  # noqa: E731
        q[e], s[e], None if z is None else z[e], None if gi is None else gi[e], gs) for e in range(E)])
    close(ref, moe.fused_moe_ref(x, deq(q13, s13, z13, g13, gs13), deq(q2, s2, z2, g2, gs2), w, ids), F32)
    off = (*args[:10], torch.full_like(ids, -1), gs13, gs2)  # every expert on another rank
    assert torch.equal(moe.fused_moe_w4a16_triton(*off), torch.zeros_like(x))


# (H, inter) ragged against the interpreter's tiles (BLOCK_N 32, BLOCK_K 32); groups of one K
# block (128: the scale on the dot's result), smaller than one (16: dequantized tiles), g_idx
@pytest.mark.parametrize("T,E,K,H,inter,group,zero,act_order,drop,dtype", [
    (1, 4, 2, 64, 32, 32, False, False, 0.0, F32),    # symmetric (GPTQ sym), decode
    (19, 8, 2, 128, 48, 16, True, False, 0.3, F16),   # zero points (AWQ, GPTQ asym), EP drops
    (7, 4, 3, 256, 128, 128, True, False, 0.0, F16),  # Qwen3-30B-A3B-GPTQ-Int4's group 128
    (5, 4, 2, 96, 40, 8, True, True, 0.2, F32),       # act-order g_idx
    (9, 6, 2, 64, 24, -1, False, False, 0.0, F16),    # per channel (group -1)
    (1, 4, 4, 96, 40, 32, True, False, 0.0, F32),     # one token to every expert (top-k = E)
    (40, 2, 1, 96, 72, 64, False, False, 0.0, F16),   # top-1: row blocks of one expert in a row
    (3, 8, 1, 64, 96, 32, True, False, 0.0, F32),     # experts no token routes to
    (33, 3, 3, 128, 24, 64, True, False, 0.5, F16)])  # group 64 > I 24: down_proj's one partial group
def test_fused_moe_w4a16_matches_ref(interp, T, E, K, H, inter, group, zero, act_order, drop, dtype):
    interp(moe_w4_case, T, E, K, H, inter, group, zero, act_order, drop, dtype)


def test_fused_moe_w4a16_op_cpu_is_reference_and_fake():
    args = make_moe_w4(6, 4, 2, 64, 32, 32, True, False, drop=0.25, seed=5)
    out = torch.ops.rankserve.fused_moe_w4a16(*args)
    assert torch.equal(out, moe.fused_moe_w4a16_ref(*args))
    with FakeTensorMode() as mode:
        fake = torch.ops.rankserve.fused_moe_w4a16(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == args[0].shape


# ----------------------------------------------------------------------------------------------
# ops on CPU without the interpreter: references, fake impls, torch.compile
# ----------------------------------------------------------------------------------------------

def test_ops_cpu_are_reference_and_fake():
    x, q, s, b = make_fp8(5, 24, 64, F32, [16, 32], True, seed=3)
    y = Q.fp8_linear(x, q, s, b, [16, 32])
    assert torch.equal(y, Q.fp8_linear_ref(x, q, s, b, [16, 32]))
    w4 = make_w4(5, 64, 24, 32, True, True, F32, True, seed=3)
    assert torch.equal(Q.w4a16_linear(*w4), Q.w4a16_linear_ref(*w4))
    with FakeTensorMode() as mode:
        f = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        y1 = Q.fp8_linear(f(x).view(1, 5, 64), f(q), f(s), f(b), [16, 32])
        y2 = Q.w4a16_linear(*(f(t) for t in w4))
    assert y1.shape == (1, 5, 24) and y2.shape == (5, 24)


def test_compile_fullgraph():
    x, q, s, b = make_fp8(5, 24, 64, F32, None, True, seed=3)
    w4 = make_w4(5, 64, 24, 32, True, False, F32, False, seed=3)

    def f(x):
        h = Q.fp8_linear(x, q, s, b)
        return Q.w4a16_linear(torch.cat([h, h, h[:, :16]], 1), *w4[1:])

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for M in (5, 3):
        torch.testing.assert_close(compiled(x[:M]), f(x[:M]))


# ----------------------------------------------------------------------------------------------
# GPU (run on the H200 with `pytest -m gpu`)
# ----------------------------------------------------------------------------------------------

def gpu_close(out, ref, tol=1e-2):
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= tol, f"relative error {err:.4f} > {tol}"


LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 4, 16, 64, 256])
@pytest.mark.parametrize("N,K", LLAMA)
@pytest.mark.parametrize("block_size", [None, [128, 128]])
def test_gpu_fp8_linear_bf16(M, N, K, block_size):
    x, q, s, b = make_fp8(M, N, K, BF16, block_size, N == 6144, seed=M, device="cuda")
    ref = Q.fp8_linear_ref(x, q, s, b, block_size)
    gpu_close(Q.fp8_linear(x, q, s, b, block_size), ref)
    if M <= 16:  # each path, whatever the thresholds
        gpu_close(Q.fp8_skinny(x, q, s, b, block_size, torch.empty_like(ref)), ref)
    gpu_close(Q.fp8_gemm(x, q, s, b, block_size, torch.empty_like(ref)), ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 16, 256, 1024])
@pytest.mark.parametrize("N,K", LLAMA)
@pytest.mark.parametrize("zero,act_order", [(False, False), (True, False), (True, True)])
def test_gpu_w4a16_linear_bf16(M, N, K, zero, act_order):
    args = make_w4(M, K, N, 128, zero, act_order, BF16, N == 6144, seed=M, device="cuda")
    ref = Q.w4a16_linear_ref(*args)
    gpu_close(Q.w4a16_linear(*args), ref)
    x, qw, sc, z, gi, gs, b = args
    if M <= 16:
        gpu_close(Q.w4_skinny(x, qw, sc, z, gi, gs, b, torch.empty_like(ref)), ref)
    gpu_close(Q.w4_gemm(x, qw, sc, z, gi, gs, b, torch.empty_like(ref)), ref)


@gpu
@needs_cuda
def test_gpu_quant_matches_torch():
    x = torch.randn(300, 4096, device="cuda", dtype=BF16) * 3
    for group in (0, 128):
        q, s = Q.quant_fp8_triton(x, group)
        rq, rs = Q.quant_fp8_per_group_ref(x, group) if group else Q.quant_fp8_per_token_ref(x)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)  # torch divides by a scalar by
        assert (q.float() != rq.float()).float().mean() < 1e-3  # multiplying by its reciprocal


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 1024])
@pytest.mark.parametrize("block_size", [None, [128, 128]])
def test_gpu_fused_moe_fp8(T, block_size):
    """Each GEMM against fp32 math on the kernel's own inputs within 1e-2; the whole output
    against the reference within 2.5e-2: the reference requantizes its own activation, and an
    activation a bf16 rounding apart moves some values an fp8 step (6-12 %). Block scales on
    an H100: every tile config 1.6 % end to end, each GEMM within 0.6 %
    (benchmarks/2026-12-05-s18)."""
    args, kw, _ = make_moe_fp8(T, 128, 8, 2048, 768, block_size, drop=0.2, dtype=BF16,
                               device="cuda", seed=T)
    gpu_close(torch.ops.rankserve.fused_moe(*args, **kw), moe.fused_moe_ref(*args, **kw), 2.5e-2)
    act_err, down_err = moe_fp8_stage_errors(args, kw)
    assert act_err <= 1e-2 and down_err <= 1e-2, (act_err, down_err)


def moe_fp8_stage_errors(args, kw) -> tuple[float, float]:
    """(the FP8 MoE kernel's gate-up activation against fp32 math on the same quantized x, its
    output against fp32 math on its own activation): relative errors."""
    from rankserve.kernels.quant import _quant_act_ref
    seen = []
    real = moe.quant_fp8_triton

    def spy(t, g):
        seen.append(t.clone())
        return real(t, g)
    moe.quant_fp8_triton = spy
    try:
        out = moe.fused_moe_triton(*args, **kw)
    finally:
        moe.quant_fp8_triton = real
    x, w13, w2, tw, ids = args
    bs = kw["block_size"]
    act_k = seen[1].float()  # [pairs, I]: pair p is token p // top_k
    xf, qact = _quant_act_ref(x, bs), _quant_act_ref(seen[1], bs)
    ref_act = torch.zeros_like(act_k)
    out2 = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat, inter = ids.reshape(-1), w2.shape[2]
    for e in torch.unique(flat).tolist():
        if e < 0:
            continue
        p = (flat == e).nonzero(as_tuple=True)[0]
        h = xf[p // ids.shape[1]] @ Q.dequant_fp8_weight(w13[e], kw["w13_scale"][e], bs).T
        ref_act[p] = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = qact[p] @ Q.dequant_fp8_weight(w2[e], kw["w2_scale"][e], bs).T
        out2.index_add_(0, p // ids.shape[1], y * tw.reshape(-1)[p, None].float())
    live = flat >= 0

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    return rel(act_k[live], ref_act[live]), rel(out, out2)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 1024])
@pytest.mark.parametrize("zero,act_order", [(False, False), (True, False), (True, True)])
def test_gpu_fused_moe_w4a16(T, zero, act_order):
    """Qwen3-30B-A3B-GPTQ-Int4 sizes (128 experts, top 8, H 2048, I 768, group 128), bf16."""
    args = make_moe_w4(T, 128, 8, 2048, 768, 128, zero, act_order, drop=0.2, dtype=BF16,
                       device="cuda", seed=T)
    gpu_close(torch.ops.rankserve.fused_moe_w4a16(*args), moe.fused_moe_w4a16_ref(*args))


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 16, 64])
def test_gpu_cuda_graph_capture(M):
    check_graph_capture(M)


def check_graph_capture(M: int) -> None:
    """FP8 (per-channel and block) and w4a16 GEMMs captured in one CUDA graph, replayed on new
    input, equal their references."""
    x, q, s, b = make_fp8(M, 4096, 4096, BF16, None, False, seed=1, device="cuda")
    _, qb, sb, _ = make_fp8(M, 4096, 4096, BF16, [128, 128], False, seed=2, device="cuda")
    w4 = make_w4(M, 4096, 4096, 128, True, False, BF16, False, seed=3, device="cuda")
    ops = lambda: (Q.fp8_linear(x, q, s, b), Q.fp8_linear(x, qb, sb, None, [128, 128]),  # noqa: E731
                   Q.w4a16_linear(x, *w4[1:]))
    ops()  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops()
    x.normal_()
    graph.replay()
    refs = (Q.fp8_linear_ref(x, q, s, b), Q.fp8_linear_ref(x, qb, sb, None, [128, 128]),
            Q.w4a16_linear_ref(x, *w4[1:]))
    for out, ref in zip(outs, refs):
        gpu_close(out, ref)
