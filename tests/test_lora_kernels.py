"""LoRA shrink/expand kernels (kernels/lora.py): BGMV, SGMV and the expand in Triton's interpreter
vs the plain-torch references, on a mixed batch (several adapters, base-model tokens, ragged
segments, three fused slices), in both layouts of the low-rank activations (own slot, as K-split
partials of the shrink; every slot, as the wide GEMM's extra columns)."""
from __future__ import annotations

import pytest
import torch

from rankserve.kernels import lora


def _case(dtype_name: str, device: str = "cpu"):
    assert device == "cuda" or lora._INTERPRET, "the ops would compare the reference with itself"
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    S, R, K = 3, 8, 40
    bounds = [0, 20, 28, 36]  # q / k / v-like slices of B's rows
    N, C = bounds[-1], 3 * R
    seg_len = [5, 1, 17, 3, 1]
    seg_slot = torch.tensor([0, -1, 2, 1, 0, -1], dtype=torch.int32)  # one padded segment
    T = sum(seg_len)
    seg_start = torch.tensor([0, *torch.tensor(seg_len).cumsum(0).tolist(), T], dtype=torch.int32)
    token_slot = torch.repeat_interleave(seg_slot[:5], torch.tensor(seg_len)).to(torch.int32)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(S, C, K, generator=g) * 0.2).to(dtype)
    b = (torch.randn(S, N, R, generator=g) * 0.2).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    y0 = torch.randn(T, N, generator=g).to(dtype)
    x, a, b, bias, y0, token_slot, seg_start, seg_slot = (
        t.to(device) for t in (x, a, b, bias, y0, token_slot, seg_start, seg_slot))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    # the update by hand: each token's own adapter, each slice its own R columns of s
    ref_s = lora.ref_lora_shrink(x, a, token_slot)[0]
    assert ref_s[token_slot < 0].abs().max() == 0
    want = torch.zeros(T, N, device=device)
    for t in range(T):
        sl = int(token_slot[t])
        for i in range(3) if sl >= 0 else ():
            lo, hi = bounds[i], bounds[i + 1]
            want[t, lo:hi] = b[sl, lo:hi].float() @ ref_s[t, i * R:(i + 1) * R].to(dtype).float()
    want = y0.float() + bias.float() + want
    for sgmv in (torch.tensor(False), torch.tensor(True)):
        s = lora.lora_shrink(x, a, token_slot, seg_start, seg_slot, sgmv)
        if not x.is_cuda:  # this K is split over programs in the interpreter: partial sums
            assert s.shape[0] > 1
        torch.testing.assert_close(s.sum(0), ref_s, **tol)
        y = lora.lora_expand(y0, s, b, token_slot, bounds, 0, bias)
        torch.testing.assert_close(y.float(), want, **tol)
        torch.testing.assert_close(y, lora.ref_lora_expand(y0, s, b, token_slot, bounds, 0, bias),
                                   **tol)
        torch.testing.assert_close(y[token_slot < 0], y0[token_slot < 0] + bias, **tol)
    # every slot's activations side by side after the base columns (the wide GEMM's output),
    # with padding columns of garbage that no slot reads
    s_all = torch.einsum("tk,sck->tsc", x.float(), a.float()).reshape(T, S * C).to(dtype)
    wide = torch.cat([y0, s_all, torch.full((T, 5), 1e4, device=device).to(dtype)], 1)
    for bias_ in (bias, None):
        y = lora.lora_expand(wide[:, :N], wide[:, N:].unsqueeze(0), b, token_slot, bounds, C, bias_)
        ref = lora.ref_lora_expand(wide[:, :N], wide[:, N:].unsqueeze(0), b, token_slot, bounds, C,
                                   bias_)
        torch.testing.assert_close(y, ref, **tol)
        torch.testing.assert_close(y.float(), want - (0 if bias_ is not None else bias.float()),
                                   **tol)
    return True


def test_lora_kernels_fp32(interp):
    assert interp(_case, "float32")


def test_lora_kernels_bf16(interp):
    assert interp(_case, "bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_kernels_cuda(dtype):
    assert _case(dtype, "cuda")
