"""Preemption with the host KV tier: swap where copying is cheaper than recomputing
(runtime/preemption.py), recompute elsewhere, `--preemption-mode` to force either; the same
greedy tokens every way."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from conftest import STORIES_EMBEDDED
from rankserve.runtime.config import ConfigError
from rankserve.runtime.llm import LLM
from rankserve.runtime.messages import SchedulerStats
from rankserve.runtime.preemption import SwapCostModel
from rankserve.runtime.sampling_params import SamplingParams
from rankserve.runtime.serve.metrics import Metrics
from test_server import metric

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (21, 30, 25, 27)]  # distinct


def test_cost_model_recompute_grows_faster_than_the_copies():
    # per token: 2e6 linear + 1e4 × context attention FLOPs at 1 TFLOP/s; 64 KiB a block at 1 GB/s
    m = SwapCostModel(flops_per_token=2e6, attn_flops_per_context=1e4, head_flops=0, block_size=16,
                      block_bytes=64 << 10, peak_flops=1e12, link_bytes_per_s=1e9)
    assert m.recompute_seconds(16) == pytest.approx((2e6 * 16 + 1e4 * 16 * 17 / 2) / 1e12)
    assert m.swap_seconds(3) == pytest.approx(2 * 3 * (64 << 10) / 1e9)
    # a block costs 131 us to copy both ways; recomputing one costs 32 us plus the attention,
    # which grows with the prefix (even at ~1240 tokens): short prefixes recompute, long ones swap
    assert not m.prefers_swap(16) and not m.prefers_swap(15 * 16)
    assert m.prefers_swap(256 * 16)
    assert not m.prefers_swap(15)  # no full block: nothing to swap


@pytest.fixture(scope="module")
def reference():
    llm = LLM(str(STORIES_EMBEDDED), max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize("link_gbps, mode, swaps", [
    (1e6, None, True),  # cheap copies: the cost model swaps
    (1e-6, None, False),  # expensive copies: it recomputes
    (1e-6, "swap", True),  # forced either way
    (1e6, "recompute", False),
])
def test_preemption_swaps_only_where_cheaper(monkeypatch, reference, link_gbps, mode, swaps):
    monkeypatch.setenv("RANKSERVE_HOST_LINK_GBPS", str(link_gbps))
    # 64 tokens of device KV for 4 requests of ~50: preemption; every full block is 8 tokens
    llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=8, block_size=8, max_model_len=64,
              kv_offload_size=0.01, preemption_mode=mode)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    s: SchedulerStats = llm.engine.scheduler.stats()
    assert s.num_preemptions > 0
    if swaps:  # resumed from the host tier (the prompts share nothing: only swapped blocks load)
        assert s.num_preemptions_swap == s.num_preemptions and s.host_blocks_loaded > 0
    else:
        assert s.num_preemptions_swap == 0 and s.host_blocks_loaded == 0


def test_swap_needs_the_host_tier():
    with pytest.raises(ConfigError, match="--preemption-mode swap .* --kv-offload-size"):
        LLM(str(STORIES_EMBEDDED), preemption_mode="swap")


def test_preemptions_by_kind_in_metrics():
    m = Metrics("tiny")
    m.record_stats(SchedulerStats(num_preemptions=3, num_preemptions_swap=1))
    m.record_stats(SchedulerStats(num_preemptions=5, num_preemptions_swap=2))
    text = m.exposition().decode()
    assert metric(text, "rankserve:num_preemptions_total") == 5
    assert 'rankserve:num_preemptions_by_kind_total{engine="0",kind="swap",model_name="tiny"} 2.0' in text
    assert 'rankserve:num_preemptions_by_kind_total{engine="0",kind="recompute",model_name="tiny"} 3.0' in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_rates_on_cuda_swap_the_llama_8b_shape():
    """The startup measurements are plausible on a datacenter GPU (PCIe/NVLink-C2C: > 5 GB/s,
    bf16 matmul: > 50 TFLOP/s), and for the Llama-3.1-8B shape swapping wins from one block on."""
    from rankserve.runtime.bench.common import resolve_model
    from rankserve.models.loader import load_hf_config
    from rankserve.runtime.preemption import build_cost_model
    cfg = load_hf_config(resolve_model("llama-3.1-8b")[0])
    block_bytes = 2 * 32 * 8 * 128 * 2 * 16  # K and V, 32 layers, 8 KV heads × 128, bf16, 16 tokens
    m = build_cost_model(cfg, 16, block_bytes, torch.device("cuda"))
    print(m.describe())
    assert m.link_bytes_per_s > 5e9 and m.peak_flops > 50e12
    assert m.prefers_swap(16) and m.prefers_swap(4096)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_preemption_swap_and_recompute_match_single_rank(mode):
    """Under `mpiexec -n 2 --tp 2` both ranks copy their shard of a swapped request's blocks
    out and back (or neither does): the same greedy tokens as one rank without preemption."""
    from test_multirank import PROMPTS, mpi_generate
    tight = ["--num-gpu-blocks-override", "6", "--block-size", "8", "--max-model-len", "48",
             "--kv-offload-size", "0.01", "--preemption-mode", mode]
    llm = LLM(str(STORIES_EMBEDDED), max_model_len=48)
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    one = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=6, block_size=8, max_model_len=48,
              kv_offload_size=0.01, preemption_mode=mode)  # the same flags do preempt
    one.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    s = one.engine.scheduler.stats()
    assert s.num_preemptions > 0 and s.num_preemptions_swap == (s.num_preemptions if mode == "swap" else 0)
    assert mpi_generate(2, str(STORIES_EMBEDDED), "--tp", "2", *tight) == want
