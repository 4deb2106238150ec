"""Structured outputs (xgrammar) and token masks (logit_bias, allowed_token_ids, bad_words) through
`LLM`: a random-weight tiny Qwen3 with the real tokenizer at temperature 1 must still give valid
outputs, since only the masks make them so."""
import functools
import json
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest
import torch

import rankserve
from rankserve import SamplingParams
from rankserve.runtime.sampling_params import ParamError, StructuredOutputsParams as SO

from conftest import STORIES_EMBEDDED, STORIES_TEXT

# several engines live in this process at once: on CUDA each takes a fixed KV cache instead of
# profiling for 90% of the memory (the second would find none left)
LLM = functools.partial(rankserve.LLM, **({"num_gpu_blocks_override": 512}
                                          if torch.cuda.is_available() else {}))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "age", "pet"], "additionalProperties": False}
N = 10


@pytest.fixture(scope="module")
def qwen(qwen3_chat_dir):
    return LLM(str(qwen3_chat_dir), max_num_seqs=N)


def run(llm, so=None, n=N, max_tokens=200, prompt="Give me a record:", **kw):
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so, **kw)
           for s in range(n)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * n, sps)]
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
    return [o.text for o in outs]


def test_json_schema(qwen):
    texts = run(qwen, SO(json=SCHEMA))
    assert len(set(texts)) > 1  # the seeds differ: the schema, not the model, makes them valid
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_choice_regex_grammar_json_object(qwen):
    choices = ["yes", "no", "maybe so"]
    assert set(run(qwen, SO(choice=choices))) <= set(choices)
    pattern = r"[A-Z][a-z]{2,6}-\d{2,3}"
    for t in run(qwen, SO(regex=pattern)):
        assert re.fullmatch(pattern, t), t
    ebnf = 'root ::= "(" num (" + " num)? (" + " num)? ")"\nnum ::= [1-9] [0-9]?'
    for t in run(qwen, SO(grammar=ebnf), n=6):
        assert re.fullmatch(r"\(\d{1,2}( \+ \d{1,2}){0,2}\)", t), t
    # any JSON object (random weights would write strings forever: a few tokens only, which
    # also tests a grammar together with allowed_token_ids)
    few = qwen.tokenizer.convert_tokens_to_ids(["{", "}", '"', "a", ":", "1", ",", "Ġ"])
    few.append(qwen.tokenizer.eos_token_id)  # else a finished object has no way to end
    for t in run(qwen, SO(json_object=True), n=6, allowed_token_ids=few):
        assert isinstance(json.loads(t), dict), t


def test_structural_tag(qwen):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "end": "</r>", "content": {
        "type": "regex", "pattern": "[a-z]{1,5}"}}}
    for t in run(qwen, SO(structural_tag=json.dumps(tag)), n=4):
        assert re.fullmatch("<r>[a-z]{1,5}</r>", t), t
    legacy = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
    qwen.engine.structured.validate(SO(structural_tag=json.dumps(legacy)))  # vLLM's older form


@pytest.mark.parametrize("so, words", [
    (SO(structural_tag='{"structures": [{}], "triggers": []}'), "missing field 'begin'"),
    (SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
    (SO(json="{not json"), "json"),
    (SO(regex="a(b"), "parenthesis"),
    (SO(grammar="root ::= undefined_rule"), "undefined_rule"),
    (SO(grammar='start: "yes" | "no"'), "Lark"),  # (vLLM converts simple Lark grammars)
    (SO(json={"type": "string", "minLength": -1}), "minLength"),  # (was xgrammar's RuntimeError)
    (SO(choice=[]), "exactly one|empty"),
    (SO(regex="a", json_object=True), "exactly one"),
])
def test_invalid_constraints_are_clear_errors(qwen, so, words):
    with pytest.raises(ValueError, match=words):
        qwen.generate("x", SamplingParams(structured_outputs=so))


def test_greedy_unchanged_when_already_satisfied(stories_llm):
    sp = SamplingParams(temperature=0, max_tokens=20)
    free = stories_llm.generate("Once upon a time", sp)[0].outputs[0]
    assert STORIES_TEXT.startswith(free.text)
    # a regex the free output satisfies (as a prefix: then EOS is the only way out)
    so = SO(regex=re.escape(free.text) + ".*")
    con = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                                                                  structured_outputs=so))[0].outputs[0]
    assert con.token_ids == free.token_ids


