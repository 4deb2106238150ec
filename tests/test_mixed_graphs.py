"""--cudagraph-mode full: CUDA graphs for steps with prompt tokens, one per token bucket, over
inputs padded to the bucket (padding tokens write no KV, padding requests have no query).

On CPU the padding is checked with a stand-in for the graph (its replay runs the forward over
the same padded buffers a graph would read); the CUDA test compares real graphs with eager."""
from __future__ import annotations

import random

import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.config import CompilationConfig, ConfigError, EngineConfig

from conftest import STORIES_EMBEDDED


class ReplayForward:
    """What a captured graph does on replay: the forward over the buffers it was captured on."""

    def __init__(self, forward, args, log):
        self.forward, self.args, self.log = forward, args, log
        self.out = forward(*args)

    def replay(self):
        self.log.append(self.args[0].shape[0])
        self.out.copy_(self.forward(*self.args))


def mixed_prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(5, 90))]}
            for _ in range(12)]


@pytest.mark.parametrize("model", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM",
                                   "MixtralForCausalLM", "DeepseekV3ForCausalLM"])
def test_padded_buckets_give_the_eager_tokens(checkpoint, model):
    """Every family --cudagraph-mode auto gives mixed graphs to (sliding windows, MoE routing of
    padding tokens, MLA): the padded buckets' steps give eager's tokens and logprobs."""
    path = checkpoint(model)
    # a small budget: prompts are chunked beside running decodes (mixed steps of many sizes)
    common = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=160)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    eager = LLM(path, **common).generate(mixed_prompts(), sp)
    llm = LLM(path, **common)
    cm = llm.engine.executor.runner.compiled_model
    replays = []
    cm.mixed = True  # as compile() sets it on CUDA with --cudagraph-mode full
    captured = []
    cm._capture_mixed = lambda T2: captured.append(T2) or (lambda g: (g, g.out))(
        ReplayForward(cm.forward, cm.mixed_inputs(T2), replays))
    cm.capture_mixed_graphs()  # at start-up: every bucket, largest first, over all-padding steps
    assert captured == sorted(cm.mixed_sizes(), reverse=True) and set(cm.mixed_graphs) == set(captured)
    padded = llm.generate(mixed_prompts(), sp)
    assert len(captured) == len(cm.mixed_sizes())  # none captured while serving
    assert replays and len(set(replays)) >= 2  # steps of several buckets replayed their graphs
    for a, b in zip(eager, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(la) == list(lb)
            assert [x.logprob for x in la.values()] == pytest.approx([x.logprob for x in lb.values()], abs=1e-4)


def test_buckets_cover_the_budget(checkpoint):
    llm = LLM(str(STORIES_EMBEDDED), max_num_batched_tokens=3000, max_num_seqs=4)
    sizes = llm.engine.executor.runner.compiled_model.mixed_sizes()
    assert sizes[:3] == [64, 128, 256] and sizes[-1] == 3000 and sorted(sizes) == sizes
    assert all(b - a <= 512 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("kw, msg", [
    (dict(cudagraph_mode="full", device="cpu"), "needs CUDA graphs"),
    (dict(cudagraph_mode="full", enforce_eager=True), "needs CUDA graphs"),
    (dict(cudagraph_mode="full", compilation_level=0), "needs CUDA graphs"),
    (dict(cudagraph_mode="piecewise"), "--cudagraph-mode must be one of auto, decode, full"),
])
def test_refused_where_it_cannot_run(kw, msg):
    with pytest.raises((ConfigError, ValueError), match=msg):
        LLM(str(STORIES_EMBEDDED), **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_device_auto_without_cuda_refuses_full_before_loading(monkeypatch):
    """--device auto (the default) on a machine without CUDA runs on the CPU: --cudagraph-mode
    full is refused when the flags are read, before any weight loads."""
    from rankserve.models import loader

    def no_load(*a, **kw):
        raise AssertionError("weights loaded before the flags were refused")
    monkeypatch.setattr(loader, "load_weights", no_load)
    monkeypatch.setattr(loader, "build_model", no_load)
    with pytest.raises(ConfigError, match="needs CUDA graphs"):
        EngineConfig.from_kwargs(model=str(STORIES_EMBEDDED), cudagraph_mode="full").validate()
    with pytest.raises(ConfigError, match="needs CUDA graphs"):
        LLM(str(STORIES_EMBEDDED), cudagraph_mode="full")


def _full_mode(cm, device="cuda", **kw):
    """cm.full_mode() as it would decide on `device` with these config changes (nothing runs)."""
    import dataclasses
    cfg = cm.cfg
    subs = {"compilation": dict(cudagraph_mode="auto"), "parallel": {}}
    for k, v in kw.items():
        subs["parallel" if k.endswith("_size") else "compilation"][k] = v
    cm.cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v)
                                         for s, v in subs.items()})
    real = cm.device
    cm.device = torch.device(device)
    try:
        return cm.full_mode()
    finally:
        cm.cfg, cm.device = cfg, real


def test_auto_mode_is_full_where_it_can_run(checkpoint):
    """The default (--cudagraph-mode auto) captures mixed steps on a single-rank CUDA engine
    and falls back to decode graphs where full mode cannot run, instead of refusing to start."""
    cm = LLM(checkpoint("Qwen3ForCausalLM"), max_num_seqs=2).engine.executor.runner.compiled_model
    assert CompilationConfig().cudagraph_mode == "auto"
    assert _full_mode(cm) is True
    assert _full_mode(cm, device="cpu") is False
    assert _full_mode(cm, enforce_eager=True) is False
    assert _full_mode(cm, compilation_level=0) is False
    assert _full_mode(cm, tensor_parallel_size=2) is False
    assert _full_mode(cm, pipeline_parallel_size=2) is False
    assert _full_mode(cm, cudagraph_mode="decode") is False
    assert cm.mixed is False  # this engine is on the CPU: no mixed graphs were set up


