"""Prometheus metrics of the API process: engine stats become gauges and counters."""
from __future__ import annotations

import re
import time

from rankserve.runtime.messages import SchedulerStats
from rankserve.runtime.serve.metrics import Metrics
from test_server import metric


def test_engine_stats_become_gauges_and_counters():
    m = Metrics("tiny")
    m.record_stats(SchedulerStats(num_running=3, num_waiting=2, kv_usage=0.25, num_blocks_used=4,
                                  num_blocks_total=16, prefix_queries=40, prefix_hits=16,
                                  num_preemptions=1, num_prompt_tokens=40,
                                  num_generation_tokens=3))
    # cumulative engine counters are turned into increments; per-step counts add up
    m.record_stats(SchedulerStats(num_running=1, num_waiting=0, kv_usage=0.125, num_blocks_used=2,
                                  num_blocks_total=16, prefix_queries=50, prefix_hits=20,
                                  num_preemptions=1, num_prompt_tokens=10,
                                  num_generation_tokens=1))
    m.record_finished("stop", 10, 4, 0.5)
    m.record_finished("length", 10, 16, 1.5)
    m.engines[0].ttft.observe(0.02)
    text = m.exposition().decode()
    expect = {
        "rankserve:num_requests_running": 1, "rankserve:num_requests_waiting": 0,
        "rankserve:kv_cache_usage_perc": 0.125, "rankserve:kv_cache_blocks_used": 2,
        "rankserve:kv_cache_blocks_total": 16, "rankserve:prefix_cache_queries_total": 50,
        "rankserve:prefix_cache_hits_total": 20, "rankserve:num_preemptions_total": 1,
        # generated tokens are counted as the client gets them (client.py), not from the engine's
        # count, which has those made after a stop string matched or the client left
        "rankserve:prompt_tokens_total": 50, "rankserve:generation_tokens_total": 0,
        "rankserve:request_success_total": 2, "rankserve:e2e_request_latency_seconds_count": 2,
        "rankserve:e2e_request_latency_seconds_sum": 2.0,
        "rankserve:request_generation_tokens_sum": 20,
        "rankserve:time_to_first_token_seconds_count": 1,
    }
    for name, value in expect.items():
        assert metric(text, name) == value, name
    assert 'rankserve:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0' in text
    assert 'rankserve:num_requests_running{engine="0",model_name="tiny"} 1.0' in text


def test_host_tier_counters_and_sleep_gauge():
    m = Metrics("tiny")
    m.record_stats(SchedulerStats(prefix_queries=100, prefix_hits=16, host_prefix_queries=84,
                                  host_prefix_hits=48, host_blocks_stored=10, host_blocks_loaded=3,
                                  host_blocks_used=10, host_blocks_total=64))
    m.record_stats(SchedulerStats(prefix_queries=150, prefix_hits=16, host_prefix_queries=134,
                                  host_prefix_hits=96, host_blocks_stored=12, host_blocks_loaded=6,
                                  host_blocks_used=12, host_blocks_total=64))
    m.set_sleep_level(2)
    text = m.exposition().decode()
    expect = {"rankserve:prefix_cache_queries_total": 150, "rankserve:prefix_cache_hits_total": 16,
              "rankserve:host_prefix_cache_queries_total": 134,
              "rankserve:host_prefix_cache_hits_total": 96,
              "rankserve:host_kv_blocks_stored_total": 12, "rankserve:host_kv_blocks_loaded_total": 6,
              "rankserve:host_kv_cache_blocks_used": 12, "rankserve:host_kv_cache_blocks_total": 64,
              "rankserve:engine_sleep_level": 2}
    for name, value in expect.items():
        assert metric(text, name) == value, name


def test_per_engine_series_and_total():
    """Data parallelism: one series per replica (label engine); the total is their sum."""
    m = Metrics("tiny", num_engines=2)
    m.record_stats(SchedulerStats(num_running=3, num_prompt_tokens=3, prefix_hits=8), engine=0)
    m.record_stats(SchedulerStats(num_running=2, num_prompt_tokens=2, prefix_hits=4), engine=1)
    m.record_stats(SchedulerStats(num_running=1, num_prompt_tokens=1, prefix_hits=12), engine=1)
    m.record_finished("length", 5, 4, 0.1, engine=1)
    text = m.exposition().decode()
    assert 'rankserve:num_requests_running{engine="0",model_name="tiny"} 3.0' in text
    assert 'rankserve:num_requests_running{engine="1",model_name="tiny"} 1.0' in text
    assert 'rankserve:prompt_tokens_total{engine="1",model_name="tiny"} 3.0' in text
    assert 'rankserve:prefix_cache_hits_total{engine="1",model_name="tiny"} 12.0' in text
    assert metric(text, "rankserve:prompt_tokens_total") == 6
    assert metric(text, "rankserve:prefix_cache_hits_total") == 20
    assert 'rankserve:request_success_total{engine="1",finished_reason="length",model_name="tiny"} 1.0' in text


def test_lora_info_is_the_union_over_replicas():
    """One lora_requests_info series for the deployment: each replica reports only its own
    adapters, so the gauge shows the union (it flipped between replicas before)."""
    m = Metrics("m", num_engines=2)
    m.record_stats(SchedulerStats(max_lora=2, running_lora_adapters="a", waiting_lora_adapters=""), 0)
    m.record_stats(SchedulerStats(max_lora=2, running_lora_adapters="b,c", waiting_lora_adapters="d"), 1)
    text = m.exposition().decode()
    assert 'running_lora_adapters="a,b,c"' in text and 'waiting_lora_adapters="d"' in text
    assert text.count("rankserve:lora_requests_info{") == 1


