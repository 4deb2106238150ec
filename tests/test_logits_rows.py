"""The logits GEMM runs at a few row counts (ModelRunner.logits_rows), each warmed at start-up, so
that no step of a server's first burst meets a GEMM shape cuBLAS has not run yet (its kernels
load lazily and the call blocks the host for milliseconds: benchmarks/2026-12-04-h200-s12).
The speculative proposers' own logits GEMMs (draft model, EAGLE head, MTP layer: one state a
proposing request, a row count that changes every step) run at the same rows and are warmed
too."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rankserve import LLM
from rankserve.runtime import model_runner
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


# ---- the speculative proposers' own logits ------------------------------------------------------
COMMON = dict(dtype="float32", max_num_seqs=4, kv_cache_memory_gb=0.05, max_model_len=128)
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11]]  # 3 proposing requests


@pytest.fixture(scope="module")
def spec_targets(checkpoint, tmp_path_factory):
    """kind -> (target checkpoint, speculative config): every proposer with a logits GEMM."""
    from test_deepseek import _mtp_checkpoint
    from test_spec_decode_eagle import eagle1_head, eagle3_head
    tmp = tmp_path_factory.mktemp("spec_rows")
    llama, llama7 = checkpoint("LlamaForCausalLM"), checkpoint("LlamaForCausalLM", num_hidden_layers=7)
    mtp = _mtp_checkpoint(tmp, checkpoint("DeepseekV3ForCausalLM"))[0]
    k = dict(num_speculative_tokens=3)
    return {"draft_model": (llama, dict(method="draft_model", model=llama, **k)),
            "eagle": (llama, dict(method="eagle", model=eagle1_head(tmp / "e1"), **k)),
            "eagle3": (llama7, dict(method="eagle3", model=eagle3_head(tmp / "e3"), **k)),
            "mtp": (mtp, dict(method="mtp", **k))}


def _spy(p, calls: list) -> None:
    """Record the rows of every call of each of the proposer's logits GEMMs."""
    name = "mtp_logits" if p.params.method == "mtp" else "compute_logits"  # (MTP: the target's)
    real = getattr(p.model, name)
    setattr(p.model, name, lambda h, *a, _real=real: calls.append(h.shape[0]) or _real(h, *a))


KINDS = ["draft_model", "eagle", "eagle3", "mtp"]


@pytest.mark.parametrize("kind", KINDS)
def test_proposers_run_their_logits_at_the_padded_rows(kind, spec_targets, monkeypatch):
    """3 requests propose at once: the draft logits run at 4 rows (padding forced, as on CUDA),
    never at 3, and the drafts (greedy output) stay those of unpadded logits."""
    from test_spec_decode_mtp import _greedy
    target, spec = spec_targets[kind]
    want = _greedy(LLM(target, **COMMON, speculative_config=spec), PROMPTS, 12)
    real = model_runner.padded_logits  # padding forced (the target's logits too)
    monkeypatch.setattr(model_runner, "padded_logits", lambda fn, h, pad=None: real(fn, h, True))
    llm = LLM(target, **COMMON, speculative_config=spec)
    calls: list[int] = []
    _spy(llm.engine.executor.runner.proposer, calls)
    assert _greedy(llm, PROMPTS, 12) == want
    assert calls and 4 in calls, calls
    assert all(ModelRunner.logits_rows(m) == m for m in calls), calls


@pytest.mark.parametrize("kind", KINDS)
def test_proposers_warm_every_row_count_their_logits_run_at(kind, spec_targets):
    target, spec = spec_targets[kind]
    llm = LLM(target, **{**COMMON, "max_num_seqs": 40}, speculative_config=spec)
    p = llm.engine.executor.runner.proposer
    calls: list[int] = []
    _spy(p, calls)
    p.warm_logits()
    assert calls == [1, 2, 4, 8, 16, 32, 48]  # one state a request: up to max_num_seqs rows
    assert set(calls) == {ModelRunner.logits_rows(m) for m in range(1, 41)}


def test_start_up_warms_the_proposers_logits_on_cuda_only():
    calls = []
    r = SimpleNamespace(compiled_model=SimpleNamespace(compile=lambda mixed: {}), timings={},
                        proposer=SimpleNamespace(compile=lambda: {}, warm_logits=lambda: calls.append("draft")),
                        warm_logits=lambda: calls.append("target"), device=torch.device("cpu"),
                        pi=SimpleNamespace(is_last_stage=True))
    ModelRunner.compile(r)
    assert calls == []
    r.device = torch.device("cuda")
    ModelRunner.compile(r)
    assert calls == ["target", "draft"] and "logits_warmup" in r.timings