@pytest.mark.parametrize("kw", [
    dict(async_scheduling=True),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=64),
    dict(num_gpu_blocks_override=12, block_size=16, max_model_len=192),
], ids=["async", "chunked", "preempt"])
def test_valid_under_async_chunked_preemption(qwen3_chat_dir, kw):
    llm = LLM(str(qwen3_chat_dir), max_num_seqs=6, **kw)
    prompt = "Give me a record: " + "the quick brown fox " * 40  # > 64 tokens: several chunks
    texts = run(llm, SO(json=SCHEMA), n=6, max_tokens=150,
                prompt=prompt if "enable_chunked_prefill" in kw else "Give me:")
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    if "num_gpu_blocks_override" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.scheduler.stats()
    assert stats.grammar_compile_seconds > 0 and stats.grammar_mask_seconds > 0


def test_constrained_requests_advance_every_step_under_async(qwen3_chat_dir):
    """Async scheduling keeps two steps in flight with constrained requests too: a request's
    next mask is filled after the forward is launched, on the grammar thread, once the previous
    step's token is taken from its result and accepted (Scheduler._fill_bitmask); sampling waits
    for it at the next step's start, so every request advances every step, the fill overlaps the
    device and the engine's own host work, and the outputs stay valid."""
    import threading
    llm = LLM(str(qwen3_chat_dir), max_num_seqs=4, async_scheduling=True)
    steps, filled_late, overlapped, threads = [], [], [], []
    eng = llm.engine
    fill = eng.structured.fill_bitmask
    eng.structured.fill_bitmask = lambda *a: (threads.append(threading.current_thread().name), fill(*a))[1]
    eng.step_hooks.append(lambda plan: (steps.append(plan), filled_late.append(
        plan.grammar_req_ids == [] or plan.grammar_bitmask is None),
        overlapped.append(bool(plan.grammar_req_ids) and len(eng.in_flight) > 0)))
    outs = llm.generate(["Give me:"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=150,
                                                          structured_outputs=SO(json=SCHEMA))
                                           for s in range(4)])
    longest = max(len(o.outputs[0].token_ids) for o in outs)
    assert len(steps) <= longest + 2  # one prefill step, then one step per token
    assert all(filled_late)  # not filled when scheduled
    # but used: every plan's rows, except a last step run ahead for requests that have finished
    # (generate() returns without waiting for it; its sampling runs when the engine next steps)
    assert all(p.grammar_bitmask is not None for p in steps[:-1] if p.grammar_req_ids)
    assert sum(overlapped) >= longest - 2  # scheduled while the previous step was in flight
    # filled on the grammar thread while the engine handled the previous step's outputs
    assert len(threads) >= longest and all(t.startswith("grammar-fill") for t in threads), threads[:3]
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.fixture(scope="module")
def qwen_async(qwen3_chat_dir):
    return LLM(str(qwen3_chat_dir), max_num_seqs=N, async_scheduling=True)


@pytest.mark.parametrize("llm", ["qwen", "qwen_async"])
def test_start_after_token(llm, request):
    """The constraint starts once a given token is generated (a reasoning model's </think>).
    Under async scheduling the next step is planned before that token is seen: the plan must
    still get its mask (it was sampled free, then rejected: the request ended in an error)."""
    qwen = request.getfixturevalue(llm)
    so = SO(regex="[0-9]{3}", start_after_token_id=151668)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=so,
                          logit_bias={151668: 100.0}) for s in range(3)]  # </think> at once
    for o in qwen.generate(["Think:"] * 3, sps):
        c = o.outputs[0]
        assert c.token_ids[0] == 151668 and re.fullmatch(r"[0-9]{3}", qwen.tokenizer.decode(c.token_ids[1:-1]))
    # with the opener (<think>): a first token that opens the reasoning leaves it free until
    # </think>; any other first token begins the answer, constrained from there
    so = SO(regex="[0-9]{3}", start_after_token_id=151668, reasoning_start_token_id=151667)
    thinks, answers = qwen.generate(["Think:"] * 2, [SamplingParams(
        temperature=1.0, seed=0, max_tokens=8, structured_outputs=so, logit_bias={151667: b})
        for b in (100.0, -100.0)])
    assert thinks.outputs[0].token_ids == [151667] * 8
    assert re.fullmatch(r"[0-9]{3}", answers.outputs[0].text), answers.outputs[0].text


