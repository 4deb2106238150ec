"""Engine behaviour: the same greedy tokens whatever the batching, caching and preemption."""
import subprocess
import sys

import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.config import ConfigError

from conftest import STORIES_EMBEDDED, STORIES_SHARED, STORIES_TEXT

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(llm):
    texts = ["Once upon a time", "The little dog ran to the park and saw a big tree with many",
             "Lily and Tom were friends. One day they", "Sam had a red ball"]
    return [{"prompt_token_ids": llm.tokenizer(t).input_ids} for t in texts]


@pytest.fixture(scope="module")
def reference(stories_llm):
    return [o.outputs[0].token_ids for o in stories_llm.generate(prompts(stories_llm), GREEDY)]


def test_stories_known_continuation(stories_llm):
    out = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    assert out[0].outputs[0].text.startswith(STORIES_TEXT)


@pytest.mark.skipif(not STORIES_SHARED.exists(), reason="../shared not present")
def test_shared_copy_matches_embedded():
    llm = LLM(str(STORIES_SHARED))
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    assert out[0].outputs[0].text.startswith(STORIES_TEXT)


def test_cli_generate_default_model():
    r = subprocess.run([sys.executable, "-m", "rankserve.launch", "generate", "--prompt",
                        "Once upon a time", "--max-tokens", "40"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ("Once upon a time" + STORIES_TEXT) in r.stdout


@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=7),  # every prompt is chunked
    dict(enable_chunked_prefill=False),
    dict(enable_prefix_caching=False),
    dict(max_num_seqs=1),
    dict(block_size=8),
    # 48 tokens of KV for 4 requests: preemption
    dict(num_gpu_blocks_override=6, block_size=8, max_model_len=48),
])
def test_same_greedy_tokens(reference, kwargs):
    llm = LLM(str(STORIES_EMBEDDED), **kwargs)
    outs = llm.generate(prompts(llm), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_seeded_sampling_survives_preemption(stories_llm):
    """A seeded request's tokens do not depend on the batch: not on being preempted and
    recomputed either (its generator continues where it was, as in vLLM)."""
    seeded = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24, ignore_eos=True)
              for i in range(4)]
    ref = [o.outputs[0].token_ids for o in stories_llm.generate(prompts(stories_llm), seeded)]
    llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=6, block_size=8, max_model_len=48)
    outs = llm.generate(prompts(llm), seeded)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    # a preempted request aborted while it waits: the runner drops the generator it parked
    from rankserve.runtime.messages import EngineCoreRequest
    eng, parked = llm.engine, llm.engine.executor.runner.batch.parked_generators
    for i, p in enumerate(prompts(llm)):
        eng.add_request(EngineCoreRequest(f"x{i}", p["prompt_token_ids"], seeded[i]))
    while not any(r.num_preemptions for r in eng.scheduler.waiting):
        eng.step()
    eng.abort_requests([r.request_id for r in eng.scheduler.waiting if r.num_preemptions])
    while eng.has_work:
        eng.step()
    llm.generate(prompts(llm)[:1], seeded[0])  # its plan carries the last finished ids
    assert not parked



def test_prompt_logprobs_once_per_token_when_preempted_mid_prefill():
    """Prompt logprobs are gathered chunk by chunk; a request preempted between its chunks
    computes them again from its first token: each prompt token still has one entry."""
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    ps = [{"prompt_token_ids": [1] + list(range(30 + 3 * i, 70 + 3 * i))} for i in range(5)]
    want = LLM(str(STORIES_EMBEDDED)).generate(ps, sp)
    llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=18, block_size=8, max_model_len=128,
              max_num_batched_tokens=16)
    outs = llm.generate(ps, sp)
    assert llm.engine.scheduler.num_preemptions > 0
    for a, b in zip(want, outs):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) == 41
        assert [e and list(e) for e in b.prompt_logprobs] == [e and list(e) for e in a.prompt_logprobs]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_generate_refuses_per_prompt_lists_of_another_length(stories_llm):
    """A list of SamplingParams or priorities must have one entry per prompt (as in vLLM): not
    prompts dropped silently, nor an IndexError."""
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="sampling_params: 1 entries for 3 prompts"):
        stories_llm.generate(["a", "b", "c"], [sp])
    with pytest.raises(ValueError, match="sampling_params: 2 entries for 1 prompts"):
        stories_llm.generate("a", [sp, sp])
    with pytest.raises(ValueError, match="priority: 1 entries for 2 prompts"):
        stories_llm.generate(["a", "b"], sp, priority=[1])
    assert not stories_llm.engine.has_work
    assert len(stories_llm.generate(["a", "b"], [sp, sp], priority=[0, 0])) == 2

