"""Speculative decoding (issue 16): the config, the rejection sampler on synthetic distributions
(exact: it must sample the target distribution whatever the drafts), n-gram lookup, and end to
end: greedy output with n-gram and with a draft model equals plain decoding (stories260K, tiny
random Llama / Qwen3), and seeded temperature-1 / top-p samples have the same distribution."""
from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.bench.draft import cut_draft
from rankserve.runtime.config import ConfigError, EngineConfig, parse_speculative_config
from rankserve.runtime.rejection_sampler import SpecBatch, rejection_sample
from rankserve.runtime.spec_decode import propose_ngram

from conftest import STORIES_EMBEDDED, assert_logprobs_close

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom went to the",
           "The cat sat on the mat. The cat sat on the"]


def stories_draft(path, num_layers: int = 3) -> str:
    """A draft model made from stories260K: its first `num_layers` layers (same tokenizer)."""
    return cut_draft(str(STORIES_EMBEDDED), str(path), num_layers)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return stories_draft(tmp_path_factory.mktemp("draft"))


# ---- config ------------------------------------------------------------------------------------
def test_config_parses_vllm_keys_and_refuses_the_rest():
    p = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                 '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert (p.method, p.num_speculative_tokens, p.prompt_lookup_min, p.prompt_lookup_max) == ("ngram", 5, 2, 4)
    p = parse_speculative_config({"model": str(STORIES_EMBEDDED), "num_speculative_tokens": 2})
    assert p.method == "draft_model"
    for bad, words in [({"method": "eagle", "num_speculative_tokens": 2}, ["eagle", "needs \"model\""]),
                       ({"method": "medusa", "num_speculative_tokens": 1}, ["medusa", "method must be one of"]),
                       ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
                        ["disable_by_batch_size"]),
                       ({"method": "ngram"}, ["num_speculative_tokens"]),
                       ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nope"}, ["model"]),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                         "prompt_lookup_max": 2}, ["prompt_lookup_min"]),
                       ("{not json", ["JSON"])]:
        with pytest.raises(ConfigError) as e:
            parse_speculative_config(bad)
        assert "--speculative-config" in str(e.value) and all(w in str(e.value) for w in words), e.value
    for extra, word in [(dict(pp=2), "pipeline"), (dict(kv_offload_size=1.0, speculative_config={
                            "method": "draft_model", "model": str(STORIES_EMBEDDED),
                            "num_speculative_tokens": 2}), "kv-offload-size"),
                        (dict(tp=2, speculative_config={**NGRAM, "draft_tensor_parallel_size": 1}),
                         "draft_tensor_parallel_size")]:
        kw = {"speculative_config": NGRAM, **extra}
        with pytest.raises(ConfigError, match=word):
            EngineConfig.from_kwargs(**kw)


def test_cli_flag_is_refused_with_a_clear_message():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "rankserve.launch", "generate", "--prompt", "x",
                        "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "eagle3" in r.stderr and 'needs "model"' in r.stderr, r.stderr[-2000:]


# ---- rejection sampler -------------------------------------------------------------------------
def _freq(x: torch.Tensor, V: int) -> np.ndarray:
    return np.bincount(x.numpy(), minlength=V) / max(len(x), 1)


