"""Prometheus metrics of the API process: engine stats become gauges and counters."""
from __future__ import annotations

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
