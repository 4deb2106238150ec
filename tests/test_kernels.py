"""Triton kernels vs the plain-torch references.

CPU: the kernels run in Triton's interpreter (numpy; fp32 / fp16, since the interpreter's bf16 dot
is broken). TRITON_INTERPRET must be set before triton is imported, so those test bodies run in
one spawned worker process that gets the variable; this pytest process never sees it.
GPU (`-m gpu`): the compiled kernels in bf16 at real model sizes, plus CUDA-graph capture.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from torch._subclasses.fake_tensor import FakeTensorMode

from rankserve.kernels import moe, triton_attention as ta
from rankserve.kernels.attention import paged_attention_ref, prepare_qkv_ref

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _interpreting() -> bool:
    return isinstance(ta._unified_attention_kernel, InterpretedFunction)


@contextlib.contextmanager
def poisoned_empty_like():
    """torch.empty_like / torch.empty return NaN-filled float tensors, so unwritten output rows
    (and split-KV partials the reduce reads without their being written) are caught."""
    real, real_empty = torch.empty_like, torch.empty

    def empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty_like = lambda t, **kw: real(t, **kw).fill_(float("nan"))
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty_like, torch.empty = real, real_empty


# ----------------------------------------------------------------------------------------------
# attention helpers
# ----------------------------------------------------------------------------------------------

def make_batch(q_lens, seq_lens, *, kv_heads, group, head_dim, block_size, pad_tokens=0,
               dtype=torch.float32, device="cpu", seed=0):
    """Random paged caches (shuffled block ids, spare columns) + metadata for one step."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(q_lens)
    max_blocks = max(triton.cdiv(s, block_size) for s in seq_lens) + 2
    num_blocks = B * max_blocks + 5
    block_table = torch.randperm(num_blocks, generator=g)[:B * max_blocks].view(B, max_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    T = sum(q_lens) + pad_tokens
    q = torch.randn(T, kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    to = dict(device=device)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to), qsl.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table.int().to(**to))


def check_attention(batch, atol, rtol):
    q, k_cache, v_cache, qsl, seq_lens, block_table = batch
    scale = q.shape[-1] ** -0.5
    # the model runner's rule: decode mode when no request has more than one query token
    is_decode = int((qsl[1:] - qsl[:-1]).max()) <= 1
    with poisoned_empty_like():
        out = ta.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, scale,
                                 is_decode=is_decode)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_table, scale,
                              is_decode=is_decode)
    n = int(qsl[-1])
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    assert torch.all(out[n:] == 0), "padding rows must be zero"


def attention_case(q_lens, seq_lens, kw, atol=1e-5, rtol=1e-5):
    check_attention(make_batch(q_lens, seq_lens, **kw), atol, rtol)


# A mixed step: prefills (1, 17, 37 tokens), a chunked prefill (24 new after 40 cached), a prefix
# extension (5 new after 60), decodes (contexts 1, 33, 70), a padding request (0/0).
MIXED_Q = [1, 17, 37, 24, 5, 1, 1, 1, 0]
MIXED_S = [1, 17, 37, 64, 65, 1, 33, 70, 0]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_attention_mixed(interp, group, block_size):
    interp(attention_case, MIXED_Q, MIXED_S,
           dict(kv_heads=2, group=group, head_dim=16, block_size=block_size, pad_tokens=3,
                seed=group * 100 + block_size))


@pytest.mark.parametrize("head_dim", [8, 32, 24])  # 8: stories260K; 24: masked non-power-of-two
def test_paged_attention_head_dims(interp, head_dim):
    interp(attention_case, [3, 20, 1], [3, 45, 9],
           dict(kv_heads=1, group=2, head_dim=head_dim, block_size=16, pad_tokens=1,
                seed=head_dim))


def test_paged_attention_fp16(interp):
    interp(attention_case, [9, 1, 30], [20, 50, 30],
           dict(kv_heads=2, group=2, head_dim=16, block_size=16, pad_tokens=2,
                dtype=torch.float16, seed=7), 2e-3, 2e-3)