@pytest.mark.parametrize("draft_kind", ["one_hot", "probs"])
def test_rejection_sampler_keeps_the_target_distribution(draft_kind):
    """N independent requests, 2 drafts each, one call: the first emitted token follows p0, and
    where the first draft was accepted the second follows p1. Tolerance: 5 standard errors of
    a frequency (sqrt(p(1-p)/N)), plus 0.005."""
    torch.manual_seed(0)
    V, K, N = 6, 2, 40000
    p = torch.softmax(torch.randn(K + 1, V) * 1.5, -1)  # p0, p1, p2
    q = torch.softmax(torch.randn(K, V), -1)
    if draft_kind == "probs":  # drafts sampled from q
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(K)], 1)
    else:  # a fixed guess (n-gram style): one-hot q
        drafts = torch.tensor([[int(p[0].argsort()[-2]), 3]]).repeat(N, 1)
    probs = p.repeat(N, 1)  # rows: request i owns 3i, 3i + 1, 3i + 2
    draft_probs = None
    if draft_kind == "probs":
        draft_probs = torch.cat([q, torch.zeros(1, V)]).repeat(N, 1)
    spec = SpecBatch(drafts, torch.full((N,), K), torch.arange(N) * (K + 1), draft_probs)
    tokens, acc = rejection_sample(probs, probs.argmax(-1), torch.ones(N), spec)
    first = tokens[:, 0]
    tol = lambda pr, n: 5 * np.sqrt(pr * (1 - pr) / n) + 0.005  # noqa: E731
    assert np.all(np.abs(_freq(first, V) - p[0].numpy()) < tol(p[0].numpy(), N))
    kept = acc >= 1
    second = tokens[kept, 1]
    n = int(kept.sum())
    assert n > 2000
    assert np.all(np.abs(_freq(second, V) - p[1].numpy()) < tol(p[1].numpy(), n))
    # the accepted count agrees with the emitted tokens
    assert torch.all(first[kept] == drafts[kept, 0]) and torch.all((acc == 0) | (first == drafts[:, 0]))


def test_rejection_sampler_with_top_p_target():
    """A truncated target (top-p zeroes a tail): drafts in the tail are always rejected and the
    emitted distribution is the truncated one."""
    V, N = 5, 30000
    p0 = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    probs = torch.stack([p0, p0]).repeat(N, 1)
    drafts = torch.full((N, 1), 4)  # always outside the nucleus
    spec = SpecBatch(drafts, torch.ones(N, dtype=torch.long), torch.arange(N) * 2)
    torch.manual_seed(1)
    tokens, acc = rejection_sample(probs, probs.argmax(-1), torch.ones(N), spec)
    assert int(acc.sum()) == 0
    assert np.allclose(_freq(tokens[:, 0], V), p0.numpy(), atol=0.02)


def test_rejection_sampler_greedy_rows_and_mixed_draft_counts():
    """Greedy rows accept exactly the argmax prefix; requests with 0..K drafts in one batch."""
    V = 8
    logits = torch.randn(7, V)
    greedy = logits.argmax(-1)
    # request 0: 3 drafts (rows 0-3), request 1: 0 drafts (row 4), request 2: 1 draft (rows 5-6)
    drafts = torch.tensor([[greedy[0], greedy[1], (greedy[2] + 1) % V],
                           [0, 0, 0], [greedy[5], 0, 0]])
    spec = SpecBatch(drafts, torch.tensor([3, 0, 1]), torch.tensor([0, 4, 5]))
    tokens, acc = rejection_sample(None, greedy, torch.zeros(3), spec)
    assert acc.tolist() == [2, 0, 1]
    assert tokens[0, :3].tolist() == [greedy[0], greedy[1], greedy[2]]
    assert tokens[1, 0] == greedy[4] and tokens[2, :2].tolist() == [greedy[5], greedy[6]]


def test_rejection_sampler_seeded_requests_are_reproducible():
    V, N = 10, 4
    probs = torch.softmax(torch.randn(N * 3, V), -1)
    spec = SpecBatch(torch.randint(0, V, (N, 2)), torch.full((N,), 2), torch.arange(N) * 3)
    runs = []
    for _ in range(2):
        gens = {i: torch.Generator().manual_seed(100 + i) for i in range(N)}
        runs.append(rejection_sample(probs, probs.argmax(-1), torch.ones(N), spec, gens))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# ---- n-gram lookup -----------------------------------------------------------------------------
