"""LoRA shrink/expand kernels (kernels/lora.py): BGMV and SGMV in Triton's interpreter vs the
plain-torch references, on a mixed batch (several adapters, base-model tokens, ragged segments)."""
from __future__ import annotations

import torch

from rankserve.kernels import lora


def _case(dtype_name: str):
    assert lora._INTERPRET, "the ops would compare the reference with itself"
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    S, R, K, N = 3, 8, 40, 36
    seg_len = [5, 1, 17, 3, 1]
    seg_slot = torch.tensor([0, -1, 2, 1, 0, -1], dtype=torch.int32)  # one padded segment
    T = sum(seg_len)
    seg_start = torch.tensor([0, *torch.tensor(seg_len).cumsum(0).tolist(), T], dtype=torch.int32)
    token_slot = torch.repeat_interleave(seg_slot[:5], torch.tensor(seg_len)).to(torch.int32)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(S, 2 * R, K, generator=g) * 0.2).to(dtype)
    b = (torch.randn(S, N, R, generator=g) * 0.2).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    ref_s = lora.ref_lora_shrink(x, a, token_slot)[0]
    assert ref_s[token_slot < 0].abs().max() == 0
    y0 = torch.randn(T, N + 5, generator=g).to(dtype)
    ref_y = y0.clone()
    ref_y[:, 5:] += lora.ref_lora_expand(ref_s[:, R:].to(dtype), b, token_slot).to(dtype)
    for sgmv in (torch.tensor(False), torch.tensor(True)):
        s = lora.lora_shrink(x, a, token_slot, seg_start, seg_slot, sgmv)
        assert s.shape[0] > 1  # K split over programs: partial sums
        torch.testing.assert_close(s.sum(0), ref_s, **tol)
        y = y0.clone()  # the second sub-matrix of a fused shrink, added at column 5
        lora.lora_expand_add(y, s, b, token_slot, 5, R)
        torch.testing.assert_close(y, ref_y, **tol)
        assert torch.equal(y[:, :5], y0[:, :5]) and torch.equal(y[token_slot < 0], y0[token_slot < 0])
    return True


def test_lora_kernels_fp32(interp):
    assert interp(_case, "float32")


def test_lora_kernels_bf16(interp):
    assert interp(_case, "bfloat16")