def window_case(q_lens, seq_lens, window, softcap, kw, atol=1e-5, rtol=1e-5):
    """Sliding window (and soft-capping): blocks wholly before a request's first query window are
    NaN, so a kernel that reads them (rather than skipping them) fails."""
    q, k_cache, v_cache, qsl, lens, bt = make_batch(q_lens, seq_lens, **kw)
    bs = k_cache.shape[1]
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        dead = max(0, sl - ql - window + 1) // bs
        k_cache[bt[i, :dead].long()] = float("nan")
        v_cache[bt[i, :dead].long()] = float("nan")
    scale = q.shape[-1] ** -0.5
    is_decode = int((qsl[1:] - qsl[:-1]).max()) <= 1
    with poisoned_empty_like():
        out = ta.paged_attention(q, k_cache, v_cache, qsl, lens, bt, scale, is_decode=is_decode,
                                 window=window, softcap=softcap)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, lens, bt, scale, is_decode=is_decode,
                              window=window, softcap=softcap)
    n = int(qsl[-1])
    assert not ref[:n].isnan().any()
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    # the window changes the result (else this test proves nothing)
    full = paged_attention_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), qsl, lens, bt,
                               scale, is_decode=is_decode, softcap=softcap)
    assert not torch.allclose(full[:n], ref[:n])


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (13, 0.0), (20, 5.0)])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_sliding_window(interp, window, softcap, group):
    interp(window_case, MIXED_Q, MIXED_S, window, softcap,
           dict(kv_heads=2, group=group, head_dim=16, block_size=8, pad_tokens=3, seed=window))


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (21, 3.0)])
def test_decode_sliding_window(interp, window, softcap):
    interp(window_case, [1, 1, 1, 1, 1, 0], [1, 150, 37, 300, 16, 0], window, softcap,
           dict(kv_heads=2, group=2, head_dim=16, block_size=8, pad_tokens=1, seed=window))


def decode_split_case(group, head_dim):
    # T == B -> split path; the last request is CUDA-graph padding (no token, empty context) and
    # row T-1 is a padding row that must come back zero.
    seq_lens = [1, 150, 37, 300, 16, 0]
    q_lens = [1, 1, 1, 1, 1, 0]
    batch = make_batch(q_lens, seq_lens, kv_heads=2, group=group, head_dim=head_dim,
                       block_size=16, pad_tokens=1, seed=group + head_dim)
    assert batch[0].shape[0] == len(seq_lens)
    max_ctx = batch[5].shape[1] * 16
    assert ta._num_splits(len(seq_lens), 2, max_ctx, 16, torch.device("cpu")) > 1
    check_attention(batch, 1e-5, 1e-5)


@pytest.mark.parametrize("group,head_dim", [(1, 16), (4, 8), (2, 32)])
def test_decode_split_kv(interp, group, head_dim):
    interp(decode_split_case, group, head_dim)


def decode_lpt_case(order_kind, fused):
    """DECODE_LPT: grid (kv heads, splits, requests), requests taken in `decode_order` (the
    runner's argsort by decreasing context; also an arbitrary permutation, and none): the same
    result as the reference, padding rows zero. A split batch and a one-split one."""
    ta.DECODE_LPT = True
    try:
        for seq_lens, q_lens in (([1, 150, 37, 300, 16, 0], [1, 1, 1, 1, 1, 0]),
                                 ([1 + 23 * i for i in range(14)] + [0, 0], [1] * 14 + [0, 0])):
            if fused:
                fused_decode_case(seq_lens, 2, True, torch.float32, seed=len(seq_lens),
                                  order=order_kind, split=len(seq_lens) < 10)
                continue
            batch = make_batch(q_lens, seq_lens, kv_heads=2, group=2, head_dim=16, block_size=16,
                               pad_tokens=q_lens.count(0), seed=len(seq_lens))
            order = lpt_order(seq_lens, order_kind)
            q, k_cache, v_cache, qsl, lens, bt = batch
            scale = q.shape[-1] ** -0.5
            with poisoned_empty_like():
                out = ta.paged_attention(q, k_cache, v_cache, qsl, lens, bt, scale, is_decode=True,
                                         decode_order=order)
            ref = paged_attention_ref(q, k_cache, v_cache, qsl, lens, bt, scale, is_decode=True)
            n = int(qsl[-1])
            torch.testing.assert_close(out[:n], ref[:n], atol=1e-5, rtol=1e-5)
            assert torch.all(out[n:] == 0), "padding rows must be zero"
    finally:
        ta.DECODE_LPT = False


