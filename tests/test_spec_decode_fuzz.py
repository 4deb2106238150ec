"""The engine fuzz test (tests/test_engine_fuzz.py) with speculative decoding: the checking
executor's model verifies the scheduled drafts (accepting the prefix its next-token function
agrees with) and proposes new ones (right or wrong at random), writes the KV of every scheduled
token, rejected drafts included, into its shadow cache and, as a draft model or an MTP layer
does, writes its lookahead slots too. A rollback that leaves a rejected draft's KV in place, a block handed out
while a proposer still writes to it, or a leaked block fails the test; the outputs must equal
a plain run's."""
import random

import pytest

from rankserve.runtime.model_runner import ModelRunnerOutput

from conftest import STORIES_EMBEDDED
from test_engine_fuzz import HOST_BLOCKS, CheckingExecutor, engine_for, make_trace, run_trace
from test_engine_fuzz import tokenizer  # noqa: F401 - the fixture

K = 3


class SpecCheckingExecutor(CheckingExecutor):
    def __init__(self, *args, lookahead: int = 0, seed: int = 0, **kw):
        super().__init__(*args, **kw)
        self.lookahead = lookahead
        self.rng = random.Random(seed)

    def continuation(self, seq, n):
        seq = list(seq)
        for _ in range(n):
            seq.append(self.next_token(seq))
        return seq[-n:] if n else []

    def submit(self, plan) -> ModelRunnerOutput:
        self.run_copies(plan)
        for rid in plan.finished_req_ids:
            self.reqs.pop(rid, None)
        start = {}
        for r in plan.new_reqs:
            assert r.req_id not in self.reqs, f"{r.req_id} sent as new twice"
            self.reqs[r.req_id] = dict(tokens=list(r.token_ids), known=len(r.token_ids),
                                       blocks=list(r.block_ids))
            start[r.req_id] = r.num_computed_tokens
        for r in plan.cached_reqs:
            st = self.reqs[r.req_id]
            for k, t in enumerate(r.new_token_ids):  # what we emitted (placeholders until now)
                pos = st["known"] + k
                assert pos < len(st["tokens"]) and st["tokens"][pos] == t, f"{r.req_id}: token {pos}"
            st["known"] += len(r.new_token_ids)
            if r.num_blocks >= 0:  # blocks given back after rejected drafts
                st["blocks"] = st["blocks"][:r.num_blocks - len(r.new_block_ids)]
            st["blocks"] += r.new_block_ids
            start[r.req_id] = r.num_computed_tokens
        req_ids, sampled, accepted, proposals = [], [], [], []
        for rid, n in plan.num_scheduled_tokens.items():
            st, s = self.reqs[rid], start[rid]
            drafts = plan.spec_token_ids.get(rid, [])
            known = st["tokens"]  # with async scheduling, the last ones may be placeholders
            assert not drafts or len(known) == st["known"], f"{rid}: drafts after placeholders"
            seq = known + drafts
            end = s + n
            assert end <= len(seq) and (not drafts or end == len(seq)), f"{rid}: inputs"
            for pos in range(s, end):
                self.kv[(st["blocks"][pos // self.bs], pos % self.bs)] = (pos, seq[pos])
            for pos in range(0, end):  # attention reads the whole context
                got = self.kv.get((st["blocks"][pos // self.bs], pos % self.bs))
                assert got == (pos, seq[pos]), f"{rid}: KV of position {pos} is {got}"
            if end < len(known):
                continue  # a prefill chunk
            emitted = []
            for j in range(len(drafts) + 1):
                t = self.next_token(seq[:len(known) + j])
                emitted.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            st["tokens"] = known + emitted
            # the proposer writes its own KV past the emitted tokens (a draft model's lookahead)
            last = len(st["tokens"]) - 1
            ahead = min(self.lookahead, self.max_model_len - last)
            assert len(st["blocks"]) * self.bs >= last + ahead, f"{rid}: lookahead slots not reserved"
            for pos in range(last, last + ahead):
                self.kv[(st["blocks"][pos // self.bs], pos % self.bs)] = (pos, -1)
            # half the proposals right, the rest wrong from a random position on
            right = self.continuation(st["tokens"], K)
            cut = K if self.rng.random() < 0.5 else self.rng.randrange(K)
            prop = right[:cut] + [(t + 1) % self.vocab_size for t in right[cut:]]
            req_ids.append(rid)
            sampled.append(emitted[-1])
            accepted.append(emitted[:-1])
            proposals.append(prop[:self.rng.randrange(K + 1)])
        return ModelRunnerOutput(req_ids, sampled, accepted=accepted, draft_token_ids=proposals)


COMBOS = {"chunked-cache": ("fcfs", False, True, True), "priority-async-chunked": ("priority", True, True, False),
          "async-whole-cache": ("fcfs", True, False, True),
          "async-chunked-cache-host": ("priority", True, True, True, True)}  # (host tier: n-gram only)


@pytest.mark.parametrize("combo,method", [
    pytest.param(COMBOS[c], m, id=f"{m}-{c}") for c in COMBOS
    for m in (["ngram"] if c.endswith("host") else ["ngram", "draft_model", "mtp"])])
def test_spec_traces_keep_invariants_no_leaks_same_outputs(combo, method, tokenizer):  # noqa: F811
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = str(STORIES_EMBEDDED)  # the checking executor never loads it
    # a draft model writes k slots past the last emitted token's, an MTP layer k - 1
    lookahead = {"draft_model": K, "mtp": K - 1}.get(method, 0)
    drafted = 0
    for seed in range(6):
        trace, aborts = make_trace(seed, 96)
        try:
            ex = SpecCheckingExecutor(13, 8, 96, HOST_BLOCKS if len(combo) > 4 else 0,
                                      lookahead=lookahead, seed=seed)
            tight = engine_for(combo, num_blocks=13, executor=ex, speculative_config=spec)
            got, aborted = run_trace(tight, trace, aborts, tokenizer)
            assert tight.scheduler.num_preemptions > 0 or seed > 0 or not combo[2]
            kv = tight.scheduler.kv
            assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
            drafted += tight.scheduler.spec.num_accepted_tokens
            free = engine_for(("fcfs", False, True, False), num_blocks=1000)
            want, _ = run_trace(free, trace, {}, tokenizer)
            for rid, outs in want.items():
                if rid not in aborted:
                    assert got[rid] == outs, rid
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, combo {combo}: {e}") from e
    assert drafted > 50


@pytest.mark.parametrize("long_pause", [False, True], ids=["ngram", "model_drafter"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_drafts_that_are_never_accepted_back_off(tokenizer, use_async, long_pause):  # noqa: F811
    """A proposer that is always wrong: after 4 verify passes that accepted nothing a request
    pauses drafting for 2, 4, ... 64 steps (the plan tells the proposer to skip its work); a
    drafter that runs a model (draft model, MTP, EAGLE: `long_pause`) pauses 64 steps at once
    after 3 rejected verify passes of a request that never had a draft accepted (11 verify
    passes a 250-token request otherwise: -7.5 % for MTP k = 3 on the H200). So useless drafts
    cost a verify pass on few steps, and with async scheduling the paused
    request runs ahead (scheduled before its last token is back); the outputs stay those of a
    plain run."""
    class Wrong(SpecCheckingExecutor):
        skipped = ahead = 0

        def submit(self, plan):
            self.ahead += any(len(self.reqs[r.req_id]["tokens"]) > self.reqs[r.req_id]["known"]
                              + len(r.new_token_ids) for r in plan.cached_reqs)
            out = super().submit(plan)
            self.skipped += plan.skip_proposals
            out.draft_token_ids = [[(t + 1) % self.vocab_size for t in self.continuation(
                self.reqs[r]["tokens"], K)] for r in out.req_ids]
            return out
    from rankserve.runtime.sampling_params import SamplingParams
    ex = Wrong(100, 8, 300)
    eng = engine_for(("fcfs", use_async, True, True), num_blocks=100, max_model_len=300, executor=ex,
                     speculative_config={"method": "ngram", "num_speculative_tokens": K})
    eng.scheduler.spec_long_pause = long_pause
    trace = [(0, "a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=250, ignore_eos=True), 0)]
    got, _ = run_trace(eng, trace, {}, tokenizer)
    want, _ = run_trace(engine_for(("fcfs", False, True, False), num_blocks=1000, max_model_len=300),
                        trace, {}, tokenizer)
    assert got == want
    s = eng.scheduler.spec
    assert s.num_accepted_tokens == 0 and s.num_drafts == (6 if long_pause else 11), s.num_drafts
    assert ex.skipped > 150
    assert (ex.ahead > 150) == use_async, ex.ahead


def test_backoff_rules():
    """With a drafter that runs a model, a request none of whose drafts was ever accepted
    pauses 64 steps after 3 rejected verify passes; once one was accepted, only 4 misses in a
    row pause it, for 2, 4, ... steps (a useful drafter's unlucky streak costs little); empty
    proposals, and n-gram's misses, follow the latter rule."""
    from types import SimpleNamespace

    from rankserve.runtime.scheduler import SPEC_MAX_PAUSE, Scheduler

    def run(events, long_pause=True):
        req = SimpleNamespace(spec_misses=0, spec_rejects=0, spec_pause=0)  # (Request's fields)
        pauses = []
        for ev in events:  # "h": verify that accepted, "m": rejected verify, "e": empty proposal
            req.spec_pause = 0
            Scheduler._count_miss(req, ev == "h", verified=ev != "e", long_pause=long_pause)
            pauses.append(req.spec_pause)
        return pauses

    assert run("mmm") == [0, 0, SPEC_MAX_PAUSE]
    assert run("mmmm") == [0, 0, SPEC_MAX_PAUSE, SPEC_MAX_PAUSE]
    assert run("hmmmm") == [0, 0, 0, 0, 2]
    assert run("hmmmmm") == [0, 0, 0, 0, 2, 4]
    assert run("mhmmmm") == [0, 0, 0, 0, 0, 2]
    assert run("eeeee") == [0, 0, 0, 2, 4]
    assert run("emmmm") == [0, 0, 0, SPEC_MAX_PAUSE, SPEC_MAX_PAUSE]
    assert run("mmhmmmm") == [0, 0, 0, 0, 0, 0, 2]
    assert run("mmmmmm", long_pause=False) == [0, 0, 0, 2, 4, 8]
