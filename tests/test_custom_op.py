"""kernels/custom_op.py: an eager call of an op runs its function directly (no dispatcher, no
version-counter kernel for mutated inputs); torch.compile still sees the op."""
from __future__ import annotations

import torch

from rankserve.kernels import attention as A
from rankserve.kernels import gemv as G


def _decode_args():
    T, H, KH, D = 1, 2, 1, 8
    torch.manual_seed(0)
    one = torch.ones(())
    return (torch.randn(T, (H + 2 * KH) * D), torch.zeros(T, dtype=torch.long), torch.randn(64, D),
            None, None, 1e-6, torch.zeros(4, 16, KH, D), torch.zeros(4, 16, KH, D), one, one,
            torch.zeros(T, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), H, 0.3, True)


def test_eager_call_skips_the_dispatcher(monkeypatch):
    import torch._library.utils as U

    def boom(*a, **k):
        raise AssertionError("the dispatcher's ADInplaceOrView kernel ran")
    monkeypatch.setattr(U, "fill_defaults", boom)
    # made outside inference mode, as the engine's KV cache is: normal tensors, whose in-place
    # updates torch versions even inside inference mode
    args, again = _decode_args(), _decode_args()
    with torch.inference_mode():
        out = A.attention(*args)
        assert out.shape == (1, 16)
        assert args[6][0, 0].abs().sum() > 0  # the KV cache was written (slot 0)
        # the dispatcher path is the one that bumps version counters (and is slow)
        try:
            torch.ops.rankserve.attention(*again)
            raised = False
        except AssertionError:
            raised = True
        assert raised


def test_eager_and_dispatched_calls_agree():
    with torch.inference_mode():
        a, b = _decode_args(), _decode_args()
        assert torch.equal(A.attention(*a), torch.ops.rankserve.attention(*b))
        assert torch.equal(a[6], b[6]) and torch.equal(a[7], b[7])
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        assert torch.equal(G.skinny_linear(x, w), torch.ops.rankserve.skinny_linear(x, w))


def test_compiled_call_goes_through_the_op():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    seen = []
    fn = torch.compile(lambda x, w: G.skinny_linear(x, w) * 2, fullgraph=True,
                       backend=lambda gm, ex: (seen.append(gm), gm)[1])
    assert torch.allclose(fn(x, w), 2 * G.skinny_linear(x, w))
    targets = [str(n.target) for n in seen[0].graph.nodes if n.op == "call_function"]
    assert any("rankserve.skinny_linear" in t for t in targets), targets
