"""Prometheus metrics of the API process, named like vLLM's (`vllm:x` → `rankserve:x`).

Engine-side numbers arrive as SchedulerStats with every EngineCoreOutputs; request latencies are
measured here, where the client sees them."""
from __future__ import annotations

import time

import prometheus_client as prom

from ..messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return prom.Gauge("rankserve:" + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return prom.Counter("rankserve:" + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return prom.Histogram("rankserve:" + name, doc, labels, buckets=buckets,
                                  registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        self.kv_blocks_used = gauge("kv_cache_blocks_used", "KV-cache blocks in use")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV-cache blocks in all")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.grammar_compile = counter("grammar_compile_seconds", "Seconds compiling structured-"
                                       "output grammars (worker threads, off the step loop)")
        self.grammar_mask = counter("grammar_mask_seconds", "Seconds of the step loop filling "
                                    "structured-output token bitmasks")
        # the host tier of the prefix cache (--kv-offload-size); its hit rate is
        # host_prefix_cache_hits / host_prefix_cache_queries, the device tier's
        # prefix_cache_hits / prefix_cache_queries
        self.host_prefix_queries = counter("host_prefix_cache_queries", "Prompt tokens looked up "
                                           "in the host KV tier (the device tier missed them)")
        self.host_prefix_hits = counter("host_prefix_cache_hits", "Prompt tokens found in the "
                                        "host KV tier (copied back instead of recomputed)")
        self.host_blocks_stored = counter("host_kv_blocks_stored", "KV blocks copied to the host tier")
        self.host_blocks_loaded = counter("host_kv_blocks_loaded", "KV blocks copied back from the "
                                          "host tier")
        self.host_blocks_used = gauge("host_kv_cache_blocks_used", "Host-tier KV blocks in use")
        self.host_blocks_total = gauge("host_kv_cache_blocks_total", "Host-tier KV blocks in all")
        self.sleep_level = gauge("engine_sleep_level", "Sleep mode: 0 awake, 1 weights in host "
                                 "memory, 2 weights discarded (KV cache discarded at 1 and 2)")
        self._success = prom.Counter("rankserve:request_success", "Finished requests by finish "
                                     "reason", ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        # speculative decoding (vLLM's spec_decode counters): acceptance rate is
        # num_accepted_tokens / num_draft_tokens, mean acceptance length
        # 1 + num_accepted_tokens / num_drafts
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify passes with drafts")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._spec_per_pos = prom.Counter("rankserve:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft",
                                          ["model_name", "position"], registry=r)
        self.lora_info = prom.Gauge("rankserve:lora_requests_info", "Running and waiting LoRA "
                                    "adapters (vLLM's lora_requests_info; value: the time)",
                                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                    registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish",
                             _LATENCY_BUCKETS)
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request",
                                           _TOKEN_BUCKETS)
        self.req_generation_tokens = histogram("request_generation_tokens", "Generated tokens per "
                                               "request", _TOKEN_BUCKETS)
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
        self.generation_tokens.inc(s.num_generation_tokens)
        for counter, new, old in ((self.preemptions, s.num_preemptions, self._last.num_preemptions),
                                  (self.prefix_queries, s.prefix_queries, self._last.prefix_queries),
                                  (self.prefix_hits, s.prefix_hits, self._last.prefix_hits),
                                  (self.grammar_compile, s.grammar_compile_seconds,
                                   self._last.grammar_compile_seconds),
                                  (self.grammar_mask, s.grammar_mask_seconds,
                                   self._last.grammar_mask_seconds),
                                  (self.host_prefix_queries, s.host_prefix_queries,
                                   self._last.host_prefix_queries),
                                  (self.host_prefix_hits, s.host_prefix_hits, self._last.host_prefix_hits),
                                  (self.host_blocks_stored, s.host_blocks_stored,
                                   self._last.host_blocks_stored),
                                  (self.host_blocks_loaded, s.host_blocks_loaded,
                                   self._last.host_blocks_loaded),
                                  (self.spec_drafts, s.spec_num_drafts, self._last.spec_num_drafts),
                                  (self.spec_draft_tokens, s.spec_num_draft_tokens,
                                   self._last.spec_num_draft_tokens),
                                  (self.spec_accepted, s.spec_num_accepted_tokens,
                                   self._last.spec_num_accepted_tokens)):
            counter.inc(max(0, new - old))
        old = self._last.spec_accepted_per_pos
        for pos, n in enumerate(s.spec_accepted_per_pos):
            prev = old[pos] if pos < len(old) else 0
            if n > prev or not prev:
                self._spec_per_pos.labels(self._model, str(pos)).inc(max(0, n - prev))
        if s.max_lora:
            self.lora_info.clear()
            self.lora_info.labels(str(s.max_lora), s.waiting_lora_adapters,
                                  s.running_lora_adapters).set(time.time())
        self._last = s

    def record_finished(self, finish_reason: str, num_prompt: int, num_generated: int,
                        e2e_s: float) -> None:
        self._success.labels(self._model, finish_reason).inc()
        self.e2e.observe(e2e_s)
        self.req_prompt_tokens.observe(num_prompt)
        self.req_generation_tokens.observe(num_generated)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
