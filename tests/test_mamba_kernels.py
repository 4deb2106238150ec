"""Mamba2 kernels (kernels/triton_mamba.py) vs their plain-torch references (kernels/mamba.py),
in Triton's interpreter (see tests/test_kernels.py for why the bodies run in a worker)."""
from __future__ import annotations

import pytest
import torch

from rankserve.kernels import mamba


# a mixed step: a fresh prefill (13), a chunk continuing a saved state (9 after 20), decodes
# (continuing and fresh), a padding request (slot -1), plus two padding rows
Q_LENS = [13, 9, 1, 1, 0]
SEQ_LENS = [13, 29, 40, 1, 0]
SLOTS = [2, 0, 3, 5, -1]


def make_meta(q_lens=Q_LENS, seq_lens=SEQ_LENS, slots=SLOTS, pad=2):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return (sum(q_lens) + pad, qsl, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32))


def on(device, dtype, *ts):
    return [None if t is None else t.to(device, dtype) for t in ts]


def conv_case(C, K, bias, seed, device="cpu", dtype=torch.float32):
    from rankserve.kernels import triton_mamba as tm
    g = torch.Generator().manual_seed(seed)
    T, *meta = make_meta()
    qsl, lens, idx = on(device, None, *meta)
    x = torch.randn(T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    state = torch.randn(6, K - 1, C, generator=g)
    x, w, b, state = on(device, dtype, x, w, b, state)
    ref_state = state.clone()
    ref = mamba.causal_conv1d_ref(x, w, b, ref_state, qsl, lens, idx)
    out = tm.causal_conv1d(x, w, b, state, qsl, lens, idx)
    n = int(qsl[-1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n], ref[:n], atol=tol, rtol=tol)
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(state, ref_state, atol=0, rtol=0)


@pytest.mark.parametrize("C,K,bias", [(48, 4, True), (130, 4, False), (16, 2, True)])
def test_causal_conv1d(interp, C, K, bias):
    interp(conv_case, C, K, bias, C + K)


def conv_update_case(C, K, bias, seed, device="cpu", dtype=torch.float32):
    """Decode: continuing requests, a fresh one (a one-token prompt), a padding request."""
    from rankserve.kernels import triton_mamba as tm
    g = torch.Generator().manual_seed(seed)
    T, qsl, lens, idx = make_meta([1, 1, 1, 0], [7, 1, 30, 0], [1, 4, 0, -1], pad=1)  # T == B
    qsl, lens, idx = on(device, None, qsl, lens, idx)
    x = torch.randn(T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    state = torch.randn(6, K - 1, C, generator=g)
    x, w, b, state = on(device, dtype, x, w, b, state)
    ref_state = state.clone()
    ref = mamba.causal_conv1d_ref(x, w, b, ref_state, qsl, lens, idx)
    out = tm.causal_conv1d_update(x, w, b, state, qsl, lens, idx)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:3], ref[:3], atol=tol, rtol=tol)
    assert torch.all(out[3:] == 0)
    torch.testing.assert_close(state, ref_state, atol=0, rtol=0)  # others' slots untouched


@pytest.mark.parametrize("C,K,bias", [(48, 4, True), (130, 2, False)])
def test_causal_conv1d_update(interp, C, K, bias):
    interp(conv_update_case, C, K, bias, C * K)


