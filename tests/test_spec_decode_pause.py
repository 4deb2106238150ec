"""Speculative decoding backoff (issue 16, "no slowdown worse than 5% when proposals are never
accepted"): while the scheduler pauses a request's drafting, the proposer does no work for it
(no draft-model forward, no MTP / EAGLE pass), nor for the verify pass that makes it pause;
when the pause ends, it catches up on the
positions it missed, so its drafts equal those of a proposer that never paused (a from-scratch
reference over the whole context). Drafters with random weights: their drafts are (almost)
never accepted, so requests pause and resume many times."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankserve import LLM, SamplingParams
from rankserve.runtime.spec_decode import DraftModelProposer, EagleProposer, MTPProposer

from conftest import STORIES_EMBEDDED
from test_deepseek import _mtp_checkpoint
from test_spec_decode import stories_draft
from test_spec_decode_eagle import _reference_drafts as eagle_reference
from test_spec_decode_eagle import eagle3_head
from test_spec_decode_mtp import _reference_drafts as mtp_reference

PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11]]


def _generate(llm, prompts, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp)


def _greedy(llm, prompts, n):
    return [o.outputs[0].token_ids for o in _generate(llm, prompts, n)]


class Spy:
    """Per step of the runner: the plan's paused / scheduled requests and the proposer work
    done in it (`calls` counted by the patched methods, tokens caught up)."""

    def __init__(self, llm, monkeypatch, proposer_cls, work: list[str]):
        # many short pauses (the 4-miss rule; drafts never accepted would pause 64 steps after
        # 2 rejected verify passes: few resumes in 90 tokens)
        monkeypatch.setattr("rankserve.runtime.scheduler.SPEC_FIRST_REJECTS", 10 ** 6)
        self.calls, self.steps, self.caught, self.seen, self.resumed = 0, [], 0, [], set()
        self.verified, self.proposed = [], []  # (request, drafts) scheduled / proposed
        runner = llm.engine.executor.runner
        self.proposer = runner.proposer
        real_execute = runner.execute

        def execute(plan, *a, **kw):
            before = self.calls
            out = real_execute(plan, *a, **kw)
            self.steps.append((set(plan.spec_paused), set(plan.num_scheduled_tokens), self.calls - before))
            self.verified += [(rid, list(d)) for rid, d in plan.spec_token_ids.items()]
            return out
        monkeypatch.setattr(runner, "execute", execute)
        target = self.proposer.model if proposer_cls is not DraftModelProposer else None
        for name in work:  # the proposer's model forwards
            obj = target if target is not None and hasattr(target, name) else self.proposer
            real = getattr(obj, name)

            def counted(*a, _real=real, **kw):
                self.calls += 1
                return _real(*a, **kw)
            monkeypatch.setattr(obj, name, counted)
        real_catch_up = proposer_cls.catch_up

        def catch_up(p, inp, idx, p0, p1):
            self.caught += int((p1 - p0).sum())
            rows = set(inp.rows[idx].tolist())
            self.resumed |= {rid for rid, st in p.runner.batch.reqs.items() if st.row in rows}
            return real_catch_up(p, inp, idx, p0, p1)
        monkeypatch.setattr(proposer_cls, "catch_up", catch_up)
        real_propose = proposer_cls.propose

        def propose(p, ctx):  # (request, context length, drafts, first after a catch-up): see `run`
            out = real_propose(p, ctx)
            _, acc = ctx.host()
            for rid, base, a, d in zip(ctx.req_ids, ctx.base_pos, acc, out):
                if d:
                    self.seen.append((rid, int(base) + a + 1, d, rid in self.resumed))
                    self.proposed.append((rid, list(d)))
                    self.resumed.discard(rid)
            return out
        monkeypatch.setattr(proposer_cls, "propose", propose)

    def run(self, llm, prompts, n):
        """Greedy outputs; `seen` becomes (context, drafts) (a step that ran ahead has its
        last input token on the device only: the context comes from the final sequences)."""
        outs = _generate(llm, prompts, n)
        seqs = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
        self.seen = [(seqs[rid][:m], d, resumed) for rid, m, d, resumed in self.seen]
        return [o.outputs[0].token_ids for o in outs]

    def check(self):
        paused_steps = [w for paused, ids, w in self.steps if paused == ids]
        assert len(paused_steps) > 20, "the drafts should be rejected and the requests pause"
        assert sum(paused_steps) == 0, "a step whose requests all pause runs no proposer work"
        assert self.caught > 20, self.caught  # resumed requests caught up
        assert sum(r for *_, r in self.seen) >= 5  # proposals right after a catch-up
        # steps where some requests pause and others draft (the chunked prefills of prompts of
        # different lengths put them out of phase)
        assert any(paused and paused != ids for paused, ids, _ in self.steps)
        # proposals that are never verified: a verify pass that pauses its request proposes
        # nothing (without that, about 2 of 3 proposals here were dropped)
        wasted = len(self.proposed) - len(self.verified)
        assert 0 <= wasted <= len(self.verified) // 4, (wasted, len(self.verified))

    def sample(self, n: int):
        """The proposals right after a catch-up, and others up to n."""
        first = [s for s in self.seen if s[2]]
        rest = [s for s in self.seen if not s[2]]
        return first + rest[::max(1, len(rest) // max(n - len(first), 1))]


def random_draft(path) -> str:
    """stories260K's first layer with random weights: same tokenizer, drafts never accepted."""
    d = stories_draft(path, num_layers=1)
    g = torch.Generator().manual_seed(1)
    w = load_file(f"{d}/model.safetensors")
    save_file({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in w.items()}, f"{d}/model.safetensors")
    return d