def test_logit_bias_and_allowed_token_ids(qwen):
    tok = 1234
    outs = qwen.generate(["a"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=5, ignore_eos=True,
                                                    logit_bias={tok: 100.0}) for s in range(4)])
    assert all(o.outputs[0].token_ids == [tok] * 5 for o in outs)
    allowed = [11, 22, 33]
    outs = qwen.generate(["a"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True,
                                                    allowed_token_ids=allowed) for s in range(4)])
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 1
    # -100 removes the greedy choice
    free = qwen.generate("a", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0].outputs[0].token_ids[0]
    biased = qwen.generate("a", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                               logit_bias={free: -100.0}))[0].outputs[0].token_ids[0]
    assert biased != free


def test_bad_words(stories_llm):
    sp = SamplingParams(temperature=0, max_tokens=30)
    free = stories_llm.generate("Once upon a time", sp)[0].outputs[0].text
    assert " Lily" in free and " park" in free
    sp = SamplingParams(temperature=0, max_tokens=30, bad_words=["Lily", "the park"])
    out = stories_llm.generate("Once upon a time", sp)[0].outputs[0].text
    assert "Lily" not in out and "the park" not in out and out != free


def test_bad_words_multi_token_semantics(stories_llm):
    """A multi-token bad word bans only its last token, and only after the rest of it."""
    tok = stories_llm.tokenizer
    free = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    a, b = free.token_ids[3], free.token_ids[4]
    out = stories_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=12, bad_words_token_ids=[[a, b]]))[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4] and out.token_ids[4] != b, tok.decode(out.token_ids)
    # a prefix that does not match bans nothing
    out = stories_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=12, bad_words_token_ids=[[b, b]] if a != b else [[a + 1, b]]))[0].outputs[0]
    assert out.token_ids == free.token_ids


@pytest.mark.parametrize("field, kw", [
    ("logit_bias", dict(logit_bias={10**7: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[-1])),
    ("bad_words", dict(bad_words_token_ids=[[]])),
    ("structured_outputs", dict(structured_outputs=SO())),
])
def test_param_validation(field, kw):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw).validate(512)
    assert e.value.param == field


def test_stories_default_model_regex():
    """The stories tokenizer (SentencePiece, 512 tokens): a regex at temperature 1."""
    llm = LLM(str(STORIES_EMBEDDED))
    for t in run(llm, SO(regex=r"[a-z ]{3,20}\."), n=8, max_tokens=60, prompt="Once upon a time"):
        assert re.fullmatch(r"[a-z ]{3,20}\.", t), t


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"]])
def test_multirank_regex(flags):
    """The plan carries the bitmask to every rank; the sampling rank applies it."""
    pattern = r"[a-z ]{3,20}\."
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "generate", str(STORIES_EMBEDDED),
           "--max-tokens", "40", "--temperature", "1", "--sampling-seed", "3", "--json", "--regex", pattern,
           "--prompt", "Once upon a time", "--prompt", "Lily and Tom were", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, RANKSERVE_HEARTBEAT_TIMEOUT="30"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2
    for x in lines:
        assert x["finish_reason"] == "stop" and re.fullmatch(pattern, x["text"]), x


def test_slow_compile_does_not_stall_others_and_failures_finish_with_error():
    import threading
    from rankserve.runtime.inputs import engine_request
    llm = LLM(str(STORIES_EMBEDDED))
    core, mgr = llm.engine, llm.engine.structured
    gate = threading.Event()
    real = mgr._compile

    def slow(so):
        if so.regex == "boom":
            raise RuntimeError("boom")
        gate.wait(30)
        return real(so)
    mgr._compile = slow
    ids = llm.tokenizer("Once upon a time").input_ids
    sp_free = SamplingParams(temperature=0, max_tokens=8)
    sp_con = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="[a-z ]+"))
    for rid, sp in (("con", sp_con), ("free", sp_free), ("bad", SamplingParams(structured_outputs=SO(regex="boom")))):
        core.add_request(engine_request(rid, ids, sp, llm.eos_token_ids))
    done = {}
    while "free" not in done:
        for o in core.step().outputs:
            if o.finished:
                done[o.request_id] = o
    assert "con" not in done and core.scheduler.requests["con"].num_output_tokens == 0
    assert done["bad"].finish_reason == "error" and "boom" in done["bad"].error
    gate.set()
    toks = []
    while "con" not in done:
        for o in core.step().outputs:
            toks += o.new_token_ids if o.request_id == "con" else []
            if o.finished:
                done[o.request_id] = o
    assert re.fullmatch("[a-z ]+", llm.tokenizer.decode(toks))


