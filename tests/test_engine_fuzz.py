"""The real EngineCore under pressure: seeded, bounded random traces (arrivals, aborts, n > 1,
stop strings, priorities, follow-up turns of finished conversations, tight KV budgets that
force preemption) through every combination of
policy × async scheduling × chunked prefill × prefix caching (× a small host KV tier, with
caching). After every step the scheduler's and the KV cache's invariants are checked; at the end
every request has finished and the greedy outputs equal those of an unconstrained run.

`CheckingExecutor` is a model whose next token is a hash of the whole sequence, and a runner
that keeps the same per-request state as `ModelRunner` (token ids, block table, async
placeholders) plus a shadow KV cache: every step it checks that each sampled position attends to
exactly the tokens of its own sequence, so a block handed out twice, a prefix-cache hit on a
block that was never written, or a placeholder that differs from the token the scheduler later
sends, fails the test. With the host tier it also keeps a shadow host cache and runs the plans'
block copies (device → host, then host → device) before the step, so a copy from a block that
was already overwritten, or a load of a host block that holds other tokens, fails the same way.
After every step of a tight engine each block the prefix cache (either tier) can hand out must
hold the tokens its hash stands for, so a stale entry fails when it is made, hit or not.
One combination per policy also runs the real stories260K model (the priority one with the host
tier: the runner's real copies).
"""
import itertools
import random
import zlib

import msgspec
import numpy as np
import pytest

from rankserve.runtime.config import EngineConfig
from rankserve.runtime.engine_core import EngineCore
from rankserve.runtime.messages import EngineCoreRequest
from rankserve.runtime.outputs import OutputProcessor
from rankserve.runtime.sampling_params import SamplingParams
from rankserve.runtime.model_runner import ModelRunnerOutput

from conftest import STORIES_EMBEDDED

VOCAB = 512  # stories260K's tokenizer, so stop strings are matched on real text
EOS = 2


