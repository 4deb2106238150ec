"""Speculative decoding edge cases (issue 16 review): what a user hits when several tokens of a
request arrive in one step (an accepted draft run), compared with the same request without
speculation at temperature 0: stops inside the run, the KV blocks given back, and the rest."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.detokenize import IncrementalDetokenizer

from conftest import STORIES_EMBEDDED, assert_logprobs_close

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
REPEAT = "Lily and Tom went to the park. Lily and Tom went to the"
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def plain():
    return LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05)


@pytest.fixture(scope="module")
def spec():
    return LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05, speculative_config=NGRAM)


def _same(plain, spec, prompts, params):
    """Every choice of every prompt: same tokens, text and finish as without speculation; and
    every KV block back once the requests are done."""
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        for a, b in zip(w.outputs, g.outputs):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    kv = spec.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    return got


# ---- stops inside an accepted draft run ---------------------------------------------------------
def test_detokenizer_reports_the_token_that_completes_a_stop_string():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(STORIES_EMBEDDED))
    ids = tok(" park. They saw a big box", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, [1], stop=["park"])
    _, stop, used = d.push(ids)  # all at once, as an accepted draft run arrives
    assert stop == "park" and not d.text.strip() and used == 1 + next(
        i for i in range(len(ids)) if "park" in tok.decode(ids[:i + 1]))


def test_stop_string_then_eos_in_one_output():
    """A run that completes a stop string and then ends with EOS (the engine's stop): the output
    ends at the stop string's token, as in plain decoding (where the EOS never comes), and the
    finished request is not aborted again."""
    from transformers import AutoTokenizer

    from rankserve.runtime.messages import EngineCoreOutput, FinishReason
    from rankserve.runtime.outputs import OutputProcessor
    tok = AutoTokenizer.from_pretrained(str(STORIES_EMBEDDED))
    ids = tok(" the big park", add_special_tokens=False).input_ids
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1], SamplingParams(stop=["park"]))
    ro, abort = proc.process(EngineCoreOutput("r", ids + [tok.eos_token_id], finish_reason=FinishReason.STOP))
    out = ro.outputs[0]
    assert (out.token_ids, out.delta_token_ids, out.text.strip(), out.finish_reason, out.stop_reason, abort) \
        == (ids, ids, "the big", "stop", "park", False)


def test_stop_string_inside_a_draft_run_ends_the_tokens_there(plain, spec):
    got = _same(plain, spec, [REPEAT], SamplingParams(max_tokens=40, stop=["park"], **GREEDY))
    assert got[0].outputs[0].stop_reason == "park"
    # the streamed deltas add up to the output: nothing past the stop
    p = SamplingParams(max_tokens=40, stop=["saw a"], **GREEDY)
    want = plain.generate([REPEAT], p)[0].outputs[0]
    assert want.stop_reason == "saw a"
    _same(plain, spec, [REPEAT], p)


# ---- cases that already held (pinned): same tokens as plain decoding, every block back -----------
PLAIN_CASES = {
    # stop token / EOS-like stop inside an accepted run, and masked by min_tokens inside one
    "stop_token": dict(max_tokens=40, stop_token_ids=[414]),
    "stop_token_min_tokens": dict(max_tokens=40, stop_token_ids=[414], min_tokens=12),
    "max_tokens_1": dict(max_tokens=1),
    "max_tokens_2": dict(max_tokens=2),
    "ignore_eos": dict(max_tokens=80, ignore_eos=True),
    "penalties": dict(max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    "n3_include_stop": dict(max_tokens=30, n=3, stop=["box"], include_stop_str_in_output=True),
}


@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_same_as_plain(plain, spec, case):
    _same(plain, spec, [REPEAT, "Once upon a time"], SamplingParams(**PLAIN_CASES[case], **GREEDY))


def test_logprobs_grammar_and_max_model_len_beside_drafting_requests(plain, spec):
    from rankserve.runtime.sampling_params import StructuredOutputsParams
    _same(plain, spec, [REPEAT] * 3, [
        SamplingParams(max_tokens=20, logprobs=1, prompt_logprobs=1, **GREEDY),
        SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex="( the park\\.)+"),
                       **GREEDY),
        SamplingParams(max_tokens=30, **GREEDY)])
    ids = plain.tokenizer(REPEAT).input_ids * 40  # a repetitive prompt: drafts run past the end
    _same(plain, spec, [{"prompt_token_ids": ids[:511]}, {"prompt_token_ids": ids[:505]}, REPEAT],
          [SamplingParams(max_tokens=None, ignore_eos=True, **GREEDY)] * 2 + [SamplingParams(max_tokens=30, **GREEDY)])


# ---- logprobs: a request asking for them verifies drafts too -----------------------------------
def test_logprobs_of_accepted_tokens_equal_plain(plain, spec):
    """Such a request decoded one token a step (no drafts): now every token of an accepted run
    has the logprob, rank and top alternatives of plain decoding, and a stop inside the run
    (token, string, max_tokens) cuts the logprobs with the tokens."""
    before = spec.engine.scheduler.spec.num_accepted_tokens
    for kw in (dict(logprobs=3), dict(logprobs=0, stop=["saw a"]), dict(logprobs=2, stop_token_ids=[414]),
               dict(logprobs=1, max_tokens=7)):
        p = SamplingParams(**{"max_tokens": 40, **kw}, **GREEDY)
        want = plain.generate([REPEAT], p)[0].outputs[0]
        got = _same(plain, spec, [REPEAT], p)[0].outputs[0]
        assert_logprobs_close(got.logprobs, want.logprobs)
    assert spec.engine.scheduler.spec.num_accepted_tokens > before


# ---- --speculative-config: a key the method does not use is refused, not ignored ---------------
def test_model_key_with_ngram_is_refused():
    from rankserve.runtime.config import ConfigError, parse_speculative_config
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).model is None
    with pytest.raises(ConfigError, match=r'--speculative-config: "model" is for methods .* not ngram'):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "model": str(STORIES_EMBEDDED)})


def test_method_of_another_type_or_clashing_with_model_is_refused():
    """A method that is not a string was a TypeError traceback; vLLM's "[ngram]" model spelling
    silently overrode an explicit other method (it only names the method when none is given)."""
    from rankserve.runtime.config import ConfigError, parse_speculative_config
    assert parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    for bad in ({"method": ["ngram"], "num_speculative_tokens": 2}, {"method": {"a": 1}, "num_speculative_tokens": 2},
                {"method": "mtp", "model": "[ngram]", "num_speculative_tokens": 2},
                {"method": "draft_model", "model": "ngram", "num_speculative_tokens": 2}):
        with pytest.raises(ConfigError, match="--speculative-config: .*method"):
            parse_speculative_config(bad)


def test_draft_with_another_vocabulary_is_refused(checkpoint):
    from rankserve.runtime.config import ConfigError
    other = checkpoint("LlamaForCausalLM", vocab_size=600)
    with pytest.raises((ConfigError, ValueError), match="--speculative-config.*vocab"):
        LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05, speculative_config={
            "method": "draft_model", "model": other, "num_speculative_tokens": 2})


def test_draft_checkpoint_that_does_not_load_names_the_flag(tmp_path):
    """A draft (or EAGLE head) directory without weights, or of an unknown architecture: the
    error says it is the --speculative-config model's (it read as the target's load failing)."""
    import json
    import shutil
    (tmp_path / "noweights").mkdir()
    shutil.copy(STORIES_EMBEDDED / "config.json", tmp_path / "noweights")
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    for method, d in (("draft_model", "noweights"), ("draft_model", "unknown"), ("eagle", "noweights")):
        what = "draft model" if method == "draft_model" else "head"
        with pytest.raises(ValueError, match=f"--speculative-config: the {what} {tmp_path / d}: "):
            LLM(str(STORIES_EMBEDDED), kv_cache_memory_gb=0.05, speculative_config={
                "method": method, "model": str(tmp_path / d), "num_speculative_tokens": 2})


# ---- seeds: a seeded request's draws do not depend on what else is in the batch -----------------
def test_seeded_sample_does_not_depend_on_a_drafting_neighbour(plain, spec):
    """Without speculation a seeded request gives the same tokens whatever it is batched with;
    beside a request that verifies drafts it must too (its generator must not be drawn for a
    verify step's rows it does not have)."""
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    greedy = SamplingParams(max_tokens=40, **GREEDY)
    want = plain.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    before = spec.engine.scheduler.spec.num_drafts
    got = spec.generate(["Once upon a time", REPEAT], [p, greedy])[0].outputs[0].token_ids
    assert spec.engine.scheduler.spec.num_drafts > before  # the neighbour did verify drafts
    alone = spec.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    assert got == alone
    assert plain.generate(["Once upon a time", REPEAT], [p, greedy])[0].outputs[0].token_ids == want


# ---- through the server (the openai client) -----------------------------------------------------
def test_server_stops_usage_abort_and_metrics(plain):
    """Stops inside a draft run (streamed and not: same text and usage as plain decoding), a
    client that disconnects mid-stream (its blocks come back), and the spec_decode counters."""
    import json
    import re
    import time

    import httpx
    import openai

    from test_server import Server, metric
    s = Server("--speculative-config", json.dumps(NGRAM), "--kv-cache-memory-gb", "0.05")
    try:
        # as vLLM: every counter, and one per-position series per draft position, from the start
        # (dashboards dividing by them read 0, not "no data")
        for _ in range(50):
            m = httpx.get(s.url + "/metrics").text
            if "spec_decode_num_accepted_tokens_per_pos_total" in m:
                break
            time.sleep(0.1)
        assert {metric(m, f"rankserve:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens",
                                                                             "accepted_tokens")} == {0}
        assert sorted(re.findall(r'^rankserve:spec_decode_num_accepted_tokens_per_pos_total{.*position="(\d+)"} 0.0$',
                                 m, re.M)) == ["0", "1", "2", "3"]
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        model = c.models.list().data[0].id
        for stop in (["park"], ["saw a"]):
            w = plain.generate([REPEAT], SamplingParams(max_tokens=40, stop=stop, **GREEDY))[0].outputs[0]
            kw = dict(model=model, prompt=REPEAT, max_tokens=40, temperature=0, stop=stop)
            r = c.completions.create(**kw)
            assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == \
                (w.text, len(w.token_ids), "stop")
            chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == w.text
            assert chunks[-1].usage.completion_tokens == len(w.token_ids)
        # logprobs of accepted runs, streamed (several tokens a chunk) and not: those of plain decoding
        w = plain.generate([REPEAT], SamplingParams(max_tokens=30, logprobs=1, **GREEDY))[0].outputs[0]
        kw = dict(model=model, prompt=REPEAT, max_tokens=30, temperature=0, logprobs=1)
        r = c.completions.create(**kw).choices[0].logprobs
        chunks = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True) if ch.choices]
        assert sum((lp.token_logprobs for lp in chunks if lp), []) == r.token_logprobs
        assert np.allclose(r.token_logprobs, [d[t].logprob for t, d in zip(w.token_ids, w.logprobs)], atol=1e-4)
        assert max(len(lp.tokens) for lp in chunks if lp) > 1  # (drafts were accepted)
        with httpx.Client(base_url=s.url, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json={
                    "prompt": REPEAT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 3:
                        break  # disconnect while drafts are being verified
            for _ in range(100):
                m = h.get("/metrics").text
                if metric(m, "rankserve:num_requests_running") == 0:
                    break
                time.sleep(0.1)
        assert metric(m, "rankserve:kv_cache_usage_perc") == 0
        assert 0 < metric(m, "rankserve:spec_decode_num_accepted_tokens_total") \
            <= metric(m, "rankserve:spec_decode_num_draft_tokens_total")
    finally:
        assert s.stop() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stop_in_draft_run_and_seed_beside_drafts():
    """The two sampling-side fixes on the device path (CUDA graphs, the device sampler)."""
    kw = dict(dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    plain, spec = LLM(str(STORIES_EMBEDDED), **kw), LLM(str(STORIES_EMBEDDED), speculative_config=NGRAM, **kw)
    _same(plain, spec, [REPEAT], SamplingParams(max_tokens=40, stop=["park"], **GREEDY))
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    got = spec.generate(["Once upon a time", REPEAT], [p, SamplingParams(max_tokens=40, **GREEDY)])
    assert got[0].outputs[0].token_ids == spec.generate(["Once upon a time"], p)[0].outputs[0].token_ids
    p = SamplingParams(max_tokens=40, logprobs=2, **GREEDY)
    want, got = (e.generate([REPEAT], p)[0].outputs[0] for e in (plain, spec))
    assert got.token_ids == want.token_ids and spec.engine.scheduler.spec.num_accepted_tokens > 0
    assert_logprobs_close(got.logprobs, want.logprobs)