def test_ngram_lookup_is_vectorised_over_the_batch():
    toks = np.array([[1, 2, 3, 4, 1, 2, 3, 0, 0],     # "1 2 3" seen before → 4, 1, 2 (k=3)
                     [5, 6, 7, 8, 9, 5, 6, 0, 0],     # "5 6" → 7, 8, 9
                     [1, 1, 1, 1, 1, 1, 1, 1, 1],     # the latest occurrence: one token, then its period
                     [3, 4, 5, 6, 7, 8, 9, 9, 2]])    # no earlier "9 2", "2": none
    lens = np.array([7, 7, 9, 9])
    out = propose_ngram(toks, lens, 1, 3, np.array([3, 3, 3, 3]))
    assert out == [[4, 1, 2], [7, 8, 9], [1, 1, 1], []]  # the last one continued periodically
    assert propose_ngram(toks, lens, 1, 3, np.array([1, 0, 3, 3]))[:2] == [[4], []]
    # "5 6 7 5 6": "5 6" → 7, then the period 7 5 6 → 7 5 6 7
    assert propose_ngram(np.array([[5, 6, 7, 5, 6]]), np.array([5]), 2, 2, np.array([4])) == [[7, 5, 6, 7]]
    assert propose_ngram(toks, lens, 3, 3, np.array([3, 3, 3, 3]))[1] == []  # "9 5 6" is new


# ---- bench helpers -----------------------------------------------------------------------------
def test_bench_acceptance_summary_and_repeat_prompts():
    from rankserve.runtime.bench import common
    s = common.spec_summary((2, 8, 3, [2, 1]), (12, 48, 23, [12, 6, 4, 1]))
    assert s["num_drafts"] == 10 and s["acceptance_rate"] == 20 / 40
    assert s["mean_acceptance_length"] == 3.0 and s["acceptance_per_pos"] == [1.0, 0.5, 0.4, 0.1]
    assert common.spec_summary((1, 2, 3, []), (1, 2, 3, [])) is None
    assert "acceptance length 3.00" in common.format_spec(s)
    wl = common.make_workload(2, (40, 40), (8, 8), 1000, 0, repeat_period=16)
    for p in wl.prompts:
        assert len(p) == 40 and p[16:32] == p[:16] and p[32:] == p[:8]


# ---- end to end --------------------------------------------------------------------------------
def _greedy(llm, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 40), **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def stories_base():
    return LLM(str(STORIES_EMBEDDED), max_num_seqs=8, kv_cache_memory_gb=0.05)


def test_stories_greedy_ngram_and_draft_equal_plain(stories_base, draft_dir):
    want = _greedy(stories_base, PROMPTS, max_tokens=36)
    for spec in (NGRAM, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}):
        llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=8, kv_cache_memory_gb=0.05,
                  speculative_config=spec)
        assert _greedy(llm, PROMPTS, max_tokens=36) == want, spec["method"]
        s = llm.engine.scheduler.stats()
        assert s.spec_num_drafts > 0 and 0 < s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
        assert s.spec_accepted_per_pos[0] >= s.spec_accepted_per_pos[-1]
        assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_stories_greedy_under_pressure(stories_base, draft_dir):
    """Chunked prefill (budget 16), a prefix cache hit (same prompt twice), preemption (a KV
    cache of 14 blocks of 8 for 6 requests), penalties and min_tokens, async scheduling (the
    draft-model run): same tokens as plain."""
    prompts = PROMPTS * 2
    kw = dict(repetition_penalty=1.3, presence_penalty=0.3, min_tokens=5, max_tokens=32)
    want = _greedy(stories_base, prompts, **kw)
    for spec in (NGRAM, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2}):
        llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=6, block_size=8, num_gpu_blocks_override=14,
                  max_model_len=96, max_num_batched_tokens=16, speculative_config=spec,
                  async_scheduling=spec["method"] == "draft_model")
        assert _greedy(llm, prompts, **kw) == want, spec["method"]
        sch = llm.engine.scheduler
        assert sch.num_preemptions > 0 and sch.kv.prefix_hits > 0, spec["method"]
        assert sch.kv.num_free_blocks == sch.kv.num_blocks


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tiny_random_models_greedy(checkpoint, arch):
    target = checkpoint(arch)
    draft = checkpoint(arch, num_hidden_layers=1)
    ids = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3] * 12]
    base = LLM(target, max_num_seqs=4, kv_cache_memory_gb=0.05)
    want = _greedy(base, ids, ignore_eos=True, max_tokens=24)
    for spec in (NGRAM, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}):
        llm = LLM(target, max_num_seqs=4, kv_cache_memory_gb=0.05, speculative_config=spec)
        assert _greedy(llm, ids, ignore_eos=True, max_tokens=24) == want, spec["method"]