class CheckingExecutor:
    device = None
    max_in_flight = 1
    timings: dict = {}

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, num_host_blocks: int = 0,
                 window: int = 0):
        self.num_blocks, self.bs = num_blocks, block_size
        self.kv_sliding_window = window  # > 0: attention reads only the window (see below)
        self.num_host_blocks = num_host_blocks
        self.host: dict[tuple[int, int], tuple[int, int]] = {}  # (host block, offset) → (pos, token)
        self.max_model_len, self.vocab_size = max_model_len, VOCAB
        self.reqs: dict[str, dict] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) → (pos, token)

    def determine_num_blocks(self):
        return self.num_blocks

    def initialize(self, num_blocks):
        pass

    def shutdown(self):
        pass

    def collect(self, out):
        return out

    @staticmethod
    def next_token(seq) -> int:
        return zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes()) % VOCAB

    def run_copies(self, plan) -> None:
        """The plan's host-tier copies, device → host, then host → device."""
        for src, dst, a, b in [(self.kv, self.host, d, h) for d, h in plan.blocks_to_host] + \
                [(self.host, self.kv, h, d) for h, d in plan.blocks_from_host]:
            for off in range(self.bs):
                if (a, off) in src:
                    dst[(b, off)] = src[(a, off)]
                else:
                    dst.pop((b, off), None)

    def submit(self, plan) -> ModelRunnerOutput:
        self.run_copies(plan)
        outgoing = {d for d, _ in plan.blocks_to_host}
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
            for k, t in enumerate(r.new_token_ids):  # placeholders must have been right
                pos = st["known"] + k
                if pos < len(st["tokens"]):
                    assert st["tokens"][pos] == t, f"{r.req_id}: placeholder {pos} differs"
                else:
                    st["tokens"].append(t)
            st["known"] += len(r.new_token_ids)
            st["blocks"] += r.new_block_ids
            start[r.req_id] = r.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in plan.num_scheduled_tokens.items():
            st, s = self.reqs[rid], start[rid]
            end = s + n
            assert len(st["blocks"]) * self.bs >= end, f"{rid}: too few blocks"
            assert end <= len(st["tokens"]), f"{rid}: input token {len(st['tokens'])} unknown"
            for pos in range(s, end):
                blk = st["blocks"][pos // self.bs]
                # on the GPU the copies run beside the forward: it must wait to overwrite one
                assert blk not in outgoing or plan.wait_for_copies, f"block {blk} copied out unawaited"
                self.kv[(blk, pos % self.bs)] = (pos, st["tokens"][pos])
            # what attention reads: everything, or with a window the keys of this step's queries
            lo = max(0, s - self.kv_sliding_window + 1) if self.kv_sliding_window else 0
            if end >= st["known"] or self.kv_sliding_window:
                for pos in range(lo, end):
                    got = self.kv.get((st["blocks"][pos // self.bs], pos % self.bs))
                    assert got == (pos, st["tokens"][pos]), f"{rid}: KV of position {pos} is {got}"
            if end >= st["known"]:
                tok = self.next_token(st["tokens"][:end])
                if end == len(st["tokens"]):
                    st["tokens"].append(tok)
                req_ids.append(rid)
                sampled.append(tok)
        return ModelRunnerOutput(req_ids, sampled)

    def check_cached(self, kv, hashes: dict) -> None:
        """Every block the prefix cache can hand out (device, or host tier once its copy has
        run) holds the KV of the tokens its hash stands for (`hashes`: hash → (block index,
        tokens)), so a stale entry fails when it is made, not only when a hit reads it."""
        bs = self.bs
        for where, store, entries in [("device", self.kv, {h: b.block_id for h, b in kv.pool.cached.items()})] + (
                [("host", self.host, kv.offload.tier.lru)] if kv.offload is not None else []):
            queued = {h for _, h in kv.offload.to_host} if where == "host" else set()
            for h, bid in entries.items():
                i, tokens = hashes[h]
                if bid not in queued:
                    for k in range(bs):
                        got = store.get((bid, k))
                        assert got == (i * bs + k, tokens[k]), \
                            f"{where} block {bid} is cached as block {i} but holds {got} at slot {k}"


def record_hashes(kv) -> dict:
    """hash → (block index, tokens) of every block hash the KV manager computes."""
    hashes, real = {}, kv.update_hashes

    def update_hashes(req):
        start = len(req.block_hashes)
        real(req)
        bs = kv.block_size
        for i in range(start, len(req.block_hashes)):
            hashes[req.block_hashes[i]] = (i, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
    kv.update_hashes = update_hashes
    return hashes


# (policy, async, chunked, caching, host tier); the host tier needs caching
COMBOS = [c + (off,) for c in itertools.product(("fcfs", "priority"), (False, True), (False, True),
                                                (False, True)) for off in (False, True) if c[3] or not off]


def make_trace(seed: int, max_model_len: int):
    """[(arrival step, request id, prompt ids, SamplingParams, priority)] and abort steps."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    reqs, step = [], 0
    for i in range(rng.randrange(8, 20)):
        step += rng.choice((0, 0, 1, 3))
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + \
            [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 24))]
        prompt = prompt[:max_model_len - 2]
        sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30),
                            n=rng.choice((1, 1, 1, 2)), ignore_eos=rng.random() < 0.5,
                            stop=["e "] if rng.random() < 0.2 else [],
                            stop_token_ids=[rng.randrange(3, VOCAB)] if rng.random() < 0.2 else [])
        reqs.append((step, f"r{i}", prompt, sp, rng.randrange(4)))
    aborts = {rng.randrange(0, step + 30): rng.randrange(len(reqs)) for _ in range(rng.randrange(3))}
    return reqs, aborts


def follow_up(rid: str, prompt: list[int], sp: SamplingParams, out: list[int], max_model_len: int):
    """The next turn of a finished greedy conversation (one of three, by id): its prompt and
    first choice's output, continued. Its prefix hits read blocks that hold output tokens, so a
    block left cached without its KV written fails the shadow check."""
    if sp.temperature != 0 or zlib.crc32(rid.encode()) % 3:
        return None
    extra = [3 + zlib.crc32(f"{rid}{k}".encode()) % (VOCAB - 3) for k in range(1 + len(out) % 5)]
    prompt = (prompt + out + extra)[-(max_model_len - 8):]
    return rid + "+", prompt, msgspec.structs.replace(sp, n=1, max_tokens=min(sp.max_tokens, 6))


def run_trace(engine: EngineCore, trace, aborts, tokenizer, max_steps=4000, follow_ups=False):
    """Run the trace; `follow_ups`: a finished request may send its next turn (`follow_up`);
    those of aborted requests count as aborted."""
    proc = OutputProcessor(tokenizer)
    pending = list(trace)
    prompts = {rid: (p, sp) for _, rid, p, sp, _ in trace}
    results, live, aborted = {}, {}, set()
    # (the tight engines: a check of every cached block each step is slow for a large cache)
    checking = isinstance(engine.executor, CheckingExecutor) and engine.scheduler.kv.num_blocks <= 64
    hashes = record_hashes(engine.scheduler.kv) if checking else {}
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, rid, prompt, sp, prio = pending.pop(0)
            children = proc.add_request(rid, None, prompt, sp)
            live[rid] = children
            for _i, cid in enumerate(children):
                engine.add_request(EngineCoreRequest(cid, prompt, sp, float(step), prio,
                                                     eos_token_id=EOS))
        if step in aborts:
            rid = trace[aborts[step]][1]
            if rid in live:
                engine.abort_requests(live[rid])
                proc.abort(live.pop(rid))
                aborted.add(rid)
        outs = engine.step()
        engine.scheduler.check_invariants()
        if checking:
            engine.executor.check_cached(engine.scheduler.kv, hashes)
        for o in outs.outputs:
            ro, abort = proc.process(o)
            if abort:
                engine.abort_requests([o.request_id])
            if ro is not None and ro.finished and ro.request_id in live:
                rid = ro.request_id
                del live[rid]
                results[rid] = [(c.token_ids, c.text, c.finish_reason) for c in ro.outputs]
                nxt = follow_ups and follow_up(rid, *prompts[rid], list(ro.outputs[0].token_ids),
                                               engine.max_model_len)
                if nxt:
                    prompts[nxt[0]] = nxt[1:]
                    pending.insert(0, (step + 1, *nxt, 0))
        if not pending and not live and not engine.has_work:
            break
    assert not live and not engine.has_work, f"stuck after {max_steps} steps: {sorted(live)}"
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return results, aborted


HOST_BLOCKS = 10  # fewer than the tight device tier's 13: the host tier evicts too
STORIES_BLOCK_BYTES = 2 * 8 * 4 * 8 * 4 * 5  # K and V, 8 tokens, 4 KV heads × 8, fp32, 5 layers


def engine_for(combo, num_blocks, block_size=8, max_model_len=96, executor=None, **extra):
    policy, use_async, chunked, caching, offload = combo + (False,) * (5 - len(combo))
    extra = dict(dict(max_num_batched_tokens=max_model_len if not chunked else 24, max_num_seqs=6), **extra)
    cfg = EngineConfig.from_kwargs(
        model=str(STORIES_EMBEDDED), scheduling_policy=policy, async_scheduling=use_async,
        enable_chunked_prefill=chunked, enable_prefix_caching=caching, block_size=block_size,
        max_model_len=max_model_len, num_gpu_blocks_override=num_blocks,
        kv_offload_size=(HOST_BLOCKS + 0.5) * STORIES_BLOCK_BYTES / 2**30 if offload else None, **extra)
    return EngineCore(cfg, executor or CheckingExecutor(num_blocks, block_size, max_model_len,
                                                        HOST_BLOCKS if offload else 0))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(STORIES_EMBEDDED))


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(
    [c[0], "async" if c[1] else "sync", "chunked" if c[2] else "whole", "cache" if c[3] else "nocache"]
    + (["host"] if c[4] else [])))
def test_random_traces_keep_invariants_and_outputs(combo, tokenizer):
    loaded = 0
    for seed in range(6):
        trace, aborts = make_trace(seed, 96)
        try:
            tight = engine_for(combo, num_blocks=13)  # 104 slots: one full-length request + a bit
            got, aborted = run_trace(tight, trace, aborts, tokenizer, follow_ups=True)
            assert tight.scheduler.num_preemptions > 0 or seed > 0 or not combo[2]
            if combo[4]:
                loaded += tight.scheduler.stats().host_blocks_loaded
            free = engine_for(("fcfs", False, True, False), num_blocks=1000)
            want, _ = run_trace(free, trace, {}, tokenizer, follow_ups=True)
            for rid, outs in want.items():
                if rid.rstrip("+") in aborted:  # (and its follow-ups)
                    continue
                assert got[rid] == outs, rid
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, combo {combo}: {e}") from e
    assert loaded > 0 or not combo[4], "no prefix hit in the host tier in any trace"


@pytest.mark.parametrize("block_size,blocks,budget,seqs", [(8, 12, 1, 1), (8, 13, 3, 2), (16, 6, 2, 9),
                                                          (32, 3, 7, 5)])
@pytest.mark.parametrize("combo", [("fcfs", True, True, True), ("priority", False, True, True, True)],
                         ids=["async", "priority-host"])
def test_extreme_budgets_and_sequence_limits(combo, block_size, blocks, budget, seqs, tokenizer):
    """Steps of 1 to 7 tokens, one to nine sequences, blocks of 8 to 32 tokens in a cache of
    one full-length request: every chunking, preemption and decode order still gives the
    unconstrained run's outputs and leaks nothing."""
    for seed in range(3):
        trace, aborts = make_trace(200 + seed, 96)
        try:
            tight = engine_for(combo, num_blocks=blocks, block_size=block_size, executor=CheckingExecutor(
                blocks, block_size, 96, HOST_BLOCKS if len(combo) > 4 else 0),
                max_num_batched_tokens=budget, max_num_seqs=seqs)
            got, aborted = run_trace(tight, trace, aborts, tokenizer, max_steps=20000, follow_ups=True)
            want, _ = run_trace(engine_for(("fcfs", False, True, False), num_blocks=1000), trace, {},
                                tokenizer, follow_ups=True)
            for rid, outs in want.items():
                if rid.rstrip("+") not in aborted:
                    assert got[rid] == outs, rid
        except AssertionError as e:
            raise AssertionError(f"seed {200 + seed}: {e}") from e


@pytest.mark.parametrize("combo,window,blocks,seeds", [
    (("fcfs", False, True, True), 12, 13, 4), (("priority", True, True, True), 12, 13, 4),
    (("fcfs", True, False, False), 12, 13, 4), (("priority", False, True, True, True), 12, 13, 4),
    (("priority", False, True, True, True), 8, 6, 48)],
    ids=["sync-chunked-cache", "async-chunked-cache", "async-whole", "host", "host-tight"])
def test_sliding_window_traces(combo, window, blocks, seeds, tokenizer):
    """A model whose every layer has a 12-token window: blocks that leave the window go back to
    the pool (the shadow KV check reads exactly each step's window, so a released block that
    was still needed fails), with admission, preemption, aborts, prefix hits and the host tier;
    outputs equal an unconstrained run's. `host-tight`: an 8-token window in 5 usable blocks,
    where a request preempted after its step was planned (its first blocks already out of the
    window) left a block whose KV was never written in the prefix cache, found by a follow-up
    turn (seed 43)."""
    released = 0
    for seed in range(seeds):
        trace, aborts = make_trace(seed, 96)
        try:
            policy, use_async, chunked, caching, offload = combo + (False,) * (5 - len(combo))
            tight = engine_for(combo, num_blocks=blocks, executor=CheckingExecutor(
                blocks, 8, 96, HOST_BLOCKS if offload else 0, window=window))
            kv = tight.scheduler.kv
            assert kv.sliding_window == window and kv.num_blocks == blocks - 1  # block 0: null
            real = kv.release_outside_window

            def counting(req, n, real=real):  # blocks that left the window
                nonlocal released
                nulls = lambda: kv.req_blocks.get(req.request_id, []).count(kv.pool.null)  # noqa: E731
                before = nulls()
                real(req, n)
                released += nulls() - before
            kv.release_outside_window = counting
            got, aborted = run_trace(tight, trace, aborts, tokenizer, follow_ups=True)
            free = engine_for(("fcfs", False, True, False), num_blocks=1000)
            want, _ = run_trace(free, trace, {}, tokenizer, follow_ups=True)
            for rid, outs in want.items():
                if rid.rstrip("+") not in aborted:
                    assert got[rid] == outs, rid
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, combo {combo}: {e}") from e
    assert released > 20, released


@pytest.mark.parametrize("policy,kv", [("fcfs", "auto"), ("priority", "auto"), ("fcfs", "fp8")])
def test_real_model_under_pressure(policy, kv, tokenizer):
    """The same traces through the real stories260K runner (async + chunked + cached); with an
    fp8 KV cache too (both runs fp8: the cache's contents must not depend on how it was filled)."""
    from rankserve.runtime.executor import UniprocExecutor
    combo = (policy, True, True, True, policy == "priority")
    for seed in range(2):
        trace, aborts = make_trace(100 + seed, 96)
        try:
            cfg = engine_for(combo, 13, kv_cache_dtype=kv).cfg
            tight = EngineCore(cfg, UniprocExecutor(cfg))
            got, aborted = run_trace(tight, trace, aborts, tokenizer)
            assert len(tight.executor.runner.reqs) == 0 or not tight.has_work
            assert (tight.executor.runner.host_kv is not None) == combo[4]
            cfg = engine_for(("fcfs", False, True, False), 400, kv_cache_dtype=kv).cfg
            want, _ = run_trace(EngineCore(cfg, UniprocExecutor(cfg)), trace, {}, tokenizer)
            for rid, outs in want.items():
                if rid not in aborted:
                    assert got[rid] == outs, rid
        except AssertionError as e:
            raise AssertionError(f"seed {100 + seed}, policy {policy}, kv {kv}: {e}") from e


@pytest.mark.parametrize("arch,overrides,blocks", [("NemotronHForCausalLM", {}, 13),
                                                   ("MistralForCausalLM", dict(sliding_window=8), 6)],
                         ids=["hybrid", "window"])
def test_hybrid_and_window_models_under_pressure(arch, overrides, blocks, checkpoint, tokenizer):
    """Real Mamba2-hybrid and sliding-window models through a trace with aborts, n = 2, stop
    strings and seeded sampling, async + chunked + tight KV (preemptions; prefix caching, which
    the hybrid turns off): the unconstrained run's outputs, no KV block left held, and state
    rows (a hybrid's Mamba2 slots) held only by requests whose finish the next plan sends."""
    from rankserve.runtime.executor import UniprocExecutor
    path = checkpoint(arch, **overrides)

    def engine(**kw):
        cfg = EngineConfig.from_kwargs(model=path, dtype="float32", block_size=8, max_model_len=96,
                                       max_num_seqs=6, **kw)
        return EngineCore(cfg, UniprocExecutor(cfg))
    trace, aborts = make_trace(7, 96)
    trace = [(s, rid, p, msgspec.structs.replace(sp, temperature=0.9, seed=i), prio)
             for i, (s, rid, p, sp, prio) in enumerate(trace)]
    tight = engine(async_scheduling=True, max_num_batched_tokens=13, num_gpu_blocks_override=blocks)
    got, aborted = run_trace(tight, trace, aborts, tokenizer)
    assert tight.scheduler.num_preemptions > 0 and aborted
    assert set(tight.executor.runner.batch.reqs) <= set(tight.scheduler.finished_ids)
    want, _ = run_trace(engine(max_num_batched_tokens=96, num_gpu_blocks_override=100), trace, {}, tokenizer)
    for rid, outs in want.items():
        if rid not in aborted:
            assert got[rid] == outs, rid
