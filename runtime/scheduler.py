"""One token-budget scheduler (vLLM V1 semantics).

Every step gives tokens to requests so that `num_computed_tokens` catches up with `num_tokens`,
within `max_num_batched_tokens` and `max_num_seqs`. Prefill, chunked prefill, prefix-cache
extension and decode are the same rule and mix freely in one batch. When blocks run out the
lowest-priority (then latest) running request is preempted; with the host KV tier its full
blocks are swapped out (and copied back when it resumes) where that is cheaper than recomputing
them (runtime/preemption.py), else recomputed.

The step plan (`SchedulerOutput`) is what every rank's model runner receives: new requests in
full, running ones as deltas (new block ids, tokens appended since they were last scheduled).
"""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from .config import CacheConfig, SchedulerConfig
from .kv_cache import KVCacheManager
from .messages import (
    EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats)
from .request import Request, RequestStatus
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .model_runner import ModelRunnerOutput
    from .preemption import SwapCostModel
    from .structured_output import StructuredOutputManager


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    eos_token_id: int | None
    lora_request: object = None  # LoRARequest (runtime/messages.py) or None


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # appended since the runner last saw this request
    new_block_ids: list[int]
    num_computed_tokens: int
    # blocks the request holds after this plan (speculative decoding gives blocks back; -1:
    # the runner's count plus new_block_ids)
    num_blocks: int = -1


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)  # runner may drop their state
    # of those, the preempted ones: the runner keeps their seeded generators for their return
    preempted_req_ids: list[str] = field(default_factory=list)
    # structured outputs: allowed-token bits (int32 words, [rows, ceil(V / 32)]) for the
    # constrained requests that sample this step, a row per sampled position (one, or with
    # drafts one per draft and one more); only the last pipeline stage reads them
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_num_rows: int = 0
    grammar_bitmask: np.ndarray | None = None
    grammar_fill: Callable[..., object] | None = field(default=None, repr=False)
    grammar_future: object = field(default=None, repr=False)  # a fill running on the grammar thread
    grammar_stats: object = field(default=None, repr=False)  # the StructuredOutputManager (timers)
    # host KV tier (runtime/kv_offload.py): block copies every rank runs before the forward,
    # device → host first, then host → device; `wait_for_copies`: the forward waits for them
    # (it reads loaded blocks, or overwrites a block this plan copies out)
    blocks_to_host: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_from_host: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    wait_for_copies: bool = False
    # speculative decoding: draft tokens scheduled after each request's known tokens (their
    # count is in num_scheduled_tokens); the runner verifies them in this step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # requests that pause drafting in this plan (backoff): the proposer does no work for them
    # and catches up on the tokens they computed meanwhile when they resume
    spec_paused: set[str] = field(default_factory=set)
    skip_proposals: bool = False  # every request of the plan pauses
    # requests whose drafts this plan verifies and which pause if none is accepted: then the
    # proposer skips their proposals (the scheduler would drop them)
    spec_pause_on_miss: set[str] = field(default_factory=set)
    # thinking_token_budget (runtime/thinking_budget.py): per request whose sampling is forced,
    # the token each of its sampled rows must take (one row, or one per draft and one more; -1: free)
    forced_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def bitmask(self) -> np.ndarray | None:
        """The grammar rows, filled on first use (or by the fill `fill_async` started). On one
        rank that is at sampling time, after the forward is launched, so the host fills the masks
        while the device computes."""
        if self.grammar_future is not None:
            t0 = time.perf_counter()
            self.grammar_bitmask, self.grammar_future = self.grammar_future.result(), None
            if self.grammar_stats is not None:  # the engine loop waited this long for the fill
                self.grammar_stats.wait_seconds += time.perf_counter() - t0
        elif self.grammar_bitmask is None and self.grammar_fill is not None:
            self.grammar_bitmask, self.grammar_fill = self.grammar_fill(), None
        return self.grammar_bitmask

    def fill_async(self, out=None) -> None:
        """Start filling the rows on the grammar thread (the model runner calls this once the
        forward is launched, then defers sampling: the engine's own host work runs meanwhile),
        into `out` if given (the runner's pinned buffer for the copy to the device)."""
        if self.grammar_fill is not None and self.grammar_bitmask is None:
            self.grammar_future, self.grammar_fill = self.grammar_fill(background=True, out=out), None

    def __getstate__(self):  # sent to other ranks: the rows travel, the filler does not
        self.bitmask()
        return {k: v for k, v in self.__dict__.items() if k != "grammar_stats"}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