def test_prefix_cache_hit_on_second_identical_prompt(stories_llm):
    p = {"prompt_token_ids": list(range(3, 60))}  # 57 tokens: 3 full blocks
    a = stories_llm.generate(p, GREEDY)[0]
    kv = stories_llm.engine.scheduler.kv
    queries, hits = kv.prefix_queries, kv.prefix_hits
    b = stories_llm.generate(p, GREEDY)[0]
    assert (kv.prefix_queries - queries, kv.prefix_hits - hits) == (57, 48)
    assert a.num_cached_tokens == 0 or a.num_cached_tokens < b.num_cached_tokens
    assert b.num_cached_tokens == 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_full_prefix_hit_recomputes_last_token(stories_llm):
    p = {"prompt_token_ids": list(range(100, 132))}  # exactly 2 blocks
    a = stories_llm.generate(p, GREEDY)[0]
    b = stories_llm.generate(p, GREEDY)[0]
    assert b.num_cached_tokens == 16  # the last block is not taken: its last token is recomputed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cache_salt_isolates_tenants(stories_llm):
    from rankserve.runtime.messages import EngineCoreRequest
    eng = stories_llm.engine
    ids = list(range(200, 240))
    for salt, expect in (("a", 0), ("b", 0), ("a", 32)):
        rid = f"salt-{salt}-{expect}"
        eng.add_request(EngineCoreRequest(rid, ids, GREEDY, cache_salt=salt))
        cached = None
        while eng.has_work:
            for o in eng.step().outputs:
                cached = o.num_cached_tokens if cached is None else cached
        assert cached == expect, salt


@pytest.mark.parametrize("policy, expect", [("priority", ["p1", "p2", "p5"]),
                                            ("fcfs", ["p5", "p1", "p2"])])
def test_policy_decides_the_order(policy, expect):
    """One request at a time: priority serves the lowest value first, fcfs the first arrival."""
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=1, scheduling_policy=policy)
    # arrival order p5, p1, p2 (arrival_time from the id's last character is not it: set below)
    from rankserve.runtime.messages import EngineCoreRequest
    eng = llm.engine
    for t, (rid, prio) in enumerate([("p5", 5), ("p1", 1), ("p2", 2)]):
        eng.add_request(EngineCoreRequest(rid, [1, 5, 9], SamplingParams(temperature=0, max_tokens=3),
                                          arrival_time=float(t), priority=prio))
    order = []
    while eng.has_work:
        order += [o.request_id for o in eng.step().outputs if o.finished]
    assert order == expect


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_cpu_kv_cache_pages_are_untouched_until_used():
    """The CPU KV cache (1 GiB by default) is zeros that cost nothing until blocks are used:
    filling it byte by byte took about 0.5 s per engine at start-up (and as long to give back),
    in every process of every test. The tokens are the same either way."""
    import gc
    gc.collect()
    before = _rss_mib()
    llm = LLM(str(STORIES_EMBEDDED), device="cpu")
    assert llm.engine.executor.runner.num_blocks * llm.engine.executor.runner.kv_bytes_per_block() > 2**29
    assert _rss_mib() - before < 128, (before, _rss_mib())
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    assert out[0].outputs[0].text.startswith(STORIES_TEXT)