def lpt_order(seq_lens, kind):
    if kind == "none":
        return None
    if kind == "sorted":  # the runner's: np.argsort(-seq_lens, kind="stable")
        return torch.tensor(sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]),
                            dtype=torch.int32)
    return torch.randperm(len(seq_lens), generator=torch.Generator().manual_seed(1)).int()


@pytest.mark.parametrize("order_kind", ["sorted", "shuffled", "none"])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_lpt_order(interp, order_kind, fused):
    interp(decode_lpt_case, order_kind, fused)


def mixed_decode_rows_case(split):
    # a mixed step's one-token requests through the split-KV kernel or the unified one: both
    # equal the reference (padding rows past the last request zero either way)
    old = ta.MIXED_DECODE_SPLIT
    ta.MIXED_DECODE_SPLIT = split
    try:
        check_attention(make_batch(MIXED_Q, MIXED_S, kv_heads=2, group=2, head_dim=16,
                                   block_size=8, pad_tokens=3, seed=5), 1e-5, 1e-5)
    finally:
        ta.MIXED_DECODE_SPLIT = old


@pytest.mark.parametrize("split", [True, False])
def test_mixed_step_decode_rows_either_kernel(interp, split):
    interp(mixed_decode_rows_case, split)


def decode_one_split_case():
    # a batch large enough for one split per sequence: the split kernel writes out directly
    seq_lens = [1 + 23 * i for i in range(14)] + [0, 0]
    q_lens = [1] * 14 + [0, 0]
    batch = make_batch(q_lens, seq_lens, kv_heads=2, group=2, head_dim=16, block_size=16,
                       pad_tokens=2, seed=3)
    assert ta._num_splits(len(seq_lens), 2, batch[5].shape[1] * 16, 16, torch.device("cpu")) == 1
    check_attention(batch, 1e-5, 1e-5)


def test_decode_one_split(interp):
    interp(decode_one_split_case)


def padded_prefill_case():
    # the compiled path pads one request with 2 new tokens (after 5 cached) to two requests:
    # T == B == 2, yet not a decode step (issue 11: the kernel took the decode path by shape)
    batch = make_batch([2, 0], [7, 0], kv_heads=2, group=2, head_dim=16, block_size=16, seed=11)
    check_attention(batch, 1e-5, 1e-5)


def test_padded_prefill_is_not_decode(interp):
    interp(padded_prefill_case)


def test_decode_contract_checked():
    """The reference path refuses decode mode for a request with two query tokens."""
    q, kc, vc, qsl, sl, bt = make_batch([2, 0], [7, 0], kv_heads=1, group=1, head_dim=8,
                                        block_size=16)
    with pytest.raises(AssertionError, match="one query token"):
        paged_attention_ref(q, kc, vc, qsl, sl, bt, 1.0, is_decode=True)