def test_conv1d_ref_chunked_equals_whole():
    """The reference itself: a prompt in two chunks (state carried) equals it in one."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(20, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    st1, st2 = torch.zeros(1, 3, 8), torch.zeros(1, 3, 8)
    whole = mamba.causal_conv1d_ref(x, w, b, st1, torch.tensor([0, 20]), torch.tensor([20]), torch.tensor([0]))
    a = mamba.causal_conv1d_ref(x[:7], w, b, st2, torch.tensor([0, 7]), torch.tensor([7]), torch.tensor([0]))
    c = mamba.causal_conv1d_ref(x[7:], w, b, st2, torch.tensor([0, 13]), torch.tensor([20]), torch.tensor([0]))
    torch.testing.assert_close(torch.cat([a, c]), whole)
    torch.testing.assert_close(st1, st2)


def make_ssd(T, H, P, G, N, slots, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(T, H, P), r(T, H), r(H) * 0.5, -torch.exp(r(H) * 0.5), r(T, G, N), r(T, G, N),
            r(H), r(slots, H, P, N))


def ssd_case(q_lens, seq_lens, slots, H, P, G, N, decode, seed, device="cpu", dtype=torch.float32):
    """fp32 (the interpreter) or the model dtype on the GPU (activations in it, the state and
    A in fp32 as in the model)."""
    from rankserve.kernels import triton_mamba as tm
    T, *meta = make_meta(q_lens, seq_lens, slots)
    qsl, lens, idx = on(device, None, *meta)
    x, dt, dt_bias, A, B, C, D, state = make_ssd(T, H, P, G, N, 6, seed)
    x, dt, dt_bias, B, C, D = on(device, dtype, x, dt, dt_bias, B, C, D)
    A, state = on(device, None, A, state)
    ref_state = state.clone()
    ref = mamba.ssd_scan_ref(x, dt, dt_bias, A, B, C, D, ref_state, qsl, lens, idx)
    y = tm.ssd_scan(x, dt, dt_bias, A, B, C, D, state, qsl, lens, idx, is_decode=decode)
    n = int(qsl[-1])
    tol = 1e-4 if dtype == torch.float32 and device == "cpu" else 3e-2  # GPU: tf32 / bf16 dots
    torch.testing.assert_close(y[:n], ref[:n], atol=tol, rtol=tol)
    assert torch.all(y[n:] == 0)
    torch.testing.assert_close(state, ref_state, atol=tol, rtol=tol)


@pytest.mark.parametrize("H,P,G,N", [(4, 16, 2, 16), (2, 24, 1, 8)])
def test_ssd_chunked_scan(interp, H, P, G, N):
    # chunks of 16 in the interpreter: 13 and 9 tokens in one chunk, 37 over three
    interp(ssd_case, [13, 9, 37, 1, 0], [13, 29, 37, 40, 0], [2, 0, 4, 3, -1], H, P, G, N, False, H + P)


@pytest.mark.parametrize("H,P,G,N", [(4, 16, 2, 16), (2, 24, 1, 8)])
def test_ssd_decode_update(interp, H, P, G, N):
    interp(ssd_case, [1, 1, 1, 0], [7, 1, 30, 0], [1, 4, 0, -1], H, P, G, N, True, H * P)


def test_ssd_ref_chunked_equals_whole():
    x, dt, dt_bias, A, B, C, D, _ = make_ssd(20, 2, 4, 1, 8, 1, 0)
    s1, s2 = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    i0 = torch.tensor([0])
    whole = mamba.ssd_scan_ref(x, dt, dt_bias, A, B, C, D, s1, torch.tensor([0, 20]), torch.tensor([20]), i0)
    parts = [mamba.ssd_scan_ref(x[a:b], dt[a:b], dt_bias, A, B[a:b], C[a:b], D, s2,
                                torch.tensor([0, b - a]), torch.tensor([b]), i0)
             for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close(s1, s2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mamba_kernels_gpu(dtype):
    """The same cases compiled for the GPU, in bf16 (and fp32), against the references."""
    for C, K, bias in [(48, 4, True), (130, 4, False), (1280, 4, True)]:
        conv_case(C, K, bias, C + K, "cuda", dtype)
        conv_update_case(C, K, bias, C * K, "cuda", dtype)
    for H, P, G, N in [(4, 16, 2, 16), (2, 24, 1, 8), (8, 64, 1, 128)]:
        ssd_case([13, 9, 137, 1, 0], [13, 29, 137, 140, 0], [2, 0, 4, 3, -1], H, P, G, N, False,
                 H + P, "cuda", dtype)
        ssd_case([1, 1, 1, 0], [7, 1, 30, 0], [1, 4, 0, -1], H, P, G, N, True, H * P, "cuda", dtype)
