"""Prometheus metrics of the API process, named like vLLM's (`vllm:x` → `rankserve:x`).

Engine-side numbers arrive as SchedulerStats with every EngineCoreOutputs; request latencies are
measured here, where the client sees them, except vLLM's per-request phases (queue, prefill,
decode, inference), which come from the engine's timestamps as vLLM's do."""
from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Sequence

import prometheus_client as prom

from ..messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's for its per-request intervals (e2e there; queue / prefill / decode / inference here)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


def observe_many(hist, values: list[float]) -> None:
    """`hist.observe(v)` for every v, with one locked add per bucket touched instead of two
    locks and a walk over the buckets per value (an engine step brings an inter-token latency
    per running request: 256 at W1)."""
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum
    except AttributeError:  # a prometheus_client without these internals: the public way
        for v in values:
            hist.observe(v)
        return
    for i, n in collections.Counter(bisect.bisect_left(bounds, v) for v in values).items():
        buckets[i].inc(n)  # bounds[i] is the first with v <= bound, as observe() picks
    if values:
        total.inc(sum(values))


def request_phases(queued: float, scheduled: float, first_token: float, last_token: float,
                   num_generated: int) -> tuple[float, float, float, float, float | None]:
    """A finished request's intervals, as vLLM defines them over engine timestamps: queue
    (queued → first scheduled), prefill (first scheduled → first token), decode (first → last
    token), inference (first scheduled → last token; preemptions count in the phase they
    interrupt), and the time per output token: decode / (tokens - 1), None under 2 tokens."""
    decode = last_token - first_token
    return (scheduled - queued, first_token - scheduled, decode, last_token - scheduled,
            decode / (num_generated - 1) if num_generated > 1 else None)


class EngineMetrics:
    """The series of one engine replica (label `engine`, as vLLM's): its scheduler's gauges and
    counters and the latencies of the requests it served."""

    def __init__(self, parents: dict, success, spec_per_pos, preempt_kind, model_name: str,
                 engine: int, num_spec_tokens: int = 0):
        for attr, parent in parents.items():
            setattr(self, attr, parent.labels(model_name, str(engine)))
        self._success = success
        for reason in ("stop", "length", "abort"):  # at 0 from the start, as vLLM's
            success.labels(model_name, str(engine), reason)
        self._spec_per_pos = spec_per_pos
        for pos in range(num_spec_tokens):  # one series per draft position, at 0 (vLLM's)
            spec_per_pos.labels(model_name, str(engine), str(pos))
        self._swap = preempt_kind.labels(model_name, str(engine), "swap")
        self._recompute = preempt_kind.labels(model_name, str(engine), "recompute")
        self._labels = (model_name, str(engine))
        self._last = SchedulerStats()  # the engine's cumulative counters, as last seen

    def record_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.kv_blocks_used.set(s.num_blocks_used)
        self.kv_blocks_total.set(s.num_blocks_total)
        self.host_blocks_used.set(s.host_blocks_used)
        self.host_blocks_total.set(s.host_blocks_total)
        self.prompt_tokens.inc(s.num_prompt_tokens)
        # generation_tokens counts what reaches the client (client.py), as vLLM's: the engine's
        # own count has the tokens it made after a stop string matched here or the client left
        for counter, field in ((self.preemptions, "num_preemptions"),
                               (self.prefix_queries, "prefix_queries"),
                               (self.prefix_hits, "prefix_hits"),
                               (self.grammar_compile, "grammar_compile_seconds"),
                               (self.grammar_mask, "grammar_mask_seconds"),
                               (self.grammar_wait, "grammar_wait_seconds"),
                               (self.host_prefix_queries, "host_prefix_queries"),
                               (self.host_prefix_hits, "host_prefix_hits"),
                               (self.host_blocks_stored, "host_blocks_stored"),
                               (self.host_blocks_loaded, "host_blocks_loaded"),
                               (self.spec_drafts, "spec_num_drafts"),
                               (self.spec_draft_tokens, "spec_num_draft_tokens"),
                               (self.spec_accepted, "spec_num_accepted_tokens")):
            counter.inc(max(0, getattr(s, field) - getattr(self._last, field)))
        swaps = s.num_preemptions_swap - self._last.num_preemptions_swap
        self._swap.inc(max(0, swaps))
        self._recompute.inc(max(0, s.num_preemptions - self._last.num_preemptions - swaps))
        old = self._last.spec_accepted_per_pos
        for pos, n in enumerate(s.spec_accepted_per_pos):
            prev = old[pos] if pos < len(old) else 0
            if n > prev or not prev:  # (a zero series appears once its position exists)
                self._spec_per_pos.labels(*self._labels, str(pos)).inc(max(0, n - prev))
        self._last = s

    def record_finished(self, finish_reason: str, num_prompt: int, num_generated: int,
                        e2e_s: float, timing: Sequence[float] | None = None) -> None:
        """`timing`: the engine's (queued, first scheduled, first token, last token) times, for
        the phase histograms; None where there are none (a request the client aborted: vLLM
        records no phases for those either)."""
        self._success.labels(*self._labels, finish_reason).inc()
        self.e2e.observe(e2e_s)
        self.req_prompt_tokens.observe(num_prompt)
        self.req_generation_tokens.observe(num_generated)
        if timing is not None:
            queue, prefill, decode, inference, tpot = request_phases(*timing, num_generated)
            self.queue_time.observe(queue)
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(inference)
            if tpot is not None:
                self.tpot.observe(tpot)