def make_qkv(T, H, KH, D, nb, bs, *, norm, dtype=torch.float32, device="cpu", seed=1):
    """Fused qkv rows, RoPE table, q/k norm weights, poisoned caches, slots with padding."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KH) * D, generator=g)
    positions = torch.randint(0, 500, (T,), generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    qn, kn = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5) if norm else (None, None)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::4] = -1
    caches = torch.full((4, nb, bs, KH, D), 1234.5)
    to = dict(device=device)
    return (qkv.to(dtype).to(**to), positions.to(**to), cos_sin.to(**to),
            None if qn is None else qn.to(dtype).to(**to), None if kn is None else kn.to(dtype).to(**to),
            1e-6, caches.to(dtype).to(**to), slots.to(**to), H)


def check_prepare_qkv(args, tol):
    qkv, positions, cos_sin, qn, kn, eps, caches, slots, H = args
    q = ta.prepare_qkv(qkv, positions, cos_sin, qn, kn, eps, caches[0], caches[1], slots, H)
    q_ref = prepare_qkv_ref(qkv, positions, cos_sin, qn, kn, eps, caches[2], caches[3], slots, H)
    # a different sum order / FMA contraction may move the last rounding by one step
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0], caches[2], atol=tol, rtol=tol)
    assert torch.equal(caches[1], caches[3])  # v is moved, never rounded
    written = (caches[0].flatten(0, 1) != 1234.5).all(-1).all(-1)
    assert written.sum() == (slots >= 0).sum()  # padding tokens write nothing


def prepare_qkv_case(norm, dtype, T=11, H=4, per_program=8):
    ta.PREPARE_HEADS = per_program
    check_prepare_qkv(make_qkv(T, H, 2, 16, 6, 16, norm=norm, dtype=dtype),
                      1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prepare_qkv(interp, norm, dtype):
    """q/k norm + RoPE + cache store in one kernel equals the torch reference the models use."""
    interp(prepare_qkv_case, norm, dtype)


@pytest.mark.parametrize("T, per_program", [(11, 1), (11, 2), (11, 4), (70, 2)])
def test_prepare_qkv_head_blocks(interp, T, per_program):
    """Decode-sized steps split a token's 6 q + 2 k heads over programs of `per_program` heads
    (4: one block holds q heads 4-5 and both k heads, which also move both v heads); above
    PREPARE_SPLIT_T tokens a program takes a whole token."""
    interp(prepare_qkv_case, True, torch.float32, T, 6, per_program)


def prepare_qkv_shape_case(T, H, KH, D, per_program, dtype):
    ta.PREPARE_HEADS = per_program
    check_prepare_qkv(make_qkv(T, H, KH, D, 6, 16, norm=True, dtype=dtype),
                      1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("T, H, KH, D, per_program, dtype", [
    (5, 14, 2, 80, 8, torch.float16),   # 14 q + 2 kv heads (no power of 2), head_dim 80
    (3, 8, 8, 64, 4, torch.float32),    # no GQA: k heads spread over two programs
    (3, 16, 1, 32, 8, torch.float16),   # GQA 16
    (3, 12, 4, 256, 8, torch.float32),  # head_dim 256
    (4, 6, 3, 16, 2, torch.float32)])   # 3 kv heads: a program with the last k head alone
def test_prepare_qkv_head_block_shapes(interp, T, H, KH, D, per_program, dtype):
    interp(prepare_qkv_shape_case, T, H, KH, D, per_program, dtype)


def fused_decode_case(seq_lens, group, norm, dtype, fp8=False, window=0, softcap=0.0, seed=0,
                      device="cpu", KH=2, D=16, bs=8, order="none", split=True):
    """fused_decode_attention (q/k norm + RoPE + KV store inside the split-KV kernel) equals
    prepare_qkv_ref then paged_attention_ref: the output, and the caches it wrote. Requests
    with seq_len 0 are padding (no query row, slot -1)."""
    from rankserve.kernels.attention import quantize_fp8
    q_lens = [1 if s else 0 for s in seq_lens]
    _, k_cache, v_cache, qsl, lens, bt = make_batch(q_lens, [max(s, 1) for s in seq_lens],
                                                    kv_heads=KH, group=group, head_dim=D, block_size=bs,
                                                    pad_tokens=q_lens.count(0), dtype=dtype, seed=seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    B, H = len(seq_lens), KH * group
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(B, (H + 2 * KH) * D, generator=g).to(dtype)
    # token rows: the real requests' tokens in request order (qsl), then the padding rows
    real = [i for i, s in enumerate(seq_lens) if s]
    positions = torch.tensor([seq_lens[i] - 1 for i in real] + [0] * (B - len(real)))
    slots = torch.tensor([int(bt[i, (seq_lens[i] - 1) // bs]) * bs + (seq_lens[i] - 1) % bs
                          for i in real] + [-1] * (B - len(real)))
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    freqs = torch.outer(torch.arange(max(512, *seq_lens)).float(), inv)  # a row per position (4000 on the GPU)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    qn, kn = (torch.rand(D, generator=g).to(dtype) + 0.5, torch.rand(D, generator=g).to(dtype) + 0.5) \
        if norm else (None, None)
    ks = vs = None
    if fp8:
        ks, vs = torch.tensor(0.02), torch.tensor(0.015)
        k_cache, v_cache = quantize_fp8(k_cache, ks), quantize_fp8(v_cache, vs)
    if device != "cpu":
        qkv, positions, cos_sin, slots, qsl, lens, bt, k_cache, v_cache = (
            t.to(device) for t in (qkv, positions, cos_sin, slots, qsl, lens, bt, k_cache, v_cache))
        qn, kn, ks, vs = (None if t is None else t.to(device) for t in (qn, kn, ks, vs))
    kc, vc = k_cache.clone(), v_cache.clone()
    scale = D ** -0.5
    dec_order = lpt_order(seq_lens, order)
    out = ta.fused_decode_attention(qkv, positions, cos_sin, qn, kn, 1e-6, kc, vc, slots, qsl, lens,
                                    bt, H, scale, k_scale=ks, v_scale=vs, window=window, softcap=softcap,
                                    decode_order=None if dec_order is None else dec_order.to(qkv.device))
    q = prepare_qkv_ref(qkv, positions, cos_sin, qn, kn, 1e-6, k_cache, v_cache, slots, H, ks, vs)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, lens, bt, scale, is_decode=True,
                              k_scale=ks, v_scale=vs, window=window, softcap=softcap)
    n = sum(q_lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    for got, want in ((kc, k_cache), (vc, v_cache)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol if not fp8 else 0.07,
                                   rtol=tol if not fp8 else 0.07)
    assert device != "cpu" or (ta._num_splits(B, KH, bt.shape[1] * bs, 16, torch.device("cpu")) > 1) == split


@pytest.mark.parametrize("group, norm, dtype", [(1, False, torch.float32), (2, True, torch.float32),
                                                (4, True, torch.float16), (2, False, torch.float16)])
def test_fused_decode_attention(interp, group, norm, dtype):
    """Contexts of 1 (only the new token), block edges, long ones; a padding request last."""
    interp(fused_decode_case, [1, 8, 9, 41, 0], group, norm, dtype)


@pytest.mark.parametrize("fp8, window, softcap", [(True, 0, 0.0), (False, 6, 0.0), (False, 13, 5.0)])
def test_fused_decode_attention_variants(interp, fp8, window, softcap):
    """An fp8 cache (the new k / v quantized as prepare_qkv stores them), sliding windows, softcap."""
    interp(fused_decode_case, [3, 17, 40, 0, 0], 2, True, torch.float32, fp8, window, softcap, 3)


@pytest.mark.parametrize("seq_lens, group, KH, D, bs, dtype", [
    ([5, 0, 7, 0, 30], 2, 2, 16, 8, torch.float32),     # padding requests between real ones
    ([30, 47], 7, 2, 80, 16, torch.float32),            # 14 q + 2 kv heads, head_dim 80
    ([200, 33], 8, 1, 64, 16, torch.float16),           # GQA 8, contexts over many blocks
    ([150, 1], 16, 1, 32, 32, torch.float32),           # GQA 16, blocks of 32
    ([21, 64], 2, 2, 256, 16, torch.float32)])          # head_dim 256
def test_fused_decode_attention_shapes(interp, seq_lens, group, KH, D, bs, dtype):
    interp(fused_decode_case, seq_lens, group, True, dtype, False, 0, 0.0, 5, "cpu", KH, D, bs)


def test_interpreter_confined_to_worker(interp):
    assert interp(_interpreting)
    assert not _interpreting() or os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------
# fused MoE
# ----------------------------------------------------------------------------------------------

def make_moe(T, E, K, H, inter, *, drop=0.0, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, inter, generator=g) * inter ** -0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.long)
    ids[torch.rand(ids.shape, generator=g) < drop] = -1  # experts on other ranks
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    to = dict(device=device)
    return (x.to(dtype).to(**to), w13.to(dtype).to(**to), w2.to(dtype).to(**to),
            weights.to(**to), ids.to(torch.int32).to(**to))


def moe_case(T, E, K, H, inter, drop, seed):
    args = make_moe(T, E, K, H, inter, drop=drop, seed=seed)
    torch.testing.assert_close(moe.fused_moe_triton(*args), moe.fused_moe_ref(*args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,E,K,H,inter,drop", [
    (1, 4, 2, 32, 16, 0.0), (19, 8, 2, 48, 40, 0.3), (40, 6, 3, 64, 32, 0.5)])
def test_fused_moe_matches_ref(interp, T, E, K, H, inter, drop):
    interp(moe_case, T, E, K, H, inter, drop, T)


def moe_off_rank_case():
    x, w13, w2, weights, ids = make_moe(5, 4, 2, 32, 16, seed=3)
    out = moe.fused_moe_triton(x, w13, w2, weights, torch.full_like(ids, -1))
    assert torch.equal(out, torch.zeros_like(x))


def test_fused_moe_all_off_rank_is_zero(interp):
    interp(moe_off_rank_case)


def moe_align_case():
    ids = torch.tensor([[3, 0], [3, -1], [1, 3], [-1, -1], [0, 3]], dtype=torch.int32)
    check_align(ids, 5, 4)
    ids = make_moe(50, 7, 3, 8, 8, drop=0.2, seed=11)[4].long()  # int64 ids, as torch.topk gives
    check_align(ids, 7, 16)


def check_align(ids, num_experts, block_m):
    pairs, block_expert = moe.moe_align(ids, num_experts=num_experts, block_m=block_m)
    n = ids.numel()
    flat = ids.flatten()
    rows = pairs.view(-1, block_m)
    assert rows.shape[0] == block_expert.shape[0]
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        real = [p for p in rows[b].tolist() if p < n]
        if e >= num_experts:
            assert not real
        else:
            assert real, "a block of an expert's group holds at least one pair"
        assert all(flat[p] == e for p in real)
        seen += real
    assert sorted(seen) == [i for i in range(n) if flat[i] >= 0]  # each valid pair once


def test_moe_align_groups(interp):
    interp(moe_align_case)


def test_fused_moe_op_cpu():
    args = make_moe(6, 4, 2, 16, 8, drop=0.25, seed=5)
    out = torch.ops.rankserve.fused_moe(*args)
    assert torch.equal(out, moe.fused_moe_ref(*args))
    with FakeTensorMode() as mode:  # the fake impl, as torch.compile traces it
        fake = torch.ops.rankserve.fused_moe(*(mode.from_tensor(a) for a in args))
    assert fake.shape == args[0].shape and fake.dtype == args[0].dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_benchmark_refuses_without_cuda(capsys):
    from rankserve.kernels import benchmark
    assert benchmark.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# GPU, bf16, real sizes (run on the H200 with `pytest -m gpu`)
# ----------------------------------------------------------------------------------------------

REAL = dict(kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_gpu_decode_bf16(batch):
    g = torch.Generator().manual_seed(batch)
    seq = torch.randint(1, 4097, (batch,), generator=g).tolist()
    b = make_batch([1] * batch + [0], seq + [0], pad_tokens=1, seed=batch, **REAL)
    check_attention(b, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
def test_gpu_mixed_bf16():
    q_lens = [1000, 1, 300, 1, 77, 513, 0]
    seq_lens = [1000, 4000, 2348, 17, 77, 4096, 0]
    check_attention(make_batch(q_lens, seq_lens, pad_tokens=13, **REAL), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T", [1, 40, 300])  # 8 heads a program up to PREPARE_SPLIT_T, then a token
def test_gpu_prepare_qkv(norm, T):
    check_prepare_qkv(make_qkv(T, 32, 8, 128, 1000, 16, norm=norm, dtype=torch.bfloat16,
                               device="cuda"), 2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("seq_lens", [[300], [1, 17, 4000, 129, 0], [2048] * 8])
def test_gpu_fused_decode_attention(fp8, seq_lens):
    fused_decode_case(seq_lens, 4, True, torch.bfloat16, fp8, 0, 0.0, 5, "cuda", 8, 128, 16)


@gpu
@needs_cuda
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gpu_cuda_graph_capture(decode, use_pdl, monkeypatch):
    """The op captures (no host sync) and replays correctly on new metadata of the same shape;
    `use_pdl`: with programmatic dependent launch (prepare_qkv -> decode split -> reduce)."""
    from rankserve.kernels import pdl
    monkeypatch.setattr(pdl, "ENABLED", use_pdl)
    B = 8
    q_lens = [1] * B if decode else [1, 40, 1, 200, 3, 1, 0, 1]
    seq = [100, 900, 5, 2000, 64, 1, 0, 3000] if not decode else [100, 900, 5, 2000, 64, 1, 7, 3]
    # a decode step has one row per request: the runner pads it with padding requests, not tokens
    q, kc, vc, qsl, sl, bt = make_batch(q_lens, seq, pad_tokens=0 if decode else 2, **REAL)
    T, H, D = q.shape
    qkv = torch.randn(T, (H + 16) * D, device="cuda", dtype=torch.bfloat16)
    qkv[:, :H * D] = q.view(T, -1)
    cos_sin = torch.cat([torch.ones(8, D // 2), torch.zeros(8, D // 2)], -1).cuda()  # RoPE at 0
    positions = torch.zeros(T, dtype=torch.int64, device="cuda")
    slots = torch.full((T,), -1, dtype=torch.int64, device="cuda")
    one = torch.ones((), device="cuda")  # k/v scales (read by fp8 caches only)
    op = lambda: torch.ops.rankserve.attention(  # noqa: E731
        qkv, positions, cos_sin, None, None, 0.0, kc, vc, one, one, slots, qsl, sl, bt, H, 0.1,
        decode)
    op()  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op()
    sl.copy_(torch.flip(sl, [0]) if decode else sl)  # new context lengths, same shapes
    q.normal_()
    qkv[:, :H * D] = q.view(T, -1)
    graph.replay()
    ref = paged_attention_ref(q, kc, vc, qsl, sl, bt, 0.1).view(T, -1)
    n = int(qsl[-1])
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 1024, 2048])  # row blocks of 16, 64, 64, 128
def test_gpu_fused_moe_bf16(T):
    args = make_moe(T, 128, 8, 2048, 768, drop=0.2, dtype=torch.bfloat16, device="cuda", seed=T)
    out = torch.ops.rankserve.fused_moe(*args).float()
    ref = moe.fused_moe_ref(*args).float()
    assert (out - ref).norm() / ref.norm() < 1e-2


def test_runner_gives_decode_steps_their_lpt_order(monkeypatch):
    """RANKSERVE_DECODE_LPT: every decode step's AttnMeta carries the requests by decreasing
    seq_len (a stable argsort, one entry per request); other steps carry none. On the CPU the
    reference attention ignores it, so the tokens are the default's."""
    import numpy as np

    from rankserve import LLM, SamplingParams
    from rankserve.models import layers
    from conftest import STORIES_EMBEDDED
    seen, real = [], layers.attention

    def spy(*a):
        order, lens, is_decode = a[-1], a[12], a[16]
        seen.append((is_decode, None if order is None else order.tolist(), lens.tolist()))
        return real(*a)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9, 30)]
    ref = [o.outputs[0].token_ids for o in LLM(str(STORIES_EMBEDDED), max_num_seqs=4).generate(prompts, sp)]
    monkeypatch.setenv("RANKSERVE_DECODE_LPT", "1")
    monkeypatch.setattr(layers, "attention", spy)
    try:
        got = [o.outputs[0].token_ids for o in LLM(str(STORIES_EMBEDDED), max_num_seqs=4).generate(prompts, sp)]
    finally:
        ta.DECODE_LPT = False  # (the runner set the process-wide switch)
    assert got == ref
    decodes = [(order, lens) for is_decode, order, lens in seen if is_decode]
    assert decodes and all(order is None for is_decode, order, _ in seen if not is_decode)
    for order, lens in decodes:
        assert order == np.argsort(-np.array(lens), kind="stable").tolist()
        assert [lens[i] for i in order] == sorted(lens, reverse=True)
    assert any(order != sorted(order) for order, _ in decodes), "no step needed reordering"