def test_auto_mode_without_cuda_graphs_says_so(caplog):
    """Where no CUDA graphs run at all (CPU, --enforce-eager, level 0), the default auto mode's
    start-up says nothing about it (it logged "decode graphs only" on every CPU start)."""
    with caplog.at_level("INFO", logger="rankserve.runtime.compilation"):
        LLM(str(STORIES_EMBEDDED), max_num_seqs=2)
    assert "--cudagraph-mode" not in caplog.text


def test_auto_mode_falls_back_for_recurrent_layers(checkpoint):
    cm = LLM(checkpoint("NemotronHForCausalLM"), max_num_seqs=2).engine.executor.runner.compiled_model
    assert _full_mode(cm) is False
    with pytest.raises(ConfigError, match="recurrent"):
        _full_mode(cm, cudagraph_mode="full")


def test_data_parallel_replicas_of_one_rank_may_use_it():
    """Each --data-parallel-size replica is an engine of its own: one rank each, as full mode
    needs (it was refused because the job had several ranks); TP inside a replica is not."""
    from rankserve.runtime.config import (CompilationConfig, DeviceConfig, EngineConfig, ModelConfig,
                                          ParallelConfig)
    ok = EngineConfig(model=ModelConfig(str(STORIES_EMBEDDED)), device=DeviceConfig(device="cuda"),
                      compilation=CompilationConfig(cudagraph_mode="full"),
                      parallel=ParallelConfig(data_parallel_size=2))
    ok.validate()
    bad = EngineConfig(model=ModelConfig(str(STORIES_EMBEDDED)), device=DeviceConfig(device="cuda"),
                       compilation=CompilationConfig(cudagraph_mode="full"),
                       parallel=ParallelConfig(data_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="single-rank"):
        bad.validate()


def test_cli_refuses_it_with_tensor_parallelism():
    from click.testing import CliRunner
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["serve", str(STORIES_EMBEDDED), "--cudagraph-mode", "full",
                                  "--tensor-parallel-size", "2"])
    assert r.exit_code != 0 and "single-rank" in r.output, r.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_mixed_graphs_match_eager(checkpoint, model, level):
    path = checkpoint(model)
    common = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=160,
                  gpu_memory_utilization=0.3)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = LLM(path, enforce_eager=True, **common).generate(mixed_prompts(), sp)
    llm = LLM(path, compilation_level=level, cudagraph_mode="full", **common)
    cm = llm.engine.executor.runner.compiled_model
    graphs = dict(cm.mixed_graphs)  # captured at start-up, every bucket
    assert set(graphs) == set(cm.mixed_sizes()) and all(g is not None for g in graphs.values()), graphs
    out = llm.generate(mixed_prompts(), sp)
    assert cm.mixed_graphs == graphs
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model, kw", [
    ("LlamaForCausalLM", {}), ("MistralForCausalLM", {}), ("Qwen2ForCausalLM", {}),
    ("Gemma3ForCausalLM", {}), ("MixtralForCausalLM", {}), ("DeepseekV2ForCausalLM", {}),
    ("DeepseekV3ForCausalLM", {}), ("Qwen3ForCausalLM", dict(kv_cache_dtype="fp8")),
    ("Qwen3ForCausalLM", dict(enable_prefix_caching=True)), ("NemotronHForCausalLM", {}),
])
def test_gpu_default_mode_matches_eager_across_families(checkpoint, model, kw):
    """The default (--cudagraph-mode auto) replays mixed-step graphs on every family that can
    take them (recurrent layers fall back to decode graphs) and gives eager's greedy tokens."""
    path = checkpoint(model)
    common = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=160,
                  gpu_memory_utilization=0.3, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts()
    if kw.get("enable_prefix_caching"):  # the second half shares the first half's prompts
        prompts = prompts[:6] + [{"prompt_token_ids": p["prompt_token_ids"] + [7, 8, 9]}
                                 for p in prompts[:6]]
    eager_llm = LLM(path, enforce_eager=True, **common)
    eager = [eager_llm.generate(prompts[:6], sp), eager_llm.generate(prompts[6:], sp)]
    del eager_llm
    llm = LLM(path, **common)
    cm = llm.engine.executor.runner.compiled_model
    recurrent = model.startswith("NemotronH")
    assert cm.mixed is not recurrent and bool(cm.mixed_graphs) is not recurrent
    assert all(g is not None for g in cm.mixed_graphs.values())
    out = [llm.generate(prompts[:6], sp), llm.generate(prompts[6:], sp)]
    for a, b in zip(eager, out):
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_auto_mode_keeps_decode_graphs_with_lora_or_speculative_decoding(checkpoint):
    """Not compared with eager on the GPU yet: auto leaves those engines on decode graphs (an
    explicit --cudagraph-mode full still runs them)."""
    cm = LLM(checkpoint("Qwen3ForCausalLM"), max_num_seqs=2).engine.executor.runner.compiled_model
    import dataclasses
    cfg = cm.cfg
    try:
        cm.cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enable_lora=True))
        assert _full_mode(cm) is False and _full_mode(cm, cudagraph_mode="full") is True
        cm.cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(
            cfg.speculative, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'))
        assert cm.cfg.spec is not None
        assert _full_mode(cm) is False and _full_mode(cm, cudagraph_mode="full") is True
    finally:
        cm.cfg = cfg