class Metrics:
    """Every series carries `model_name` and `engine` (the data-parallel replica, "0" without
    data parallelism); the total over replicas is the sum over `engine`
    (`sum without (engine) (...)`)."""

    def __init__(self, model_name: str, num_engines: int = 1, num_spec_tokens: int = 0):
        self.registry = prom.CollectorRegistry()
        r, labels = self.registry, ["model_name", "engine"]
        parents: dict = {}

        def gauge(attr, name, doc):
            parents[attr] = prom.Gauge("rankserve:" + name, doc, labels, registry=r)

        def counter(attr, name, doc):
            parents[attr] = prom.Counter("rankserve:" + name, doc, labels, registry=r)

        def histogram(attr, name, doc, buckets):
            parents[attr] = prom.Histogram("rankserve:" + name, doc, labels, buckets=buckets, registry=r)

        gauge("running", "num_requests_running", "Requests in the running batch")
        gauge("waiting", "num_requests_waiting", "Requests waiting to be scheduled")
        gauge("kv_usage", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        gauge("kv_blocks_used", "kv_cache_blocks_used", "KV-cache blocks in use")
        gauge("kv_blocks_total", "kv_cache_blocks_total", "KV-cache blocks in all")
        counter("preemptions", "num_preemptions", "Preemptions of running requests")
        counter("prefix_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        counter("prefix_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        counter("prompt_tokens", "prompt_tokens", "Prompt tokens computed (prefill)")
        counter("generation_tokens", "generation_tokens", "Tokens generated and sent to clients "
                "(none past a stop string or after an abort)")
        counter("grammar_compile", "grammar_compile_seconds", "Seconds compiling structured-output "
                "grammars (worker threads, off the step loop)")
        counter("grammar_wait", "grammar_wait_seconds", "Seconds the step loop waited for a "
                "structured-output mask fill (the part the forward did not hide)")
        counter("grammar_mask", "grammar_mask_seconds", "Seconds filling structured-output token "
                "bitmasks and accepting sampled tokens (grammar thread or step loop)")
        # the host tier of the prefix cache (--kv-offload-size); its hit rate is
        # host_prefix_cache_hits / host_prefix_cache_queries, the device tier's
        # prefix_cache_hits / prefix_cache_queries
        counter("host_prefix_queries", "host_prefix_cache_queries", "Prompt tokens looked up in the "
                "host KV tier (the device tier missed them)")
        counter("host_prefix_hits", "host_prefix_cache_hits", "Prompt tokens found in the host KV "
                "tier (copied back instead of recomputed)")
        counter("host_blocks_stored", "host_kv_blocks_stored", "KV blocks copied to the host tier")
        counter("host_blocks_loaded", "host_kv_blocks_loaded", "KV blocks copied back from the host tier")
        gauge("host_blocks_used", "host_kv_cache_blocks_used", "Host-tier KV blocks in use")
        gauge("host_blocks_total", "host_kv_cache_blocks_total", "Host-tier KV blocks in all")
        # speculative decoding (vLLM's spec_decode counters): acceptance rate is
        # num_accepted_tokens / num_draft_tokens, mean acceptance length 1 + accepted / drafts
        counter("spec_drafts", "spec_decode_num_drafts", "Drafts verified (a request's in a verify pass)")
        counter("spec_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified")
        counter("spec_accepted", "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        gauge("sleep_level", "engine_sleep_level", "Sleep mode: 0 awake, 1 weights in host memory, "
              "2 weights discarded (KV cache discarded at 1 and 2)")
        histogram("ttft", "time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        histogram("itl", "inter_token_latency_seconds", "Time between output tokens", _LATENCY_BUCKETS)
        histogram("e2e", "e2e_request_latency_seconds", "Request latency, arrival to finish",
                  _LATENCY_BUCKETS)
        # vLLM's per-request phases, from the engine's timestamps (client.py)
        histogram("queue_time", "request_queue_time_seconds", "Time in the waiting queue: queued to "
                  "first scheduled", _REQUEST_LATENCY_BUCKETS)
        histogram("prefill_time", "request_prefill_time_seconds", "Prefill time: first scheduled "
                  "to first token", _REQUEST_LATENCY_BUCKETS)
        histogram("decode_time", "request_decode_time_seconds", "Decode time: first token to last "
                  "token", _REQUEST_LATENCY_BUCKETS)
        histogram("inference_time", "request_inference_time_seconds", "Time running: first "
                  "scheduled to last token", _REQUEST_LATENCY_BUCKETS)
        histogram("tpot", "request_time_per_output_token_seconds", "Per request: decode time over "
                  "the output tokens after the first (requests with 2 or more)", _TPOT_BUCKETS)
        histogram("req_prompt_tokens", "request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        histogram("req_generation_tokens", "request_generation_tokens", "Generated tokens per request",
                  _TOKEN_BUCKETS)
        success = prom.Counter("rankserve:request_success", "Finished requests by finish reason",
                               [*labels, "finished_reason"], registry=r)
        self.lora_info = prom.Gauge("rankserve:lora_requests_info", "Running and waiting LoRA "
                                    "adapters (vLLM's lora_requests_info; value: the time)",
                                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                    registry=r)
        spec_per_pos = prom.Counter("rankserve:spec_decode_num_accepted_tokens_per_pos", "Draft "
                                    "tokens accepted, by position in the draft", [*labels, "position"],
                                    registry=r)
        # --preemption-mode: swapped to the host KV tier, or recomputed (their sum: num_preemptions)
        preempt_kind = prom.Counter("rankserve:num_preemptions_by_kind", "Preemptions by how the "
                                    "request's KV comes back: swap (host KV tier) or recompute",
                                    [*labels, "kind"], registry=r)
        self.engines = [EngineMetrics(parents, success, spec_per_pos, preempt_kind, model_name, e,
                                      num_spec_tokens) for e in range(num_engines)]
        self._lora: dict[int, tuple[str, str]] = {}  # replica -> (waiting, running) adapters

    def record_stats(self, s: SchedulerStats, engine: int = 0) -> None:
        self.engines[engine].record_stats(s)
        if s.max_lora:  # one series for the deployment: the adapters of every replica
            self._lora[engine] = (s.waiting_lora_adapters, s.running_lora_adapters)

            def union(i):
                return ",".join(sorted({a for w in self._lora.values() for a in w[i].split(",") if a}))
            self.lora_info.clear()
            self.lora_info.labels(str(s.max_lora), union(0), union(1)).set(time.time())

    def record_finished(self, finish_reason: str, num_prompt: int, num_generated: int,
                        e2e_s: float, engine: int = 0,
                        timing: Sequence[float] | None = None) -> None:
        self.engines[engine].record_finished(finish_reason, num_prompt, num_generated, e2e_s, timing)

    def set_sleep_level(self, level: int) -> None:
        for e in self.engines:  # every replica sleeps and wakes with the others
            e.sleep_level.set(level)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