def test_logprobs_and_structured_requests_beside_drafting_ones(stories_base):
    """A request with logprobs and one with a grammar (both verify drafts too, the grammar's
    with a mask per draft position) beside one that speculates: the same tokens (and logprobs)
    as plain."""
    from rankserve.runtime.sampling_params import StructuredOutputsParams
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=8, kv_cache_memory_gb=0.05, speculative_config=NGRAM)
    free = stories_base.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    regex = StructuredOutputsParams(regex=free.text.replace(".", "[.]") + ".*")
    sp = [SamplingParams(temperature=0, max_tokens=30, logprobs=2),
          SamplingParams(temperature=0, max_tokens=30),
          SamplingParams(temperature=0, max_tokens=20, structured_outputs=regex)]
    prompts = PROMPTS[1:] + PROMPTS[:1]
    outs = llm.generate(prompts, sp)
    base = stories_base.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert_logprobs_close(outs[0].outputs[0].logprobs, base[0].outputs[0].logprobs)
    assert llm.engine.scheduler.stats().spec_num_drafts > 0


def _samples(llm, prompt, sp_kw, n, pos):
    sps = [SamplingParams(seed=1000 + i, max_tokens=max(pos) + 1, ignore_eos=True, **sp_kw)
           for i in range(n)]
    outs = llm.generate([prompt] * n, sps)
    return [[o.outputs[0].token_ids[p] for o in outs] for p in pos]


def test_sampled_token_frequencies_match_plain(stories_base):
    """Small end-to-end check (the exact one is the synthetic test above): 300 seeded samples at
    temperature 1 / top-p 0.95 of output tokens 1 and 2 (the ones n-gram drafts are verified
    for: the prompt repeats), with and without speculation: total variation distance < 0.2.
    Measured on this model: two plain 300-sample runs with other seeds differ by about 0.1 there
    (0.045 / 0.086 at 2000 samples, as do speculative vs plain); a verifier that accepted every
    draft gives about 0.5 (most of the samples would repeat the prompt)."""
    prompt = "Lily and Tom. Lily and Tom. Lily and Tom. Lily and"
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=64, kv_cache_memory_gb=0.05,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    kw = dict(temperature=1.0, top_p=0.95)
    a = _samples(llm, prompt, kw, 300, (1, 2))
    b = _samples(stories_base, prompt, kw, 300, (1, 2))
    s = llm.engine.scheduler.stats()
    assert s.spec_num_draft_tokens > 200 and s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    for pa, pb in zip(a, b):
        tv = 0.5 * np.abs(np.bincount(pa, minlength=512) - np.bincount(pb, minlength=512)).sum() / len(pa)
        assert tv < 0.2, tv