SPEC_MISSES = 4  # verify passes in a row with nothing accepted before a request pauses drafting
SPEC_FIRST_REJECTS = 3  # verify passes with nothing accepted, none ever, before a long pause
SPEC_MAX_PAUSE = 64  # steps


class SpecDecodingStats:
    """Cumulative counts of verified drafts (vLLM's spec_decode metrics)."""

    def __init__(self):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 max_model_len: int, async_scheduling: bool = False,
                 structured: StructuredOutputManager | None = None, num_host_blocks: int = 0,
                 max_loras: int = 0, sliding_window: int = 0, spec_lookahead: int = 0,
                 spec_enabled: bool = False, swap_cost: SwapCostModel | None = None,
                 spec_long_pause: bool = False):
        self.cfg = sched
        # preemption with the host tier: swap or recompute (forced, or per request by the model)
        self.swap_cost = swap_cost
        # speculative decoding: KV slots reserved past each step's tokens for the proposer
        self.spec_lookahead = spec_lookahead
        self.spec_enabled = spec_enabled
        # a drafter that runs a model: pause long once its first verify passes all missed
        self.spec_long_pause = spec_long_pause
        self.spec = SpecDecodingStats()
        self.spec_trims = False  # set once speculative decoding has given blocks back
        self.max_loras = max_loras  # LoRA: most adapters among running requests (0: no LoRA)
        self.structured = structured
        self.compiling: list[Request] = []  # waiting for their grammar: not schedulable yet
        # the engine's steps in flight, oldest first (their results may not be resolved yet):
        # under async scheduling a mask is filled before the engine has seen the previous token
        self.results_in_flight: Callable[[], list] = list
        self._accepting: threading.Event | None = None  # set once the last fill has accepted
        self.error_outputs: list[EngineCoreOutput] = []  # requests that failed outside a step
        # schedule a decode before its previous token is back (the runner fills it in on device)
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 cache.prefix_caching_hash_algo, num_host_blocks, sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by policy key
        self.running: list[Request] = []
        self.finished_ids: list[str] = []
        self.preempted_ids: list[str] = []  # of finished_ids (SchedulerOutput.preempted_req_ids)
        self.num_preemptions = 0
        self.num_preemptions_swap = 0  # of which swapped out to the host tier
        self._step_prompt_tokens = 0
        self._step_gen_tokens = 0

    # ---- requests in and out --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        req.queued_ts = time.monotonic()  # (not on re-queueing after a preemption: _enqueue)
        if req.sampling_params.structured_outputs is not None:
            req.grammar = self.structured.submit(req.sampling_params.structured_outputs)
            self.compiling.append(req)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        key = lambda r: r.sort_key(self.cfg.policy)  # noqa: E731
        bisect.insort(self.waiting, req, key=key)

    def finish_requests(self, req_ids, reason: FinishReason) -> list[Request]:
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, reason)
            done.append(req)
        return done

    def _finish(self, req: Request, reason: FinishReason, stop_reason=None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        # the runners hold its state (or a preempted one's seeded generator): tell them to drop it
        if req.num_sent is not None or (req.num_preemptions and req.sampling_params.seed is not None):
            self.finished_ids.append(req.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the step (request → tokens), preempting when blocks run out, then commit it.
        Nothing about a request changes until the commit, so preempting a request that was
        already picked for this step only has to drop it from `step`."""
        out = SchedulerOutput(finished_req_ids=self.finished_ids, preempted_req_ids=self.preempted_ids)
        self.finished_ids, self.preempted_ids = [], []
        budget = self.cfg.max_num_batched_tokens
        step: dict[str, tuple[Request, int, list[int], bool]] = {}  # id → (req, n, new blocks, new)
        drafts: dict[str, list[int]] = {}  # speculative decoding: drafts scheduled this step
        preempted = False
        if self.compiling:
            self._poll_grammars()
        if self.kv.offload is not None:  # blocks freed since the last plan go to the host tier
            self.kv.offload.begin_step()

        # running requests first: decodes and unfinished prefills
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if n <= 0 or (req.num_pending and not self._can_run_ahead(req)):
                i += 1  # its last step is still in flight
                continue
            spec = self._drafts(req, n, budget)
            ahead = len(spec) + self._ahead(req, n + len(spec))  # slots past n: no known token's KV
            new_blocks = self.kv.allocate_slots(req, n + ahead, num_ahead=ahead)
            while new_blocks is None:
                victim = max((r for r in self.running if r.num_in_flight == 0),
                             key=lambda r: r.sort_key(self.cfg.policy), default=None)
                if victim is None:  # everything else is in flight: try again next step
                    break
                if victim.request_id in step:
                    budget += step.pop(victim.request_id)[1]
                    drafts.pop(victim.request_id, None)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, n + ahead, num_ahead=ahead)
            if new_blocks is None:
                if req.status == RequestStatus.RUNNING:
                    i += 1
                continue  # else req itself was preempted; running[i] is now the next one
            if spec:
                drafts[req.request_id] = spec
                n += len(spec)
            step[req.request_id] = (req, n, new_blocks, False)
            budget -= n
            i += 1

        # then waiting requests, in policy order, unless we just had to preempt
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request} \
            if self.max_loras else set()
        j = 0
        while (j < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[j]
            if req.grammar is not None and not req.grammar.ready:
                j += 1  # still compiling: the others go ahead
                continue
            lid = req.lora_request.lora_int_id if req.lora_request else None
            if lid is not None and lid not in loras and len(loras) >= self.max_loras:
                j += 1  # its adapter would exceed --max-loras: the others go ahead
                continue
            computed, num_cached = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_cached
            if n > budget and not self.cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            ahead = self._ahead(req, n, num_cached)
            new_blocks = self.kv.allocate_slots(req, n + ahead, computed, num_ahead=ahead)
            if new_blocks is None:
                break
            self.waiting.pop(j)
            self.kv.record_lookup(req, num_cached, computed)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if not req.scheduled_ts:  # the first time only: a resumed preemption keeps it
                req.scheduled_ts = time.monotonic()
            self.running.append(req)
            if lid is not None:
                loras.add(lid)
            step[req.request_id] = (req, n, new_blocks, True)
            budget -= n

        if self.spec_enabled:
            # a request whose pause ends with this step's outputs (1 left) gets proposals from
            # it: its next step verifies them, without a step of its own to propose (one that
            # could not run ahead). Prefill chunks (a preempted request's) always keep the
            # proposer's state: a catch-up covers only what a pause of decodes misses
            out.spec_paused = {rid for rid, (r, n, *_) in step.items() if r.spec_pause > 1 and n == 1}
            out.skip_proposals = len(out.spec_paused) == len(step)
        constrained = []
        for req, n, new_blocks, new in step.values():
            spec = drafts.get(req.request_id)
            if spec:
                out.spec_token_ids[req.request_id] = spec
                req.spec_in_flight = len(spec)
                if self._miss_pause(req, True, self.spec_long_pause):
                    out.spec_pause_on_miss.add(req.request_id)
            req.spec_token_ids = []  # scheduled now, or stale
            known = req.num_pending == 0  # (else it runs ahead, where nothing is forced)
            if not self._commit(req, n, new_blocks, new, out, len(spec or ())):
                continue
            if req.grammar:
                constrained.append(req)
            if req.thinking is not None and known:
                req.thinking.read(req.all_token_ids, req.num_prompt_tokens)
                forced = req.thinking.forced(spec or [])
                if forced is not None:
                    out.forced_token_ids[req.request_id] = forced
        if constrained:
            out.grammar_req_ids = [r.request_id for r in constrained]
            spec = [out.spec_token_ids.get(rid, []) for rid in out.grammar_req_ids]
            out.grammar_num_rows = len(constrained) + sum(map(len, spec))
            spec = spec if out.grammar_num_rows > len(constrained) else None
            out.grammar_fill = lambda background=False, out=None: self._fill_bitmask(
                constrained, background, out, spec)
            out.grammar_stats = self.structured
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if self.kv.offload is not None and not out.is_empty:  # (an empty plan is not sent)
            out.blocks_to_host, out.blocks_from_host, out.wait_for_copies = self.kv.offload.take_copies()
        if out.is_empty:  # an empty plan is not sent: keep the ids for the next one
            self.finished_ids = out.finished_req_ids + self.finished_ids
            self.preempted_ids = out.preempted_req_ids + self.preempted_ids
            out.finished_req_ids, out.preempted_req_ids = [], []
            if self.compiling and not self.running:  # idle until a grammar is ready: don't spin
                self.structured.wait_any([r.grammar for r in self.compiling], 0.01)
        return out

    def _fill_bitmask(self, reqs: list[Request], background: bool = False, out=None,
                      drafts: list[list[int]] | None = None):
        """The masks of a plan's constrained requests, filled after its forward is launched.
        Under async scheduling the previous step may still be in flight: its tokens are taken
        from its result (waiting for it while this step's forward runs) and accepted first, so
        `update` finds them seen. `background`: run on the grammar thread and return a future;
        `update` waits until the accepting is done (it reads and advances the same requests).
        `out`: where to write the rows; `drafts`: each request's drafts this step verifies, a
        row for each (StructuredOutputManager.fill_bitmask). A request with drafts has no step
        in flight (it does not run ahead), so its matcher is where the drafts start."""
        results = [r for r in self.results_in_flight() if r is not None] if self.async_scheduling else []
        done = threading.Event()
        self._accepting = done

        def fill() -> np.ndarray:
            try:
                self._accept_in_flight(reqs, results)
            finally:
                done.set()
            return self.structured.fill_bitmask([r.grammar for r in reqs], out, drafts)
        return self.structured.fill_pool.submit(fill) if background else fill()

    def _accept_in_flight(self, reqs: list[Request], results: list) -> None:
        want = {r.request_id: r for r in reqs}
        seen: dict[str, int] = {}  # tokens of a request met in earlier results of this scan
        pairs = []
        for res in results:
            res.resolve()
            for i, (rid, tok) in enumerate(zip(res.req_ids, res.sampled_token_ids)):
                r = want.get(rid)
                if r is not None:  # (tokens of a step with drafts: the accepted ones first)
                    for t in (res.accepted[i] if res.accepted else []) + [tok]:
                        k = seen[rid] = seen.get(rid, 0) + 1
                        if r.grammar.num_seen < r.num_output_tokens + k:
                            pairs.append((r.grammar, t))
        if pairs:
            self.structured.accept(pairs)

    def _poll_grammars(self) -> None:
        """Give compiled requests their matcher; fail those whose compilation failed."""
        still = []
        for req in self.compiling:
            if req.is_finished:
                continue
            if not req.grammar.future.done():
                still.append(req)
                continue
            try:
                self.structured.init_matcher(req.grammar, req.eos_token_id)
            except Exception as e:  # noqa: BLE001 - validate() parsed it; compilation still may fail
                self.waiting.remove(req)
                self._finish(req, FinishReason.ERROR)
                self.error_outputs.append(EngineCoreOutput(
                    req.request_id, [], finish_reason=FinishReason.ERROR,
                    error=str(e) if isinstance(e, ValueError)  # (an invalid constraint: names it)
                    else f"structured output compilation failed: {e}"))
        self.compiling = still

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        out, self.error_outputs = self.error_outputs, []
        return out

    def _can_run_ahead(self, req: Request) -> bool:
        """May `req` be scheduled again before its pending token is known?"""
        # penalties, multi-token bad words and grammars read the output so far
        sp = req.sampling_params
        return (self.async_scheduling and not sp.needs_penalties
                and not any(len(w) > 1 for w in sp.bad_words_token_ids)
                and req.num_output_tokens + req.num_pending < req.max_tokens
                and req.num_tokens + req.num_pending < self.max_model_len
                # a thinking budget: only while no token can be forced at the next position
                and (req.thinking is None or self._thinking_free(req))
                # speculative decoding: only a request that is not drafting (backoff) runs ahead
                and (not self.spec_enabled or (req.spec_pause > 0 and not req.spec_in_flight)))

    @staticmethod
    def _thinking_free(req: Request) -> bool:
        req.thinking.read(req.all_token_ids, req.num_prompt_tokens)
        return req.thinking.can_run_ahead(req.num_pending)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The proposed tokens `req` verifies this step (after its n known ones): only for a
        plain decode, within the budget and never past max_tokens or max_model_len."""
        if not req.spec_token_ids or req.num_pending or req.num_tokens - req.num_computed_tokens != 1:
            return []
        k = min(len(req.spec_token_ids), budget - n,
                req.max_tokens - req.num_output_tokens - 1, self.max_model_len - 1 - req.num_tokens)
        return req.spec_token_ids[:max(k, 0)]

    def _ahead(self, req: Request, n: int, num_cached: int = 0) -> int:
        """Slots the proposer writes past this step's tokens (within max_model_len)."""
        if not self.spec_lookahead:
            return 0
        end = max(req.num_computed_tokens, num_cached) + n
        return max(0, min(self.spec_lookahead, self.max_model_len - end))

    def _commit(self, req: Request, n: int, new_blocks: list[int], new: bool,
                out: SchedulerOutput, num_drafts: int = 0) -> bool:
        """Add `req` to the plan; True if this step samples its next token."""
        rid = req.request_id
        if new:
            out.new_reqs.append(NewRequestData(
                rid, list(req.all_token_ids), req.sampling_params, self.kv.block_ids(req),
                req.num_computed_tokens, req.num_prompt_tokens, req.eos_token_id, req.lora_request))
        else:
            out.cached_reqs.append(CachedRequestData(
                rid, req.all_token_ids[req.num_sent:], new_blocks, req.num_computed_tokens,
                len(self.kv.req_blocks[rid]) if self.spec_trims else -1))
        req.num_sent = req.num_tokens
        out.num_scheduled_tokens[rid] = n
        start = req.num_computed_tokens
        self._step_prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
        req.num_computed_tokens += n
        samples = req.num_computed_tokens - num_drafts >= req.num_tokens + req.num_pending
        if samples:
            req.num_pending += 1
        req.num_in_flight += 1
        return samples

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        swap = self._swaps(req)
        # blocks this step allocated hold no KV yet: they must not stay findable in the cache;
        # recompute: its blocks stay in the device tier's LRU but are not copied to the host
        self.kv.free(req, num_valid_tokens=req.num_computed_tokens, to_host=swap)
        self.num_preemptions_swap += swap
        if req.num_sent is not None:
            out.finished_req_ids.append(req.request_id)
            out.preempted_req_ids.append(req.request_id)
        req.preempt()
        self.num_preemptions += 1
        self._enqueue(req)

    def _swaps(self, req: Request) -> bool:
        """Swap `req`'s full blocks out to the host tier rather than recompute them later?"""
        if self.kv.offload is None:
            return False
        mode = self.cfg.preemption_mode
        if mode is not None:
            return mode == "swap"
        return self.swap_cost is None or self.swap_cost.prefers_swap(req.num_computed_tokens)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it every step)."""
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "running ∩ waiting"
        live = self.running + self.waiting
        assert len(live) == len(self.requests), "requests ≠ running ∪ waiting"
        assert len(self.running) <= self.cfg.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r.request_id
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.request_id
            assert r.num_in_flight == 0 and r.num_pending == 0 and r.num_sent is None, r.request_id
            assert r.request_id not in self.kv.req_blocks, r.request_id
        for r in live:
            assert r.num_pending <= r.num_in_flight, f"{r.request_id}: pending ⊄ in flight"
            # drafts in flight count as computed until their verify step rolls the rejects back
            assert r.num_computed_tokens <= r.num_tokens + r.num_pending + r.spec_in_flight, r.request_id
        self.kv.check_invariants()

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop conditions, build the outputs for the frontend."""
        if self._accepting is not None:  # a mask fill on the grammar thread accepts our tokens
            self._accepting.wait()
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is not None:  # else it finished while the step ran
                req.num_in_flight -= 1
        outputs = self.take_error_outputs()
        logprobs = result.logprobs or [None] * len(result.req_ids)
        for rid in result.req_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.num_pending -= 1
        accepted = result.accepted
        unseen, unseen_ids = [], []  # grammar tokens not accepted at fill time (sync scheduling, or last step)
        for i, (rid, tok) in enumerate(zip(result.req_ids, result.sampled_token_ids)):
            req = self.requests.get(rid)
            if (req is not None and req.grammar is not None and req.status == RequestStatus.RUNNING
                    and req.grammar.num_seen == req.num_output_tokens):
                unseen.append((req.grammar, (accepted[i] if rid in sched.spec_token_ids else []) + [tok]))
                unseen_ids.append(rid)
        # with drafts, the grammar may end (or fail) before the step's last token: the output stops there
        grammar_ends = {}
        if unseen:
            grammar_ends = dict(zip(unseen_ids, self.structured.accept_runs(unseen)))
        # before the outputs: a request that ends on this step's token (max_tokens 1) is gone after
        for rid, entries in result.prompt_logprobs.items():
            if rid in self.requests:
                self.requests[rid].prompt_logprobs.extend(entries)
        for i, (rid, tok, lp) in enumerate(zip(result.req_ids, result.sampled_token_ids, logprobs)):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            new = [tok]
            if rid in sched.spec_token_ids:
                new = accepted[i] + new
                self._roll_back(req, len(sched.spec_token_ids[rid]), len(accepted[i]))
            self._take_proposals(req, None if result.draft_token_ids is None
                                 else result.draft_token_ids[i])
            if grammar_ends.get(rid, len(new)) < len(new):
                del new[max(grammar_ends[rid], 1):]
                lp = lp[:len(new)] if lp is not None else None
            reason = None
            for k, tok in enumerate(new):
                req.append_token(tok)
                self._step_gen_tokens += 1
                reason, stop = self._check_stop(req, tok)
                if reason is not None:
                    del new[k + 1:]  # tokens past a stop are dropped
                    lp = lp[:k + 1] if lp is not None else None
                    break
            if req.grammar is not None:
                if req.grammar.failed:  # the mask makes this impossible
                    reason = FinishReason.ERROR
                elif reason is None and req.grammar.terminated:
                    reason = FinishReason.STOP
            o = EngineCoreOutput(rid, new, new_logprobs=lp,
                                 num_cached_tokens=max(req.num_cached_tokens, 0))
            if req.num_output_tokens == len(new):  # its first output
                o.queued_ts, o.scheduled_ts = req.queued_ts, req.scheduled_ts
                if req.sampling_params.prompt_logprobs is not None:
                    o.prompt_logprobs = req.prompt_logprobs
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason, stop)
                o.finish_reason, o.stop_reason = reason, stop
                if reason == FinishReason.ERROR:
                    # only reachable when another restriction masked every token the grammar allows
                    o.error = ("the sampled token violates the structured output constraint: no "
                               "token satisfies both it and the request's min_tokens / "
                               "allowed_token_ids / bad_words / stop restrictions")
            outputs.append(o)
        return EngineCoreOutputs(outputs=outputs, stats=self.stats(), timestamp=time.monotonic())

    def _roll_back(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """The rejected drafts' KV is garbage: recompute from the first of them, and give back
        the blocks past what the request now holds (the proposer's lookahead too)."""
        req.num_computed_tokens -= num_drafts - num_accepted
        req.spec_in_flight = 0
        self._count_miss(req, num_accepted > 0, verified=True, long_pause=self.spec_long_pause)
        if self.kv.trim(req, req.num_computed_tokens):
            self.spec_trims = True
        self.spec.record(num_drafts, num_accepted)

    @staticmethod
    def _miss_pause(req: Request, verified: bool, long_pause: bool) -> int:
        """Steps a miss now (a verify pass that accepts nothing, or an empty proposal) would
        pause the request's drafting for: 0, or 2, 4, ... SPEC_MAX_PAUSE after SPEC_MISSES
        misses in a row. With `long_pause` (a drafter that runs a model: draft model, MTP,
        EAGLE), SPEC_MAX_PAUSE at once after SPEC_FIRST_REJECTS rejected verify passes of a
        request none of whose drafts was ever accepted: the drafter is presumably of no use for
        it, and each try costs its passes, a verify and a synchronous step. (An n-gram lookup
        that missed says little about the next match, and costs no passes.)"""
        misses = req.spec_misses + 1
        if long_pause and verified and 0 <= req.spec_rejects and req.spec_rejects + 1 >= SPEC_FIRST_REJECTS:
            return SPEC_MAX_PAUSE
        return min(2 ** (misses - SPEC_MISSES + 1), SPEC_MAX_PAUSE) if misses >= SPEC_MISSES else 0

    @classmethod
    def _count_miss(cls, req: Request, hit: bool, verified: bool = False, long_pause: bool = False) -> None:
        """Drafts that keep being rejected cost a verify each step (1 + k tokens instead of 1),
        and a request waiting for proposals cannot run ahead (async scheduling): a request that
        keeps missing decodes plainly for a while (`_miss_pause`), then tries again. Acceptance
        never changes the output, so this only bounds the cost of useless drafts."""
        if hit:
            req.spec_misses, req.spec_rejects = 0, -1
            return
        pause = cls._miss_pause(req, verified, long_pause)
        req.spec_misses += 1
        if verified and req.spec_rejects >= 0:
            req.spec_rejects += 1
        if pause:
            req.spec_pause = pause

    def _take_proposals(self, req: Request, drafts: list[int] | None) -> None:
        """The proposer's guesses after a step (None: it did no work for it) become the drafts
        of the request's next step, unless the request pauses or already ran ahead of them."""
        if req.spec_pause > 0:
            req.spec_pause -= 1
            if req.spec_pause > 0:
                return
        if drafts is None or req.num_pending:
            return
        if not drafts:
            self._count_miss(req, False)
        req.spec_token_ids = drafts

    def _check_stop(self, req: Request, tok: int):
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if tok == req.eos_token_id and not sp.ignore_eos:
                return FinishReason.STOP, None
            if tok in sp.stop_token_ids:
                return FinishReason.STOP, tok
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def stats(self) -> SchedulerStats:
        s = SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_usage=self.kv.usage,
            num_blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            num_blocks_total=self.kv.num_blocks, prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits, num_preemptions=self.num_preemptions,
            num_preemptions_swap=self.num_preemptions_swap,
            num_prompt_tokens=self._step_prompt_tokens, num_generation_tokens=self._step_gen_tokens)
        host = self.kv.offload
        if host is not None:
            s.host_prefix_queries, s.host_prefix_hits = host.queries, host.hits
            s.host_blocks_stored, s.host_blocks_loaded = host.blocks_stored, host.blocks_loaded
            s.host_blocks_used, s.host_blocks_total = host.tier.num_used, host.tier.num_blocks
        if self.max_loras:
            s.max_lora = self.max_loras
            names = lambda rs: ",".join(sorted({r.lora_request.lora_name for r in rs  # noqa: E731
                                                if r.lora_request}))
            s.running_lora_adapters, s.waiting_lora_adapters = names(self.running), names(self.waiting)
        if self.spec.num_drafts:
            s.spec_num_drafts, s.spec_num_draft_tokens = self.spec.num_drafts, self.spec.num_draft_tokens
            s.spec_num_accepted_tokens = self.spec.num_accepted_tokens
            s.spec_accepted_per_pos = list(self.spec.accepted_per_pos)
        if self.structured is not None:
            s.grammar_compile_seconds = self.structured.compile_seconds
            s.grammar_mask_seconds = self.structured.mask_seconds
            s.grammar_wait_seconds = self.structured.wait_seconds
        self._step_prompt_tokens = self._step_gen_tokens = 0
        return s