def test_a_slow_parse_does_not_stall_the_engine_loop(monkeypatch):
    """Parsing a schema (xgrammar's JSON-schema converter: seconds for a deeply nested one) runs
    with the compilation on a grammar thread, never in `add_request` on the engine loop: it
    stalled every running request of the server (13 s for a 400-level schema); a constraint
    that fails to parse there finishes its request with the error."""
    import threading
    import time
    from rankserve.runtime import structured_output
    from rankserve.runtime.inputs import engine_request
    llm = LLM(str(STORIES_EMBEDDED))
    gate, real = threading.Event(), structured_output.parse_grammar

    def slow(so):
        gate.wait(10)
        return real(so)
    monkeypatch.setattr(structured_output, "parse_grammar", slow)
    ids = llm.tokenizer("Once upon a time").input_ids
    core, t0 = llm.engine, time.monotonic()
    for rid, so in (("con", SO(regex="[a-z ]+")), ("bad", SO(regex="a(b"))):
        core.add_request(engine_request(rid, ids, SamplingParams(max_tokens=4, structured_outputs=so),
                                        llm.eos_token_ids))
    core.add_request(engine_request("free", ids, SamplingParams(max_tokens=4), llm.eos_token_ids))
    done = {}
    while "free" not in done:
        done.update((o.request_id, o) for o in core.step().outputs if o.finished)
    assert time.monotonic() - t0 < 5 and "con" not in done
    gate.set()
    while len(done) < 3:
        done.update((o.request_id, o) for o in core.step().outputs if o.finished)
    assert done["bad"].finish_reason == "error"  # the parse's own message, as a 400's
    assert done["bad"].error.startswith("invalid structured_outputs.regex: "), done["bad"].error
    assert done["con"].finish_reason == "length"


def test_length_bounded_strings_stay_json():
    """xgrammar 0.2.9 writes a string with minLength / maxLength as `[^"\\\r\n]{m,n}`: raw
    control characters (a tab) allowed, escapes not — a sampled tab made invalid JSON (seen
    at 5 of 18 outputs of a random tiny Qwen3, on the GPU and on CPU). parse_grammar mends
    such character classes, also inside structural tags."""
    import xgrammar as xgr
    from rankserve.runtime.structured_output import parse_grammar
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
              "required": ["name"], "additionalProperties": False}

    def accepts(so, text):
        return xgr.testing._is_grammar_accept_string(parse_grammar(so), text)
    for so, wrap in [(SO(json=schema), "{}"), (SO(structural_tag=json.dumps({
            "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
            "triggers": ["<f>"]})), "x<f>{}</f>")]:
        def text(name):
            return wrap.replace("{}", '{"name": "%s"}' % name)
        assert accepts(so, text("ab\\tc")) and accepts(so, text("\\u00e9")), so  # escapes count as one
        for bad in ("a\tb", "a\x01", "abcde"):  # raw control characters are not JSON
            assert not accepts(so, text(bad)), (so, bad)
    # a user's own regex is not JSON: its character classes stay as written
    assert accepts(SO(regex='[^"\\\\\\r\\n]+'), "a\tb")


def test_tokenizer_info_trusts_the_vocabulary(qwen3_chat_dir, monkeypatch):
    """If xgrammar misreads a byte-level tokenizer as plain strings (it inspects the tokenizer
    object, which differs across transformers versions), a newline token would count as the two
    letters 'Ċ' inside a JSON string. The vocabulary decides the type instead."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from rankserve.runtime.structured_output import tokenizer_info
    tok = AutoTokenizer.from_pretrained(str(qwen3_chat_dir))
    real = xgr.TokenizerInfo.from_huggingface

    def misread(t, vocab_size=None, stop_token_ids=None):
        info = real(t, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        enc = [""] * vocab_size
        for token, idx in t.get_vocab().items():
            enc[idx] = token
        return xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=info.stop_token_ids)
    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", staticmethod(misread))
    info = tokenizer_info(tok, 151936, None)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}}'
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('{"a": "x')
    newline = tok.convert_tokens_to_ids("Ċ")
    assert not m.accept_token(newline)  # a raw newline inside a JSON string
