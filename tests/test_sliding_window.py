"""Sliding-window attention: greedy parity with transformers (fp32, tiny configs whose window is
shorter than the prompts, generating past it), chunked prefill equal to unchunked."""
import pytest
import torch

from rankserve import LLM, SamplingParams

from test_parity import hf_greedy, model_logits

PROMPTS = [list(range(3, 43)), [1, 5, 9, 200, 31] * 5, [1, 300, 7]]
NEW = 12  # hf_greedy's length

# (arch, config overrides): Mistral windows every layer; Qwen2 windows the layers from
# max_window_layers on; Qwen3 with explicit layer_types (interleaved)
WINDOWED = [
    ("MistralForCausalLM", dict(sliding_window=8)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=10,
                              layer_types=["sliding_attention", "full_attention"])),
]


@pytest.mark.parametrize("arch,overrides", WINDOWED, ids=[a for a, _ in WINDOWED])
def test_sliding_window_parity(checkpoint, arch, overrides):
    import transformers
    path = checkpoint(arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = [a.window for a in LLM_cache(path).engine.executor.runner.model.attention_layers()]
    assert any(windows), "the config's window was not picked up"
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    engines = [LLM_cache(path)] + ([LLM_cache(path, chunked=True)] if arch == "MistralForCausalLM"
                                   else [])  # chunking once is enough (time)
    for llm in engines:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for p, o, e in zip(PROMPTS, outs, expected):
            assert o.outputs[0].token_ids == e, f"{arch} prompt of {len(p)} tokens"
    for p in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(model_logits(LLM_cache(path), p), ref, atol=1e-4, rtol=1e-4)


_LLMS: dict = {}


def LLM_cache(path, chunked=False):
    """One engine per (checkpoint, chunking): block size 8 so blocks leave the window."""
    key = (path, chunked)
    if key not in _LLMS:
        _LLMS.clear() if len(_LLMS) > 4 else None
        kw = dict(max_num_batched_tokens=16, max_num_seqs=4) if chunked else dict(max_num_seqs=8)
        _LLMS[key] = LLM(path, dtype="float32", block_size=8, **kw)
    return _LLMS[key]


def test_gemma3_parity(checkpoint):
    """Gemma 3 (interleaved local/global layers, two RoPE bases, soft-capping, (1 + w) norms,
    embedding scaling) against transformers' eager attention, chunked and not."""
    import transformers
    path = checkpoint("Gemma3ForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    for llm in (LLM_cache(path), LLM_cache(path, chunked=True)):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for p, o, e in zip(PROMPTS, outs, expected):
            assert o.outputs[0].token_ids == e, f"prompt of {len(p)} tokens"
    for p in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(model_logits(LLM_cache(path), p), ref, atol=1e-4, rtol=1e-4)


def test_cache_smaller_than_the_context_serves_a_window_model(checkpoint):
    """Every layer windowed (Mistral, window 16): a request holds at most its window and one
    step's tokens, so a KV cache far below --max-model-len serves prompts longer than the cache
    (as vLLM sizes it), with the same greedy tokens and no block left held; a cache below even
    that is refused at startup."""
    from rankserve.runtime.config import ConfigError
    path = checkpoint("MistralForCausalLM", sliding_window=16)
    prompts = [{"prompt_token_ids": [3 + (i * 37 + j) % 500 for j in range(n)]}
               for i, n in enumerate((200, 30, 120))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, max_model_len=256).generate(prompts, params)]
    # window 15 + 8 step tokens: 3 blocks of 8, one more for the straddling block, the null block
    tight = dict(max_model_len=256, block_size=8, max_num_batched_tokens=8)
    llm = LLM(path, num_gpu_blocks_override=5, **tight)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    with pytest.raises(ConfigError, match="holds 24 tokens"):  # 4 blocks, one the null block
        LLM(path, num_gpu_blocks_override=4, **tight)


def test_window_cache_of_exactly_max_model_len_is_refused_not_hung(checkpoint):
    """Window 12 + a 96-token step covers the whole 96-token context, so a request may hold every
    block of it; 12 blocks of 8 are 96 tokens, but one of them is the null block: a 95-token
    prompt waited forever for a 12th usable block on an idle engine. Refused at startup now;
    one block more serves it."""
    from rankserve.runtime.config import ConfigError
    path = checkpoint("MistralForCausalLM", sliding_window=12)
    tight = dict(max_model_len=96, block_size=8, max_num_batched_tokens=96)
    with pytest.raises(ConfigError, match=r"holds 88 tokens \(11 usable blocks"):
        LLM(path, num_gpu_blocks_override=12, **tight)
    prompt = [{"prompt_token_ids": [3 + j * 7 % 500 for j in range(95)]}]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    want = LLM(path, max_model_len=96).generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(path, num_gpu_blocks_override=13, **tight)
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_prefix_hit_filling_the_cache_is_served(checkpoint):
    """Every layer windowed, prefix caching on (the default), a KV cache of 4 usable blocks: a
    prompt whose cached prefix fills the whole cache (that of an earlier 32-token prompt) and
    goes on past it is served, with the tokens of an engine without the cache. The hit's blocks
    before the window are never read; taking them made it wait for blocks it would release at
    once, forever (an idle engine, nothing to preempt)."""
    from rankserve.runtime.messages import EngineCoreRequest
    path = checkpoint("MistralForCausalLM", sliding_window=16)
    first, prompt = list(range(3, 35)), list(range(3, 35)) + list(range(100, 120))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(path, max_model_len=256).generate([{"prompt_token_ids": prompt}], params)
    llm = LLM(path, max_model_len=256, block_size=8, max_num_batched_tokens=8, num_gpu_blocks_override=5)
    llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1))
    engine, got = llm.engine, []
    engine.add_request(EngineCoreRequest("b", prompt, params, 0.0, 0))
    for _ in range(100):  # 7 prefill chunks and 6 decodes (a step each) suffice
        got += [t for o in engine.step().outputs for t in o.new_token_ids]
        if not engine.has_work:
            break
    assert not engine.has_work, "the request was never scheduled"
    assert engine.scheduler.kv.prefix_hits == 32
    assert got == want[0].outputs[0].token_ids
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_block_of_a_step_dropped_by_a_preemption_is_not_a_prefix_hit(checkpoint):
    """Every layer windowed (8), a tight cache, priority preemption: a request whose decode had
    just been planned, and whose next block filled with it, was then preempted in the same plan
    (for a more urgent one). Its blocks past what was computed must leave the prefix cache (the
    step never ran), but with blocks already out of the window the cut was counted without
    them: the block stayed findable, and a follow-up turn continuing that conversation read a
    position whose KV was never written (other greedy tokens than an unconstrained engine's)."""
    import random
    from rankserve.runtime.config import EngineConfig
    from rankserve.runtime.engine_core import EngineCore
    from rankserve.runtime.executor import UniprocExecutor
    from rankserve.runtime.messages import EngineCoreRequest

    path = checkpoint("MistralForCausalLM", sliding_window=8)

    def engine(**kw):
        cfg = EngineConfig.from_kwargs(model=path, dtype="float32", block_size=8, max_model_len=96,
                                       max_num_seqs=6, scheduling_policy="priority", **kw)
        return EngineCore(cfg, UniprocExecutor(cfg))

    def run(eng, trace):  # [(arrival step, id, prompt, max_tokens, priority)] → id → tokens
        got, step = {}, 0
        while trace or eng.has_work:
            for arrival, rid, prompt, max_tokens, prio in [t for t in trace if t[0] <= step]:
                trace.remove((arrival, rid, prompt, max_tokens, prio))
                eng.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True), float(step), prio))
            for o in eng.step().outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
            assert step < 500
        return got

    rng = random.Random(0)
    # (arrival step, prompt length, max_tokens, priority): scheduling depends on these alone;
    # r0's decode of position 15, which fills its block 1, is planned and then dropped by a
    # preemption, its block 0 already out of the window
    shape = [(0, 14, 24, 1), (0, 30, 11, 0), (0, 34, 28, 2), (0, 30, 29, 1), (0, 23, 19, 0), (1, 7, 13, 2)]
    trace = [(s, f"r{i}", [rng.randrange(3, 500) for _ in range(n)], m, p)
             for i, (s, n, m, p) in enumerate(shape)]
    free = engine(num_gpu_blocks_override=200)
    r0 = trace[0][2] + run(free, list(trace))["r0"]
    follow_up = (13, "next", r0[:24], 8, 0)  # r0's conversation so far, continued
    want = run(free, [follow_up])["next"]
    tight = engine(num_gpu_blocks_override=6, max_num_batched_tokens=24)
    got = run(tight, trace + [follow_up])
    assert tight.scheduler.num_preemptions > 0
    assert got["next"] == want
    assert tight.scheduler.kv.num_free_blocks == tight.scheduler.kv.num_blocks


def test_window_cache_counts_a_drafters_lookahead(checkpoint):
    """Every layer windowed (8), a draft model writing 3 slots past each step's token, 1-token
    steps: a cache of 3 blocks (window - 1 + the step, a straddling block, the null block) was
    accepted, but a decode at an unlucky offset needs a third usable block for the lookahead:
    the lone request preempted itself and came back to the same place, forever. Refused now,
    naming the blocks it needs; 4 blocks serve it with the plain greedy tokens."""
    from rankserve.runtime.config import ConfigError
    path = checkpoint("MistralForCausalLM", sliding_window=8)
    prompt = [{"prompt_token_ids": [3 + (j * 37) % 500 for j in range(10)]}]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(path, max_model_len=96).generate(prompt, params)[0].outputs[0].token_ids
    tight = dict(max_model_len=96, block_size=8, max_num_batched_tokens=1, speculative_config={
        "method": "draft_model", "model": path, "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="sliding window 8: or at least 4 blocks"):
        LLM(path, num_gpu_blocks_override=3, **tight)
    llm = LLM(path, num_gpu_blocks_override=4, **tight)
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