# ---- per-request phase histograms (vLLM's queue / prefill / decode / inference / TPOT) -------
PHASES = ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token")


def test_request_phases_arithmetic():
    """vLLM's intervals over engine timestamps: queued → first scheduled → first token → last
    token; TPOT is the decode time over the tokens after the first (none for one token)."""
    from rankserve.runtime.serve.metrics import request_phases
    queue, prefill, decode, inference, tpot = request_phases(10.0, 10.5, 11.25, 13.25, 5)
    assert (queue, prefill, decode, inference, tpot) == (0.5, 0.75, 2.0, 2.75, 0.5)
    assert prefill + decode == inference  # the running phase is prefill then decode
    assert queue + inference == 13.25 - 10.0  # queued → last token, within the e2e latency
    assert request_phases(10.0, 10.5, 11.0, 11.0, 1) == (0.5, 0.5, 0.0, 0.5, None)
    assert request_phases(1.0, 1.0, 1.5, 2.5, 3)[4] == 0.5


def test_request_phase_histograms_have_vllms_buckets_and_skip_missing_timing():
    m = Metrics("tiny")
    m.record_finished("length", 5, 5, 3.5, timing=(10.0, 10.5, 11.25, 13.25))
    m.record_finished("stop", 5, 1, 1.5, timing=(10.0, 10.5, 11.0, 11.0))
    m.record_finished("abort", 5, 2, 0.5)  # no engine timing: only the existing series
    text = m.exposition().decode()
    counts = {p: metric(text, f"rankserve:request_{p}_seconds_count") for p in PHASES}
    sums = {p: metric(text, f"rankserve:request_{p}_seconds_sum") for p in PHASES}
    assert counts == dict.fromkeys(PHASES[:4], 2) | {"time_per_output_token": 1}
    assert sums == {"queue_time": 1.0, "prefill_time": 1.25, "decode_time": 2.0,
                    "inference_time": 3.25, "time_per_output_token": 0.5}
    assert metric(text, "rankserve:e2e_request_latency_seconds_count") == 3  # unchanged series
    les = lambda name: re.findall(rf'^rankserve:{name}_bucket{{engine="0",le="([^"]+)"', text, re.M)  # noqa: E731
    request_latency = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0",
                       "20.0", "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0",
                       "1920.0", "7680.0", "+Inf"]
    for p in PHASES[:4]:
        assert les(f"request_{p}_seconds") == request_latency, p
    assert les("request_time_per_output_token_seconds") == [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0",
        "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"]


def test_scheduler_records_queued_and_first_scheduled_times(monkeypatch):
    """The engine stamps a request when it enters the waiting queue and when it is first
    scheduled (a preempted request keeps that time, as vLLM's), and sends both with the request's
    first output; output batches carry the same clock."""
    import itertools
    import types

    from rankserve.runtime import scheduler as scheduler_mod
    from rankserve.runtime.config import CacheConfig, SchedulerConfig
    from rankserve.runtime.messages import EngineCoreRequest
    from rankserve.runtime.model_runner import ModelRunnerOutput
    from rankserve.runtime.request import Request
    from rankserve.runtime.sampling_params import SamplingParams
    ticks = itertools.count(1)
    monkeypatch.setattr(scheduler_mod, "time", types.SimpleNamespace(
        monotonic=lambda: float(next(ticks)), perf_counter=time.perf_counter))
    sched = scheduler_mod.Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                                    CacheConfig(block_size=4), num_blocks=4, max_model_len=64)
    reqs = {rid: Request(EngineCoreRequest(rid, list(range(1, 7)), SamplingParams(
        max_tokens=8, ignore_eos=True), arrival_time=t), 64) for rid, t in (("a", 1.0), ("b", 2.0))}
    for r in reqs.values():
        sched.add_request(r)
    queued = {rid: r.queued_ts for rid, r in reqs.items()}
    assert 0 < queued["a"] < queued["b"]
    first_scheduled, first_outputs, stamps = {}, {}, []
    while sched.has_work:
        plan = sched.schedule()
        for rid in plan.num_scheduled_tokens:
            first_scheduled.setdefault(rid, reqs[rid].scheduled_ts)
        done = [rid for rid in plan.num_scheduled_tokens
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        outs = sched.update(plan, ModelRunnerOutput(done, [7] * len(done)))
        for o in outs.outputs:
            if o.scheduled_ts:
                assert o.request_id not in first_outputs  # once per request
                first_outputs[o.request_id] = (o.queued_ts, o.scheduled_ts, outs.timestamp)
        stamps.append(outs.timestamp)
    assert reqs["b"].num_preemptions >= 1  # 4 blocks of 4 tokens: b gave its blocks to a
    assert stamps == sorted(stamps)
    for rid, r in reqs.items():
        assert r.scheduled_ts == first_scheduled[rid] > queued[rid]  # not the rescheduling time
        q, s, t = first_outputs[rid]
        assert (q, s) == (queued[rid], r.scheduled_ts) and t > s


def test_request_success_series_exist_from_the_start():
    """As vLLM's: every documented finished_reason has its series (at 0) before a request, so a
    dashboard's rate(...{finished_reason="stop"}) reads 0, not "no data", on an idle server."""
    text = Metrics("tiny", num_engines=2).exposition().decode()
    for engine in ("0", "1"):
        for reason in ("stop", "length", "abort"):
            line = (f'rankserve:request_success_total{{engine="{engine}",finished_reason="{reason}",'
                    'model_name="tiny"} 0.0')
            assert line in text, text[:3000]
