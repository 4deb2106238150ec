"""The logits GEMM runs at a few row counts (ModelRunner.logits_rows), each warmed at start-up, so
that no step of a server's first burst meets a GEMM shape cuBLAS has not run yet (its kernels
load lazily and the call blocks the host for milliseconds: benchmarks/2026-12-04-h200-s12)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from rankserve.runtime.model_runner import ModelRunner


def test_rows_are_few_and_never_below_the_request():
    rows = [ModelRunner.logits_rows(m) for m in range(1, 2049)]
    for m, r in enumerate(rows, start=1):
        assert r >= m
        if m <= 16:
            assert r & (r - 1) == 0 and r < 2 * m  # the next power of 2
        elif m <= 512:
            assert r % 16 == 0 and r - m < 16
        else:
            assert r % 64 == 0 and r - m < 64
    assert len(set(rows[:256])) == 5 + 15  # 1, 2, 4, 8, 16, then 32 .. 256
    assert len(set(rows)) == 5 + 31 + 24  # then 576 .. 2048


class Head(torch.nn.Module):
    def __init__(self, hidden=24, vocab=50):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.calls = []

    def compute_logits(self, h):
        self.calls.append(h.shape[0])
        return self.lm_head(h)


def fake_runner(max_num_seqs=40, drafts=None):
    spec = None if drafts is None else SimpleNamespace(num_speculative_tokens=drafts)  # (as the config)
    return SimpleNamespace(model=Head(), logits_rows=ModelRunner.logits_rows,
                           cfg=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs),
                                               spec=spec),
                           hf_config=SimpleNamespace(hidden_size=24), dtype=torch.float32,
                           device=torch.device("cpu"))


def test_padded_rows_give_the_same_logits():
    torch.manual_seed(0)
    r = fake_runner()
    for m in (1, 3, 17, 40):
        h = torch.randn(m, 24)
        padded = ModelRunner.logits(r, h, pad=True)
        assert r.model.calls[-1] == ModelRunner.logits_rows(m)
        assert padded.shape == (m, 50)
        torch.testing.assert_close(padded, r.model.compute_logits(h), rtol=1e-5, atol=1e-6)
    ModelRunner.logits(r, torch.randn(3, 24))  # on the CPU: not padded unless asked
    assert r.model.calls[-1] == 3


def test_start_up_warms_every_row_count_a_step_can_run():
    r = fake_runner(max_num_seqs=40, drafts=2)  # verify steps: up to 40 x 3 rows
    ModelRunner.warm_logits(r)
    assert r.model.calls == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    want = {ModelRunner.logits_rows(m) for m in range(1, 121)}
    assert set(r.model.calls) == want
    r = fake_runner(max_num_seqs=20)  # no speculative decoding: the config has no spec section
    ModelRunner.warm_logits(r)
    assert r.model.calls == [1, 2, 4, 8, 16, 32]
