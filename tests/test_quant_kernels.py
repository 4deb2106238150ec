"""Quantized GEMMs (kernels/quant.py, FP8 fused MoE in kernels/moe.py) vs their plain-torch
references."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rankserve.kernels import quant as Q


def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=g)
    packed = Q.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(Q.unpack_int4(packed), q.to(torch.uint8))
    # nibble j of qweight[i, n] is row 8i + j
    assert int(packed[1, 3]) & 0xF == int(q[8, 3]) and (int(packed[1, 3]) >> 28) & 0xF == int(q[15, 3])


@pytest.mark.parametrize("block_size", [None, [32, 64]])
def test_fp8_ops_cpu_reference_and_fake(block_size):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 200, generator=g), torch.randn(72, 200, generator=g) / 14
    q, s = Q.quant_fp8_weight(w, block_size)
    y = Q.fp8_linear(x, q, s, None, block_size)
    assert y.shape == (3, 5, 72) and torch.equal(y, Q.fp8_linear_ref(x, q, s, None, block_size))
    assert (y - x @ w.T).norm() < 0.08 * (x @ w.T).norm()
    with FakeTensorMode() as mode:
        f = Q.fp8_linear(mode.from_tensor(x), mode.from_tensor(q), mode.from_tensor(s), None,
                         block_size)
    assert f.shape == y.shape