def test_kv_cache_smaller_than_one_request_is_refused():
    """A KV cache below max_model_len would leave a long request waiting forever."""
    with pytest.raises(ConfigError, match=r"holds 16 tokens.*--max-model-len 512.*"
                                          r"--num-gpu-blocks-override.*--max-model-len to 16"):
        LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=1)
    r = subprocess.run([sys.executable, "-m", "rankserve.launch", "generate", "--prompt", "x",
                        "--num-gpu-blocks-override", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--gpu-memory-utilization" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # the same cache with a context that fits: a request that would outgrow it ends at the limit
    llm = LLM(str(STORIES_EMBEDDED), num_gpu_blocks_override=2, block_size=8, max_model_len=16)
    out = llm.generate({"prompt_token_ids": list(range(3, 13))},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (6, "length")


@pytest.mark.parametrize("kwargs, msg", [
    (dict(kv_cache_memory_gb=float("inf")), r"--kv-cache-memory-gb must be a finite number > 0, got inf"),
    (dict(kv_offload_size=float("inf")), r"--kv-offload-size must be a finite number >= 0, got inf"),
    # more memory than the host has: the flag and the size, not numpy's / torch's allocator error
    pytest.param(dict(kv_cache_memory_gb=1e5), r"cannot allocate the KV cache .*--kv-cache-memory-gb",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU flag")),
    (dict(kv_offload_size=1e5), r"--kv-offload-size 100000.0 GiB: cannot allocate"),
    # a host tier too small for one block would silently be no tier at all (no swap either)
    (dict(kv_offload_size=1e-9, preemption_mode="swap"),
     r"--kv-offload-size 1e-09 GiB holds no KV block .*\d+ bytes"),
])
def test_kv_memory_sizes_the_host_cannot_give_are_refused(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        LLM(str(STORIES_EMBEDDED), **kwargs)


def test_device_ids_pick_the_device_of_a_single_process(monkeypatch):
    import torch

    from rankserve.runtime.config import EngineConfig
    from rankserve.runtime.executor import UniprocExecutor
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = EngineConfig.from_kwargs(device_ids="3")
    assert cfg.device.resolve(0) == "cuda:3"
    seen = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set", str(d)))
    monkeypatch.setattr("rankserve.runtime.executor.ModelRunner",
                        lambda cfg, pi, device: seen.setdefault("runner", str(device)))
    with pytest.raises(AttributeError):  # the stub runner has no max_model_len
        UniprocExecutor(cfg)
    assert seen == {"set": "cuda:3", "runner": "cuda:3"}


def test_device_ids_without_cuda_is_an_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device-ids 1 was given but no CUDA"):
        LLM(str(STORIES_EMBEDDED), device_ids="1")


def test_async_scheduling_with_pipeline_parallelism_is_refused():
    with pytest.raises(ConfigError, match="--async-scheduling does not work with --pipeline"):
        LLM(str(STORIES_EMBEDDED), async_scheduling=True, pp=2)


@pytest.mark.parametrize("bad, msg", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [5] * 600}, "context length"),
    ({"prompt_token_ids": [1, 100000]}, "token ids"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(stories_llm, bad, msg):
    with pytest.raises(ValueError, match=msg):
        stories_llm.generate([bad, "Once upon a time"], GREEDY)
    out = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    assert out[0].outputs[0].text.startswith(STORIES_TEXT)
    assert stories_llm.engine.scheduler.kv.num_free_blocks == stories_llm.engine.num_blocks


@pytest.mark.parametrize("kw, msg", [(dict(max_tokens=-1), "max_tokens"),
                                     (dict(temperature=-0.5), "temperature"),
                                     (dict(top_p=0), "top_p")])
def test_bad_sampling_params(stories_llm, kw, msg):
    with pytest.raises(ValueError, match=msg):
        stories_llm.generate("Once", SamplingParams(**kw))


def test_unknown_architecture(tmp_path):
    import json
    import shutil
    for f in STORIES_EMBEDDED.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'FancyNewForCausalLM'"):
        LLM(str(tmp_path))


def test_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        LLM(str(STORIES_EMBEDDED), gpu_memory_utilization=1.5)
    # five CLI runs, started at once (each is mostly Python start-up); each keeps its checks
    procs = [subprocess.Popen([sys.executable, "-m", "rankserve.launch", "generate", "--prompt", "x", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in (["--max-num-seqs", "0"], ["--max-tokens", "-1"], ["/nonexistent"],
                          ["--max-model-len", "100000"], ["--device-ids", "a,b"])]
    rs = []
    for p in procs:
        try:
            rs.append((p.communicate(timeout=120)[1], p.returncode))
        finally:
            p.kill()
    (err, rc), *rest = rs
    assert rc == 2 and "--max-num-seqs must be >= 1" in err
    (err, rc), *rest = rest
    assert rc == 2 and "--max-tokens" in err
    for (err, rc), msg in zip(rest, ("MODEL '/nonexistent' is not a model directory",
                                     "--max-model-len 100000 exceeds", "--device-ids must be a comma-separated")):
        assert rc in (1, 2) and msg in err and "Traceback" not in err, err


def test_two_steps_in_flight_give_same_tokens(reference):
    """Pipeline parallelism keeps pp steps in flight; the scheduler must never schedule a
    request whose previous step has not come back, and tokens must not change."""
    from rankserve.runtime.executor import UniprocExecutor

    class Deferred(UniprocExecutor):
        max_in_flight = 2
        peak = 0
        pending = 0

        def submit(self, plan):
            Deferred.pending += 1
            Deferred.peak = max(Deferred.peak, Deferred.pending)
            return plan

        def collect(self, plan):
            Deferred.pending -= 1
            return self.runner.execute(plan)

    from rankserve.runtime.config import EngineConfig
    cfg = EngineConfig.from_kwargs(model=str(STORIES_EMBEDDED), max_num_batched_tokens=9)
    llm = LLM(config=cfg, executor=Deferred(cfg))
    outs = llm.generate(prompts(llm), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert Deferred.peak == 2
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("kwargs", [dict(), dict(max_num_batched_tokens=7), dict(max_num_seqs=2)])
def test_async_scheduling_gives_same_tokens(reference, kwargs):
    """Async scheduling runs a decode ahead of its previous token (a device-side placeholder)."""
    llm = LLM(str(STORIES_EMBEDDED), async_scheduling=True, **kwargs)
    assert llm.engine.depth == 2 and llm.engine.scheduler.async_scheduling
    outs = llm.generate(prompts(llm), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # stops, min_tokens and penalties keep their exact semantics
    p = prompts(llm)[0]
    sync = LLM(str(STORIES_EMBEDDED))
    for sp in (SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]),
               SamplingParams(temperature=0, max_tokens=7),
               SamplingParams(temperature=0, max_tokens=30, frequency_penalty=1.0),
               SamplingParams(temperature=0.8, seed=3, max_tokens=20),
               SamplingParams(temperature=0, max_tokens=12, logprobs=2)):
        a, b = llm.generate(p, sp)[0].outputs[0], sync.generate(p, sp)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), sp
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    assert not any(r.num_pending for r in llm.engine.scheduler.requests.values())


def test_async_back_to_back_batches_release_runner_state():
    """Finished ids must reach the runner even when the plan that carried them was empty."""
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=4, async_scheduling=True)
    for lens in ([1, 2, 1, 3, 1], [5, 9, 2, 7, 1, 4, 3, 8]):
        ps = [{"prompt_token_ids": list(range(3 + i, 20 + i))} for i in range(len(lens))]
        sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        outs = llm.generate(ps, sps)
        assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert len(llm.engine.executor.runner.reqs) <= 4


def test_generation_config_flags_as_vllm(tmp_path):
    """--generation-config auto (the checkpoint's sampling defaults), vllm (none of them), or a
    directory holding a generation_config.json; --override-generation-config on top (a JSON
    object of sampling fields). Both reach the offline defaults and the server's."""
    import json
    import shutil

    from rankserve.runtime.config import EngineConfig
    from rankserve.runtime.inputs import sampling_defaults
    model = tmp_path / "m"
    shutil.copytree(STORIES_EMBEDDED, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7, "max_new_tokens": 9}))
    assert sampling_defaults(str(model)) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults(str(model), "vllm") == {}
    assert sampling_defaults(str(model), str(other)) == {"top_k": 7, "max_tokens": 9}
    assert sampling_defaults(str(model), "auto", '{"temperature": 0.2, "min_p": 0.1}') == \
        {"temperature": 0.2, "top_p": 0.9, "min_p": 0.1}
    llm = LLM(str(model), generation_config="vllm", override_generation_config='{"top_k": 3}')
    sp = llm.get_default_sampling_params()
    assert sp.top_k == 3 and sp.temperature == SamplingParams().temperature
    for kw, msg in ((dict(generation_config=str(tmp_path / "nope")), "--generation-config"),
                    (dict(override_generation_config='{"temprature": 1}'), "temprature"),
                    (dict(override_generation_config="[1]"), "--override-generation-config")):
        with pytest.raises(ConfigError, match=msg):
            EngineConfig.from_kwargs(model=str(model), **kw).validate()


def test_trust_remote_code_gates_a_tokenizers_own_code(tmp_path):
    """A checkpoint whose tokenizer ships its own code (tokenizer_config auto_map): refused with
    a message naming --trust-remote-code (never transformers' interactive [y/N] prompt, which a
    terminal would wait on), loaded with it. The model code is rankserve's either way."""
    import json
    import shutil

    from rankserve.runtime.inputs import load_tokenizer
    model = tmp_path / "m"
    shutil.copytree(STORIES_EMBEDDED, model)
    (model / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    custom = True\n")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="CustomTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_tokenizer(str(model))
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLM(str(model))
    llm = LLM(str(model), trust_remote_code=True)
    assert getattr(llm.tokenizer, "custom", False)
    out = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_llm_chat_as_vllm(stories_llm):
    """LLM.chat (vLLM's offline chat): one conversation or a list of them, rendered with the
    model's chat template (or `chat_template`), generated like LLM.generate on those ids."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conv = [{"role": "system", "content": "Tell a story."},
            {"role": "user", "content": "Once upon a time"}]
    # (a chat template writes its own special tokens: none are added, as vLLM)
    ids = stories_llm.tokenizer.encode("system: Tell a story.\nuser: Once upon a time\n",
                                       add_special_tokens=False)
    want = stories_llm.generate([{"prompt_token_ids": ids}], sp)[0]
    got = stories_llm.chat(conv, sp, chat_template=template)
    assert len(got) == 1 and got[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert got[0].prompt_token_ids == ids
    two = stories_llm.chat([conv, conv[1:]], sp, chat_template=template)
    assert len(two) == 2 and two[0].outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="chat template"):  # stories ships none
        stories_llm.chat(conv, sp)
    with pytest.raises(ValueError, match="messages"):
        stories_llm.chat([], sp, chat_template=template)


def test_token_counts_take_vllms_human_readable_form():
    """--max-model-len / --max-num-batched-tokens 32k (as vLLM: k m g are powers of 1000, K M G
    of 1024); anything else is click's error naming the flag."""
    from click.testing import CliRunner

    from rankserve.launch.cli import build_config, main
    seen = []
    import rankserve.launch.cli as cli
    real = cli.build_config
    cli.build_config = lambda kw: seen.append(kw) or real(kw)
    try:
        r = CliRunner().invoke(main, ["generate", "--prompt", "x", "--max-model-len", "1k",
                                      "--max-num-batched-tokens", "2K", "--max-tokens", "1"])
    finally:
        cli.build_config = real
    assert seen and seen[0]["max_model_len"] == 1000 and seen[0]["max_num_batched_tokens"] == 2048, r.output
    r = CliRunner().invoke(main, ["generate", "--prompt", "x", "--max-model-len", "1x"])
    assert r.exit_code == 2 and "--max-model-len" in r.output
    assert build_config  # (the function the CLI builds its config with)


def test_a_step_that_fails_ends_the_llm_instead_of_hanging_it():
    """An exception inside a step (the runner's, a kernel's) leaves the engine's state half
    updated: the failing generate() raises it, and every later call raises at once, naming it
    (vLLM's dead engine), rather than the next generate() looping forever."""
    import threading
    llm = LLM(STORIES_EMBEDDED)
    runner = llm.engine.executor.runner
    real = runner.execute

    def boom(*a, **k):
        runner.execute = real
        raise RuntimeError("device fault")
    runner.execute = boom
    sp = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(["Once upon a time"], sp)
    box = []
    t = threading.Thread(target=lambda: box.append(_raises(llm.generate, ["The cat"], sp)), daemon=True)
    t.start()
    t.join(30)
    assert box, "the second generate() hung"
    assert isinstance(box[0], RuntimeError) and "device fault" in str(box[0]) and "new LLM" in str(box[0])


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None