def _count_in_verify(monkeypatch, name: str) -> list[int]:
    """Per verify step (ModelRunner._verify, with the proposer's work inside it): how many times
    the runtime called torch.Tensor.<name>."""
    from rankserve.runtime.model_runner import ModelRunner
    counts, inside = [], []
    real_verify, real = ModelRunner._verify, getattr(torch.Tensor, name)

    def verify(self, *a):
        counts.append(0)
        inside.append(1)
        try:
            return real_verify(self, *a)
        finally:
            inside.pop()

    def method(t, *a, **k):
        # the runtime's own copies (the CPU reference kernels inside a forward make their own)
        if inside and "/runtime/" in sys._getframe(1).f_code.co_filename:
            counts[-1] += 1
        return real(t, *a, **k)
    monkeypatch.setattr(ModelRunner, "_verify", verify)
    monkeypatch.setattr(torch.Tensor, name, method)
    return counts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_verify_step_copies_to_the_host_once(draft_dir, method, monkeypatch):
    """Every device-to-host copy is a sync, and the device idles while the host launches what
    follows it (on the H200 a never-accepted MTP verify left the GPU idle 5.7 ms this way):
    the step's tokens, accepted counts and next drafts come back in one copy. (A request's last
    try before the backoff pauses it needs its count first, to skip proposing if it pauses:
    two copies when it does not; the backoff is off here.)"""
    import rankserve.runtime.scheduler as sched
    monkeypatch.setattr(sched, "SPEC_MISSES", 10 ** 6)
    monkeypatch.setattr(sched, "SPEC_FIRST_REJECTS", 10 ** 6)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=8, kv_cache_memory_gb=0.05, speculative_config=spec)
    want = _greedy(llm, PROMPTS[1:], max_tokens=30)
    counts = _count_in_verify(monkeypatch, "tolist")
    assert _greedy(llm, PROMPTS[1:], max_tokens=30) == want
    assert counts and set(counts) == {1}, counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_verify_step_syncs_once(draft_dir, monkeypatch):
    """On the GPU, with CUDA's sync debug mode: a verify step (sampling, rejection, the draft
    model's passes) makes one synchronizing call, the copy of its results: no pageable upload
    (it would wait for the forward) and no data-dependent shape (repeat_interleave) before it."""
    import warnings
    import rankserve.runtime.scheduler as sched
    from rankserve.runtime.model_runner import ModelRunner
    monkeypatch.setattr(sched, "SPEC_MISSES", 10 ** 6)  # no last tries (see above)
    monkeypatch.setattr(sched, "SPEC_FIRST_REJECTS", 10 ** 6)
    llm = LLM(str(STORIES_EMBEDDED), dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3,
              speculative_config={"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})
    syncs = []
    real = ModelRunner._verify

    def verify(self, *a):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real(self, *a)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.append([f"{x.filename}:{x.lineno}" for x in w
                              if str(x.message).startswith("called a synchronizing")])
    monkeypatch.setattr(ModelRunner, "_verify", verify)
    _greedy(llm, PROMPTS, max_tokens=30)
    # (the first step's may go unreported: the mode is a prototype)
    assert any(syncs) and all(len(s) <= 1 for s in syncs), [s for s in syncs if len(s) > 1][:3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_verify_graphs_give_the_plain_greedy_tokens(draft_dir, level, monkeypatch):
    """On the GPU: uniform verify batches (1 + k tokens a request) replay CUDA graphs (the
    target's and the draft model's), and the tokens are those of plain decoding with graphs.
    A draft model proposes k tokens for every request, so its batches are uniform; n-gram
    proposes only where the context repeats (a batch mixing hits and misses runs without a
    verify graph), so it gets one repeating prompt."""
    from rankserve.runtime.compilation import CompiledModel
    common = dict(dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3, compilation_level=level)
    repeating = ["Sam had a red ball. Sam had a red ball. Sam had a",
                 "Lily and Tom. Lily and Tom. Lily and Tom. Lily and"]
    # n-gram: one request, so every step that drafts is uniform (with two, most verify steps mix
    # a drafting request with one whose lookup found nothing: 11 of 12 on CPU, and on the H200
    # none of them was uniform)
    prompt_sets = {"ngram": repeating[1:], "draft_model": PROMPTS + repeating[:1]}
    base = LLM(str(STORIES_EMBEDDED), **common)
    wants = {m: _greedy(base, p, max_tokens=60) for m, p in prompt_sets.items()}
    del base
    gc.collect()
    torch.cuda.empty_cache()
    replays = []
    real = CompiledModel._run_verify_graph
    monkeypatch.setattr(CompiledModel, "_run_verify_graph",
                        lambda self, T, attn, hidden_in: replays.append(T) or real(self, T, attn, hidden_in))
    for spec in (NGRAM, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}):
        llm = LLM(str(STORIES_EMBEDDED), speculative_config=spec, **common)
        runner = llm.engine.executor.runner
        assert runner.compiled_model.verify_graphs, "no verify graph was captured"
        replays.clear()
        m = spec["method"]
        assert _greedy(llm, prompt_sets[m], max_tokens=60) == wants[m], m
        assert replays, m
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()


def test_echo_bench_configs_accept_every_draft(tmp_path):
    """The shipped `llama-3.1-8b-echo` bench configs (dummy weights, `dummy_residual_scale` 0,
    tied embeddings) make a target that repeats its last token and a draft that agrees with it:
    what `w2echo` measures speculative decoding's ceiling with at the 8B shape. Here the same
    two configs, narrowed, on CPU: every draft is accepted, with n-gram and the draft model."""
    import json
    from rankserve.runtime.bench.common import CONFIGS_DIR
    dirs = {}
    for name, shape in (("llama-3.1-8b-echo", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
                        ("llama-3.1-8b-echo-draft", dict(hidden_size=64, intermediate_size=128))):
        cfg = {**json.loads((CONFIGS_DIR / f"{name}.json").read_text()), **shape, "vocab_size": 4096}
        assert cfg["dummy_residual_scale"] == 0.0 and cfg["tie_word_embeddings"]
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(tmp_path / name)
    common = dict(load_format="dummy", dtype="float32", max_num_seqs=4, kv_cache_memory_gb=0.05, max_model_len=128)
    prompts = [[7, 8, 9, 10] * 4, [100, 200, 300]]
    want = _greedy(LLM(dirs["llama-3.1-8b-echo"], **common), prompts, max_tokens=40, ignore_eos=True)
    assert want == [[10] * 40, [300] * 40]  # it repeats the last token
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": dirs["llama-3.1-8b-echo-draft"], "num_speculative_tokens": 4}):
        llm = LLM(dirs["llama-3.1-8b-echo"], **common, speculative_config=spec)
        assert _greedy(llm, prompts, max_tokens=40, ignore_eos=True) == want
        s = llm.engine.scheduler.stats()
        assert s.spec_num_accepted_tokens >= 0.9 * s.spec_num_draft_tokens > 0, spec["method"]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_prompt_aborted_mid_prefill_leaves_no_uncomputed_block_cached(stories_base, draft_dir, use_async):
    """A draft model reserves its lookahead slots past each step's tokens; a prefill chunk cut by
    the budget (21 of 40 prompt tokens, + 3 slots) registered in the prefix cache the block
    that the slots filled, though its last 3 prompt tokens were not computed. A client that
    disconnects then (the request aborted) left it there: the same prompt sent again read
    never-written KV (other greedy tokens than without speculative decoding)."""
    from rankserve.runtime.messages import EngineCoreRequest
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 500, 40)]
    want = _greedy(stories_base, [{"prompt_token_ids": prompt}], max_tokens=8)[0]
    llm = LLM(str(STORIES_EMBEDDED), block_size=8, max_model_len=96, max_num_batched_tokens=21,
              async_scheduling=use_async,
              speculative_config={"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})
    eng = llm.engine
    eng.add_request(EngineCoreRequest("gone", prompt, SamplingParams(temperature=0, max_tokens=8), 0.0))
    eng.step()  # the first chunk
    eng.abort_requests(["gone"])
    while eng.has_work:
        eng.step()
    assert _greedy(llm, [{"prompt_token_ids": prompt}], max_tokens=8)[0] == want
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.num_blocks