def test_padded_decode_order_is_a_permutation():
    """A CUDA graph replays a decode step padded from B to B2 requests: the order it reads is
    the step's order, then the padding requests (no context) last, a permutation of 0..B2-1."""
    from rankserve.runtime.input_batch import InputBatch
    b = InputBatch(8, 64, 16, 32, None, torch.float32, torch.device("cpu"))
    b.lpt = True
    assert b.order[:8].tolist() == list(range(8))  # valid before any step
    b.order[:5].copy_(torch.tensor([4, 4, 4, 4, 4]))  # a stale prefix from some earlier step
    b.order[:3].copy_(torch.tensor([2, 0, 1]))
    b.pad(3, 6, 3, 6)
    meta = b.attn(6, 6, is_decode=True)
    assert meta.decode_order.tolist() == [2, 0, 1, 3, 4, 5]
    assert b.attn(6, 6, is_decode=False).decode_order is None
    b.lpt = False
    assert b.attn(6, 6, is_decode=True).decode_order is None


def test_warmup_and_capture_inputs_reset_the_decode_order():
    """The dummy decode steps (warm-up, graph-capture inputs) that can run after real steps
    read an identity order, not a real step's (which may name requests they do not have)."""
    from rankserve import LLM
    from conftest import STORIES_EMBEDDED
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=8)
    cm = llm.engine.executor.runner.compiled_model
    b = cm.batch
    b.order[:8].copy_(torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]))
    ids, pos, attn, _ = cm.graph_inputs(4)
    assert b.order[:4].tolist() == [0, 1, 2, 3]
    b.order[:8].copy_(torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]))
    cm.warmup()
    assert b.order[:2].tolist() == [0, 1]