COMMON = dict(dtype="float32", max_num_seqs=4, kv_cache_memory_gb=0.05, max_model_len=160,
              async_scheduling=True, max_num_batched_tokens=16)


def test_draft_model_does_no_work_while_paused_and_catches_up(tmp_path, monkeypatch, common=COMMON):
    """The draft runs no forward in steps whose requests all pause, and a request that resumes
    gets the drafts of a draft model that saw every token (its greedy continuation). Async
    scheduling, a budget of 16 tokens: the catch-up spreads over steps (8 tokens a step)."""
    draft = random_draft(tmp_path / "draft")
    want = _greedy(LLM(str(STORIES_EMBEDDED), **common), PROMPTS, 90)
    llm = LLM(str(STORIES_EMBEDDED), **common,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    spy = Spy(llm, monkeypatch, DraftModelProposer, ["compiled"])
    assert spy.run(llm, PROMPTS, 90) == want
    spy.check()
    assert llm.engine.scheduler.stats().spec_num_accepted_tokens <= 2
    # the reference: the draft model decoding greedily from each context
    ref = LLM(draft, dtype="float32", max_num_seqs=8, kv_cache_memory_gb=0.05, max_model_len=160)
    got = _greedy(ref, [c for c, *_ in spy.seen], 3)
    assert len(spy.seen) > 10
    for (context, drafts, _), r in zip(spy.seen, got):
        assert r[:len(drafts)] == drafts, f"context of {len(context)}"


@pytest.fixture(scope="module")
def mtp_dir(checkpoint, tmp_path_factory):
    return _mtp_checkpoint(tmp_path_factory.mktemp("mtp"), checkpoint("DeepseekV3ForCausalLM"))[0]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_pair_proposers_do_no_work_while_paused_and_catch_up(method, mtp_dir, checkpoint, tmp_path,
                                                             monkeypatch, common=COMMON, reference=True):
    """MTP / EAGLE-3 (async scheduling, budget 16): no pass in steps whose requests all pause
    (the target's states go to the ring), and every proposal right after a pause (and others)
    equals the reference's from scratch (the missed pairs were stored from the ring)."""
    if method == "mtp":
        target, spec, cls = mtp_dir, {"method": "mtp", "num_speculative_tokens": 2}, MTPProposer
        work = ["compiled", "stores", "mtp_store_kv"]  # passes, a step's stores, catch-ups
    else:
        target = checkpoint("LlamaForCausalLM")
        head = eagle3_head(tmp_path / "h", aux_ids=[2, 0, 1])
        spec, cls = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}, EagleProposer
        work = ["compiled"]
    want = _greedy(LLM(target, **common), PROMPTS, 90)
    llm = LLM(target, **common, speculative_config=spec)
    spy = Spy(llm, monkeypatch, cls, work)
    assert spy.run(llm, PROMPTS, 90) == want
    spy.check()
    assert len(spy.seen) > 10
    if not reference:  # (the references run on the host)
        return
    p = spy.proposer  # (its caches are scratch now)
    if method == "eagle3":  # the reference runs whole contexts: a capture buffer that fits them
        inner = p.runner.model.model
        p.aux = inner.aux_out = torch.zeros(200, p.aux.shape[1], dtype=p.aux.dtype)
    for context, drafts, _ in spy.sample(16):
        ref = mtp_reference(p.model, context, len(drafts)) if method == "mtp" \
            else eagle_reference(p, context, len(drafts))
        assert ref == drafts, f"context of {len(context)}"



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["draft_model", "mtp", "eagle3"])
def test_gpu_pause_and_catch_up_with_graphs(method, mtp_dir, checkpoint, tmp_path, monkeypatch):
    """The same on the GPU: the steady state replays the proposers' CUDA graphs, the subset and
    catch-up passes stage through pinned memory, the ring is written on the device (the MTP /
    EAGLE references run on the host: checked by the CPU tests)."""
    from rankserve.runtime.compilation import CompiledModel
    common = {**COMMON, "gpu_memory_utilization": 0.3}
    common.pop("kv_cache_memory_gb")
    replays = []  # the models whose decode graphs replayed
    real = CompiledModel._run_graph

    def counted(self, *a):
        out = real(self, *a)
        if out is not None:
            replays.append(type(self.model).__name__)
        return out
    monkeypatch.setattr(CompiledModel, "_run_graph", counted)
    if method == "draft_model":
        test_draft_model_does_no_work_while_paused_and_catches_up(tmp_path, monkeypatch, common)
    else:
        test_pair_proposers_do_no_work_while_paused_and_catch_up(method, mtp_dir, checkpoint, tmp_path,
                                                                 monkeypatch, common, reference=False)
        drafter = {"mtp": "MTPDrafter", "eagle3": "Eagle3LlamaForCausalLM"}[method]
        assert replays.count(drafter) > 10, "the drafting passes should replay CUDA graphs"
