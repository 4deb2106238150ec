"""Structured outputs under speculative decoding: a constrained request's drafts are verified
with a grammar mask per draft position, so its greedy output is token for token the one without
speculation, always valid, and its drafts are accepted where the model agrees (stories260K,
n-gram and a draft model)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.sampling_params import StructuredOutputsParams as SO

from conftest import STORIES_EMBEDDED
from test_spec_decode import stories_draft

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
STORY = "Lily and Tom went to the park. Lily and Tom went to the"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40},
                                           "b": {"enum": ["cat", "dog"]}},
          "required": ["a", "b"], "additionalProperties": False}
JSON_PROMPT = ('{"a": "Lily and Tom went to the park", "b": "cat"} '
               '{"a": "Lily and Tom went to the park", "b": "cat"} {"a": "Lily')
CHOICES = ["park. Lily and Tom went", "park", "tree"]
REGEX = r" park\. [A-Za-z]+( [a-z]+){0,6}\."


def _cases():
    """(prompt, params, check of the text) for each kind of constraint."""
    json_so = SO(json=SCHEMA, disable_any_whitespace=True)
    return [
        (JSON_PROMPT, json_so, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (STORY, SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (STORY, SO(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
        (STORY, SO(grammar='root ::= " park." [a-z ]+ "."'),
         lambda t: re.fullmatch(r" park\.[a-z ]+\.", t) or pytest.fail(t)),
    ]


def _sps(cases, **kw):
    return [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so, **kw)
            for _, so, _ in cases]


# fp32 on CUDA too (tokens of plain and speculative runs compared exactly: bf16 flips near ties
# between a verify step and a decode step), and a fixed cache there (other engines of the
# process hold the device's memory)
KW = dict(dtype="float32", **({"num_gpu_blocks_override": 512} if torch.cuda.is_available()
                              else {"kv_cache_memory_gb": 0.05}))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base():
    return LLM(str(STORIES_EMBEDDED), max_num_seqs=8, **KW)


@pytest.fixture(scope="module")
def ngram():
    return LLM(str(STORIES_EMBEDDED), max_num_seqs=8, speculative_config=NGRAM, **KW)


def test_constrained_greedy_speculates_and_equals_plain(base, ngram):
    cases = _cases()
    prompts, sps = [c[0] for c in cases], _sps(cases)
    want = base.generate(prompts, sps)
    before = ngram.engine.scheduler.stats()
    got = ngram.generate(prompts, sps)
    assert _ids(got) == _ids(want)
    for (_, _, check), o in zip(cases, got):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        check(o.outputs[0].text)
    s = ngram.engine.scheduler.stats()  # only constrained requests ran: their drafts
    assert s.spec_num_accepted_tokens - getattr(before, "spec_num_accepted_tokens", 0) > 0
    assert ngram.engine.scheduler.kv.num_free_blocks == ngram.engine.scheduler.kv.num_blocks


def test_each_constraint_speculates_alone(base, ngram):
    """The JSON and regex requests each get drafts accepted (their prompts repeat what the
    constraint lets the model write)."""
    for prompt, so, check in _cases()[:2]:
        sp = _sps([(prompt, so, check)])
        before = ngram.engine.scheduler.spec.num_accepted_tokens
        got = ngram.generate(prompt, sp)[0].outputs[0]
        assert got.token_ids == base.generate(prompt, sp)[0].outputs[0].token_ids
        check(got.text)
        assert ngram.engine.scheduler.spec.num_accepted_tokens > before, so.kind


def test_a_stop_token_inside_the_drafts(base, ngram):
    """The prompt repeats 'p ar k .' then EOS, and ends with 'p ar'; the constraint makes the
    first token 'k', so the n-gram drafts are '.', EOS, 'p'. Where the grammar may end after
    '.', EOS is accepted inside the draft run and the output stops there (the rows after it are
    free; with ignore_eos the grammar's end still ends it); where it may not, the mask rejects
    the EOS draft: the same tokens as without drafts either way."""
    tok = base.get_tokenizer()
    park, eos = tok.encode(" park.")[1:], tok.eos_token_id
    prompt = [1] + (park + [eos] + park + [eos]) * 2 + park[:2]
    for regex, kw in [(r"k\.", {}), (r"k\.", {"ignore_eos": True}), (r"k\.[a-z]+\.", {})]:
        sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex=regex), **kw)
        before = ngram.engine.scheduler.spec.num_accepted_tokens
        got = ngram.generate([prompt], sp)[0].outputs[0]
        want = base.generate([prompt], sp)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, regex
        assert re.fullmatch(regex, got.text), got.text
        assert ngram.engine.scheduler.spec.num_accepted_tokens > before, (regex, kw)
    assert got.finish_reason == "stop" and eos not in got.token_ids[:-1]


def test_drafts_across_the_start_of_the_constraint(base, ngram):
    """A constraint that starts after a token (a reasoning's end; here the first '.'): the
    drafts ' ar', 'k', '.' are free, and the token after them is held to the grammar (' Tom',
    where the model would write ' Lily')."""
    prompt = "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom went to the"
    so = SO(regex=r" Tom( [a-z]+){0,6}\.", start_after_token_id=base.get_tokenizer().encode(".")[-1])
    sp = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)
    before = ngram.engine.scheduler.spec.num_accepted_tokens
    got = ngram.generate(prompt, sp)[0].outputs[0]
    assert got.token_ids == base.generate(prompt, sp)[0].outputs[0].token_ids
    head, _, answer = got.text.partition(".")
    assert head == " park" and re.fullmatch(r" Tom( [a-z]+){0,6}\.", answer), got.text
    assert got.finish_reason == "stop" and ngram.engine.scheduler.spec.num_accepted_tokens > before


def test_sampled_constrained_outputs_are_valid(ngram):
    """Temperature 1: drafts are accepted with the probability the masked target gives them,
    so an accepted one is always allowed; every output is valid and drafts are accepted."""
    json_so, regex_so = SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=so)
           for so in (json_so, regex_so) for s in range(6)]
    before = ngram.engine.scheduler.spec.num_accepted_tokens
    outs = [o.outputs[0] for o in ngram.generate([JSON_PROMPT] * 6 + [STORY] * 6, sps)]
    assert all(o.finish_reason == "stop" for o in outs), outs
    for o in outs[:6]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert all(re.fullmatch(REGEX, o.text) for o in outs[6:]), [o.text for o in outs[6:]]
    assert len({o.text for o in outs}) > 2 and ngram.engine.scheduler.spec.num_accepted_tokens > before


def test_mixed_batch_with_logprobs_under_pressure(base, tmp_path_factory):
    """Constrained, plain and logprobs requests together, with chunked prefill and preemption
    (a small KV cache), with n-gram and with a draft model under async scheduling: the same
    tokens as plain, every constrained output valid."""
    cases = _cases()
    prompts = [c[0] for c in cases] + [STORY, JSON_PROMPT]
    sps = _sps(cases) + [SamplingParams(temperature=0, max_tokens=30, logprobs=2),
                         SamplingParams(temperature=0, max_tokens=30)]
    sps[1] = SamplingParams(temperature=0, max_tokens=40, logprobs=1, structured_outputs=cases[1][1])
    want = base.generate(prompts, sps)
    draft = stories_draft(tmp_path_factory.mktemp("draft"), 2)
    for spec in (NGRAM, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}):
        llm = LLM(str(STORIES_EMBEDDED), max_num_seqs=6, block_size=8, num_gpu_blocks_override=18,
                  dtype="float32",
                  max_model_len=128, max_num_batched_tokens=24, speculative_config=spec,
                  async_scheduling=spec["method"] == "draft_model")
        got = llm.generate(prompts, sps)
        assert _ids(got) == _ids(want), spec["method"]
        for (_, _, check), o in zip(cases, got):
            check(o.outputs[0].text)
        lp_got, lp_want = got[1].outputs[0].logprobs, want[1].outputs[0].logprobs
        assert [list(e) for e in lp_got] == [list(e) for e in lp_want]
        sch = llm.engine.scheduler
        assert sch.num_preemptions > 0 and sch.spec.num_accepted_tokens > 0, spec["method"]
        assert sch.kv.num_free_blocks == sch.kv.num_blocks



def test_draft_rows_equal_fresh_fills():
    """Random walks of JSON matchers (stories' vocabulary) with random drafts, mostly ones the
    grammar allows, some not: every draft row equals a fresh fill after the drafts before it
    (reused string rows included), rows past a rejected draft or the grammar's end are full,
    the matchers are back where they were, and the accepted tokens then advance them once."""
    import numpy as np
    import torch

    from rankserve.runtime.bench.throughput import SCHEMAS
    from rankserve.runtime.structured_output import StructuredOutputManager
    from test_structured_output_reuse import HARD, allowed, new_grammar

    size, eos = 512, 2
    m = StructuredOutputManager(str(STORIES_EMBEDDED), str(STORIES_EMBEDDED), size)
    sos = [SO(json=s) for s in SCHEMAS + HARD] + [SO(json_object=True)]
    rng = np.random.default_rng(0)
    fresh = torch.zeros((1, (size + 31) // 32), dtype=torch.int32)

    def fill(g):
        g.matcher.fill_next_token_bitmask(fresh, 0)
        return fresh[0].numpy().copy()

    def walk(g, d):
        """The fresh rows after each prefix of d (None past a rejection or the end)."""
        want, n = [fill(g)], 0
        for t in d:
            if want[-1] is None or not g.matcher.accept_token(t):
                want.append(None)
                continue
            n += 1
            want.append(None if g.matcher.is_terminated() else fill(g))
        g.matcher.rollback(n)
        return want

    try:
        gs = [new_grammar(m, sos[i % len(sos)], eos) for i in range(8)]
        checked = 0
        for step in range(40):
            drafts = []
            for g in gs:  # a walk the grammar allows, sometimes a random token, then rolled back
                d, n = [], 0
                for _ in range(int(rng.integers(0, 5))):
                    ok = allowed(fill(g), size) if not g.matcher.is_terminated() else [eos]
                    d.append(int(rng.choice(ok)) if rng.random() > 0.1 else int(rng.integers(size)))
                    if not g.matcher.accept_token(d[-1]):
                        break
                    n += 1
                g.matcher.rollback(n)
                drafts.append(d)
            wants = [walk(g, d) for g, d in zip(gs, drafts)]
            seen = [g.num_seen for g in gs]
            rows = m.fill_bitmask(gs, drafts=drafts)
            at = 0
            for d, want in zip(drafts, wants):
                for j, w in enumerate(want):
                    if w is None:
                        assert (rows[at + j] == -1).all(), (step, j)
                    else:
                        assert np.array_equal(rows[at + j], w), (step, j)
                        checked += 1
                at += len(d) + 1
            assert [g.num_seen for g in gs] == seen
            assert all(np.array_equal(fill(g), w[0]) for g, w in zip(gs, wants))  # rolled back
            runs = []
            for g, d, want in zip(gs, drafts, wants):  # accept a valid prefix, then a bonus token
                a = int(rng.integers(0, next((j for j, w in enumerate(want) if w is None), len(want))))
                runs.append((g, d[:a] + [int(rng.choice(allowed(want[a], size)))]))
            used = m.accept_runs(runs)
            for i, ((g, toks), n) in enumerate(zip(runs, used)):
                assert not g.failed and g.num_seen == seen[i] + n
                assert n == len(toks) or g.terminated
                if g.terminated:
                    gs[i] = new_grammar(m, sos[int(rng.integers(len(sos)))], eos)
        assert checked > 300 and m.rows_reused > 0
    finally:
        m.shutdown()
