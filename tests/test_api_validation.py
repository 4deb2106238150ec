"""API hardening (issue 12, part A): no request can hurt the server, nothing is silently ignored.
A live server on the embedded stories260K (vocab 512, with a --chat-template so chat works),
plus the pure pieces (parser, sampling params, whole-request validation) without processes."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from rankserve.runtime.parse import make_parser
from rankserve.runtime.sampling_params import SamplingParams
from test_server import STORIES_TEXT, Server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]
CHAT = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def server():
    s = Server("--chat-template", TEMPLATE, "--max-num-seqs", "64", "--served-model-name",
               "stories260K", "--max-logprobs", "30")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c




def post(http, path: str, body) -> httpx.Response:
    """POST with ASCII-escaped JSON (so lone surrogates travel as valid JSON escapes)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def bad(r: httpx.Response, param: str | None = None, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


def alive(http):
    assert http.get("/health").status_code == 200
    r = post(http, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- defect 1: token ids out of the vocabulary --------------------------------------------------
@pytest.mark.parametrize("ids", [[600], [-1], [-600], [10**6], [2**70]])
def test_out_of_vocab_stop_token_ids_are_400(http, ids):
    for path, body in (("/v1/completions", {"prompt": "Once"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        r = post(http, path, {**body, "max_tokens": 4, "min_tokens": 1, "stop_token_ids": ids})
        err = bad(r, "stop_token_ids" if abs(ids[0]) < 2**63 else None)
        assert "stop_token_ids" in err["message"] or "stop_token_ids" in err["param"]
    alive(http)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1, 600]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [1, -5]]}, "prompt"),
    ("/v1/chat/completions/derender", {"token_ids": [-1]}, "token_ids"),
    ("/v1/chat/completions/derender", {"token_ids": [1], "prompt_token_ids": [512]},
     "prompt_token_ids"),
    ("/detokenize", {"tokens": [-3]}, "tokens"),
])
def test_every_token_id_is_range_checked(http, path, body, param):
    bad(post(http, path, body), param)


def test_engine_side_checks_token_ids_too():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[600], min_tokens=1).validate(512)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).validate(512)
    SamplingParams(stop_token_ids=[511]).validate(512)


# ---- defect 2: 500s that are 400s ---------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2**63 - 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "a", "n": 2, "seed": 2**63 - 1}, "seed"),
    ("/v1/completions", {"prompt": [1, 2**70]}, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2**64},
     "max_completion_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2**70}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_huge_integers_are_400(http, path, body, param):
    err = bad(post(http, path, body))
    assert param in (err["param"] or "") or param in err["message"]
    alive(http)


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"prompt": "Once \ud800 upon"}, 400),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, 400),
    ("/tokenize", {"prompt": "x\ud800"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}, 400),
    ("/v1/completions", {"model": "\ud800", "prompt": "a"}, 400),
    ("/v1/completions", {"prompt": "a", "\ud800": 1}, 400),
])
def test_lone_surrogates_are_400(http, path, body, status):
    err = bad(post(http, path, body), status=status)
    assert "surrogate" in err["message"]


def test_unknown_model_404_is_openai_format(http, client):
    err = bad(post(http, "/v1/completions", {"model": "gpt-17", "prompt": "a"}), "model", 404)
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("input_", [
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "input_text", "text": 5}]}],
    [{"role": "user", "content": [5]}],
    [{"type": "function_call", "name": 3, "arguments": {}, "call_id": "c"}],
    [{"role": "robot", "content": "hi"}],
    # OpenAI requires call_id, name and arguments: a call without them was taken as "" / "{}"
    [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f", "arguments": "{}"}],
    [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "arguments": "{}"}],
    [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f"}],
    # a call needs its output (OpenAI's "No tool output found for function call")
    [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                         "arguments": "{}"}],
])
def test_responses_input_of_the_wrong_type_is_400(http, input_):
    bad(post(http, "/v1/responses", {"input": input_}), "input")


def test_responses_metadata_is_strings(http):
    """OpenAI's metadata: up to 16 string values (keys up to 64 characters, values up to 512);
    any JSON was taken and echoed back, where the client's Response type holds strings."""
    for metadata in ({"a": 1}, {"a": {"b": "c"}}, {f"k{i}": "v" for i in range(17)},
                     {"k" * 65: "v"}, {"a": "v" * 513}):
        err = bad(post(http, "/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                               "metadata": metadata}))
        assert err["param"].startswith("metadata"), err
    r = post(http, "/v1/responses", {"input": "hi", "max_output_tokens": 1, "metadata": {"a": "b"}})
    assert r.json()["metadata"] == {"a": "b"}


@pytest.mark.parametrize("tools,words", [
    ([{"name": "f"}, {"name": "f"}], "unique"),  # (a forced call took the last one's schema)
    ([{"name": 5}], "tools[0].name"),
    ([{"name": "f", "description": 5}], "tools[0].description"),
])
def test_tool_names_are_unique_strings(server, http, tools, words):
    """Anthropic ("Tool names must be unique") and OpenAI refuse these; they were rendered."""
    anthropic_bad(server, {"tools": [{**t, "input_schema": {"type": "object"}} for t in tools]},
                  words)
    err = bad(post(http, "/v1/responses", {"input": "hi", "tools": [
        {"type": "function", **t} for t in tools]}), "tools")
    assert words in err["message"], err


def test_whole_request_is_validated_before_anything_is_sent():
    """n=2 with a seed that fits choice 0 but not choice 1: nothing reaches the engine."""
    from rankserve.runtime.serve import openai_api
    from rankserve.runtime.serve.protocol import APIError, CompletionRequest
    from test_server_unit import make_ctx
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[1] / "models" / "default" / "stories260K")
    ctx = make_ctx(tok, reasoning_parser=None, tool_call_parser=None,
                   enable_auto_tool_choice=False)
    ctx.client.model_info = {"vocab_size": 512, "max_model_len": 256}
    for body in ({"prompt": ["Once", "upon"], "n": 2, "seed": 2**63 - 1},
                 {"prompt": [[1, 2], [1, 600]]},
                 {"prompt": ["Once", "word " * 300]},
                 {"prompt": ["Once"] * 3, "n": 128}):
        with pytest.raises(APIError):
            asyncio.run(openai_api.create_completion(ctx, CompletionRequest(**body)))
        assert ctx.client.sent == [], body


# ---- defect 7: nothing silently ignored ---------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("guided_whitespace_pattern", "\\s*"), ("guided_decoding_backend", "outlines"),
    ("use_beam_search", True), ("logits_processors", ["x"]), ("frobnicate", 1),
])
def test_unimplemented_fields_are_400(http, field, value):
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        bad(post(http, path, {**body, field: value}), field)


def test_unimplemented_fields_with_noop_values_pass(http):
    r = post(http, "/v1/completions", {"prompt": "Once", "max_tokens": 2,
                                       "use_beam_search": False, "bad_words": []})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "none",
                              "parallel_tool_calls": False, "tool_choice_x": 1}, "tool_choice_x"),
    ("/v1/responses", {"input": "hi", "store": True}, "store"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "extreme"},
     "reasoning_effort"),
    # Responses' reasoning took any field (a typo of effort was dropped)
    ("/v1/responses", {"input": "hi", "reasoning": {"efort": "low"}}, "reasoning.efort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
])
def test_other_unimplemented_values_are_400(http, path, body, param):
    bad(post(http, path, body), param)


def test_prompt_logprobs(client, http):
    prompt = "Lily saw a big red ball in the park"
    ids = post(http, "/tokenize", {"prompt": prompt}).json()["tokens"]
    r = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                       "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and 1 <= len(entry) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(tid)])
    r = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                            "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) > 1
    # streamed: on the first chunk of the choice
    with client.completions.create(model="stories260K", prompt=prompt + " again", max_tokens=3,
                                   stream=True, extra_body={"prompt_logprobs": 1}) as s:
        chunks = [c.model_dump() for c in s]
    assert chunks[0]["choices"][0]["prompt_logprobs"][0] is None


def test_return_token_ids(client, http):
    ids = post(http, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=5,
                                  temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0].model_dump()
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == r.usage.completion_tokens
    r = post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                            "return_token_ids": True}).json()
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    with client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=5,
                                   stream=True, extra_body={"return_token_ids": True}) as s:
        chunks = [c.model_dump()["choices"] for c in s]
    streamed = [t for ch in chunks for c in ch for t in c["token_ids"]]
    assert chunks[0][0]["prompt_token_ids"] == ids and len(streamed) == 5


def test_truncate_prompt_tokens(client):
    r = client.completions.create(model="stories260K", prompt="word " * 400, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10


def test_truncate_prompt_tokens_takes_prompts_longer_than_the_context(client):
    """truncate_prompt_tokens is there for prompts over the context: a text of 3 contexts was
    refused by the length check made before tokenizing (as if nothing would be cut)."""
    long = "Lily went to the park. " * 400  # ~2800 tokens, 9200 characters; context 512
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="stories260K", prompt=long, max_tokens=2)
    r = client.completions.create(model="stories260K", prompt=[long, "Once"], max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10 + 2
    r = client.chat.completions.create(model="stories260K", max_tokens=2,
                                       messages=[{"role": "user", "content": long}],
                                       extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10


def test_chat_template_per_request_and_flag(http):
    r = post(http, "/v1/chat/completions/render", {"messages": CHAT}).json()
    assert r["prompt"].strip() == "Once upon a time"  # the --chat-template flag
    r = post(http, "/v1/chat/completions/render",
             {"messages": CHAT, "chat_template": "Lily {{ messages[0]['content'] }}"}).json()
    assert r["prompt"].strip() == "Lily Once upon a time"
    bad(post(http, "/v1/chat/completions/render",
             {"messages": CHAT, "chat_template": "{% if %}"}), "messages")


def test_message_names_reach_the_chat_template(http):
    """OpenAI's `name` of a participant (any role): vLLM hands it to the chat template, which
    may show it; it was dropped from all but tool messages, so a template using it got none."""
    template = "{% for m in messages %}{{ m.role }}/{{ m.name }}: {{ m.content }}\n{% endfor %}"
    msgs = [{"role": "system", "name": "rules", "content": "be brief"},
            {"role": "user", "name": "bob", "content": "hi"},
            {"role": "assistant", "name": "ann", "content": "yo"}, {"role": "user", "content": "x"}]
    r = post(http, "/v1/chat/completions/render", {"messages": msgs, "chat_template": template})
    assert r.json()["prompt"].split("\n")[:4] == [
        "system/rules: be brief", "user/bob: hi", "assistant/ann: yo", "user/: x"], r.text
    bad(post(http, "/v1/chat/completions", {"messages": [{"role": "user", "name": 5,
                                                          "content": "hi"}]}), "messages")


def test_chat_template_flag_value():
    from rankserve.runtime.render import load_chat_template
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="file path"):
        load_chat_template("/no/such/template.jinja")


def test_chat_echo(client):
    msgs = CHAT + [{"role": "assistant", "content": "Lily"}]
    kw = dict(model="stories260K", messages=msgs, max_tokens=3, temperature=0,
              extra_body={"echo": True, "continue_final_message": True,
                          "add_generation_prompt": False})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content.startswith("Lily")
    with client.chat.completions.create(**kw, stream=True) as s:
        text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert text == r.choices[0].message.content


# ---- defect 8: semantics ------------------------------------------------------------------------
def test_stop_strings_and_bad_words_are_capped(http, claude):
    """Every stop string is searched at every token, on the API process's event loop: 100,000
    of them (1 MB of JSON) stalled every other request for seconds; so did 50,000 bad_words
    (each tokenized, then checked at every step). At most 1024 of each now."""
    many = [f"zq{i:06d}" for i in range(100_000)]
    for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        for field in ("stop", "bad_words"):
            bad(post(http, path, {**body, "max_tokens": 2, field: many}), field)
            r = post(http, path, {**body, "max_tokens": 2, field: many[:1024]})
            assert r.status_code == 200, r.text
    with pytest.raises(anthropic.BadRequestError, match="stop"):
        claude.messages.create(model="stories260K", max_tokens=2, stop_sequences=many,
                               messages=[{"role": "user", "content": "Once"}])


def test_sampling_values_beyond_float32_break_no_mask(http):
    """The sampler works in float32: a temperature over its range (1e39, plain JSON) became inf
    and the masked logits NaN, so tokens outside allowed_token_ids / the grammar (<unk>) came
    out; a top_p that is 0 in float32 masked every token; a repetition penalty that small made
    the seen logits inf (NaN probabilities: <unk> again)."""
    def raw(body: str) -> httpx.Response:
        return http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    base = '"prompt": "Once upon a time", "max_tokens": 4, "return_token_ids": true'
    bad(raw('{%s, "temperature": 1e39, "allowed_token_ids": [5, 6, 7]}' % base), "temperature")
    r = raw('{%s, "temperature": 3e38, "allowed_token_ids": [5, 6, 7]}' % base)
    assert set(r.json()["choices"][0]["token_ids"]) <= {5, 6, 7}, r.text
    greedy = raw('{%s, "temperature": 0}' % base).json()["choices"][0]["token_ids"]
    for top_p in ("1e-320", "1e-45"):  # (0 and the least float32 above it): the top token only
        r = raw('{%s, "top_p": %s, "seed": 1}' % (base, top_p))
        assert r.json()["choices"][0]["token_ids"] == greedy, (top_p, r.text)
    r = raw('{%s, "repetition_penalty": 1e-39, "seed": 1}' % base)  # seen tokens win
    ids = r.json()["choices"][0]["token_ids"]
    assert all(t in [1, 403, 407, 261, 378] + ids[:i] for i, t in enumerate(ids)), ids


def test_max_tokens_beyond_the_context_is_400(http):
    err = bad(post(http, "/v1/completions", {"prompt": "Once", "max_tokens": 10_000}),
              "max_tokens")
    assert "context length" in err["message"]
    bad(post(http, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10_000}),
        "max_completion_tokens")


def test_streamed_logprobs_stay_in_line_with_held_back_text(client):
    kw = dict(model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0,
              logprobs=1, stop=["in the park"])
    whole = client.completions.create(**kw).choices[0]
    with client.completions.create(**kw, stream=True) as s:
        chunks = [c.choices[0] for c in s if c.choices]
    text, tokens, offsets = "", [], []
    for c in chunks:
        text += c.text
        lp = c.logprobs
        if lp and lp.tokens:
            if c.finish_reason is None:  # a chunk's tokens never run ahead of its text
                assert lp.text_offset[-1] + len(lp.tokens[-1]) <= len(text)
            tokens += lp.tokens
            offsets += lp.text_offset
    assert text == whole.text and whole.finish_reason == "stop"
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_include_usage_is_null_until_the_last_chunk(http):
    for path, body in (("/v1/completions", {"prompt": "Once"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        with http.stream("POST", path, json={**body, "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}}) as r:
            data = [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: {")]
        assert all("usage" in d and d["usage"] is None for d in data[:-1]), path
        assert data[-1]["usage"]["completion_tokens"] == 3


def test_anthropic_input_tokens_exclude_cached(claude):
    text = STORIES_TEXT * 2
    kw = dict(model="stories260K", max_tokens=2, messages=[{"role": "user", "content": text}])
    first = claude.messages.create(**kw).usage
    second = claude.messages.create(**kw).usage
    assert second.cache_read_input_tokens > 0
    assert second.input_tokens + second.cache_read_input_tokens == \
        first.input_tokens + first.cache_read_input_tokens


def test_parser_keeps_whitespace_content():
    for tools, reasoning in (("hermes", None), (None, "qwen3"), ("hermes", "qwen3")):
        for text in ("  Hi  ", "\n\n\n", " a\n"):
            assert make_parser(None, tools, reasoning).parse([], text).content == text
    # whitespace around markers is still layout, not content
    msg = make_parser(None, "hermes", "qwen3").parse([], "<think>a</think>\n\nHi\n")
    assert msg.reasoning == "a" and msg.content == "Hi\n"


@pytest.mark.parametrize("family,cut", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "argum'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci'),
    ("deepseek_v3", 'x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"ci'),
])
def test_a_cut_tool_call_comes_back_as_content(family, cut):
    """Cut by a stop string or max_tokens inside a call, or ended there by the model: the text
    is the content either way (vLLM's parsers), never lost."""
    for truncated in (True, False):
        p = make_parser(None, family)
        p.feed([], cut)
        p.finish(truncated=truncated)
        msg = p.result()
        assert msg.content == cut and msg.tool_calls == []


@pytest.mark.parametrize("schema", [{"type": "banana"}, {"properties": 3}, "string"])
def test_invalid_tool_schemas_are_400(http, claude, schema):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    bad(post(http, "/v1/chat/completions", {"messages": CHAT, "tools": tools,
                                            "tool_choice": "none"}),
        "tools[0].function.parameters")
    bad(post(http, "/v1/responses", {"input": "hi", "tool_choice": "none", "tools": [
        {"type": "function", "name": "f", "parameters": schema}]}), "tools[0].parameters")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="stories260K", max_tokens=2, messages=CHAT,
                               tools=[{"name": "f", "input_schema": schema}])
    assert "input_schema" in str(e.value)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "true"}},
     "stream_options.include_usage"),
    ({"max_tokens": 3}, "prompt"),
])
def test_validation_errors_name_the_field_and_booleans_are_strict(http, body, param):
    bad(post(http, "/v1/completions", body), param)


def test_anthropic_errors_use_anthropic_terms(server):
    r = httpx.post(server.url + "/v1/messages", json={
        "model": "stories260K", "max_tokens": 2, "messages": CHAT,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}})  # the server has no --enable-auto-tool-choice
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    msg = body["error"]["message"]
    assert '"auto"' in msg and "required" not in msg and "function" not in msg
    r = httpx.post(server.url + "/v1/messages", json={"model": "stories260K", "messages": CHAT})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_sequences_per_request_are_capped(http):
    err = bad(post(http, "/v1/completions", {"prompt": ["a"] * 200, "n": 2, "max_tokens": 1}),
              "n")
    assert "256" in err["message"]


def test_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 1},
                  headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = http.post("/v1/completions", json={"prompt": 1})
    assert r.status_code == 400 and r.headers.get("x-request-id")


# ---- defect 9 -----------------------------------------------------------------------------------
def test_models_retrieve(client):
    assert client.models.retrieve("stories260K").id == "stories260K"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.body["code"] == "model_not_found"


# ---- --max-logprobs (vLLM's flag) ---------------------------------------------------------------
def test_max_logprobs_flag_sets_the_request_limit(http):
    """The server runs with --max-logprobs 30: 30 passes, 31 is a 400 naming the field, for every
    logprobs field of both endpoints (streamed too)."""
    cases = (("/v1/completions", {"prompt": "Once"}, "logprobs", {}),
             ("/v1/completions", {"prompt": "Once"}, "prompt_logprobs", {}),
             ("/v1/chat/completions", {"messages": CHAT}, "top_logprobs", {"logprobs": True}),
             ("/v1/chat/completions", {"messages": CHAT}, "prompt_logprobs", {}))
    for path, body, field, more in cases:
        for stream in (False, True):
            body = {**body, **more, "max_tokens": 2, "stream": stream}
            r = post(http, path, {**body, field: 30})
            assert r.status_code == 200, (path, field, r.text)
            err = bad(post(http, path, {**body, field: 31}), field)
            assert "30" in err["message"] and "--max-logprobs" in err["message"], err
    r = post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "logprobs": True,
                                            "top_logprobs": 25}).json()
    assert len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    alive(http)


def test_max_logprobs_offline_and_flag_values():
    from rankserve.runtime.config import ConfigError, EngineConfig
    from rankserve.runtime.llm import LLM
    assert EngineConfig().model.max_logprobs == 20  # vLLM's default
    with pytest.raises(ConfigError, match="--max-logprobs"):
        EngineConfig.from_kwargs(max_logprobs=-2)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate(512, max_logprobs=20)
    llm = LLM(max_logprobs=-1, device="cpu")  # -1: the vocabulary size (512)
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=1, logprobs=512))
    assert len(out[0].outputs[0].logprobs[0]) == 512  # the top 512: the sampled one among them
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["Once upon"], SamplingParams(max_tokens=1, logprobs=513))
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1))
    assert len(out[0].outputs[0].logprobs[0]) == 512  # -1: the vocabulary, as vLLM's
    with pytest.raises(ValueError, match="logprobs"):  # -1 is held to max_logprobs too
        LLM(device="cpu").generate(["Once"], SamplingParams(max_tokens=1, logprobs=-1))
    with pytest.raises(ValueError, match="logprobs"):
        LLM(device="cpu").generate(["Once"], SamplingParams(max_tokens=1, logprobs=21))


# ---- response_format json_schema: name (OpenAI: required, [a-zA-Z0-9_-]{1,64}) -----------------
@pytest.mark.parametrize("name,ok", [(None, False), ("", False), ("a b", False), ("x" * 65, False),
                                     (3, False), ("Weather_v2-x", True), ("x" * 64, True)])
def test_json_schema_format_needs_a_valid_name(http, name, ok):
    spec = {"schema": {"type": "object"}} | ({} if name is None else {"name": name})
    nested = {"response_format": {"type": "json_schema", "json_schema": spec}, "max_tokens": 2}
    for path, body, param in (
            ("/v1/chat/completions", {"messages": CHAT, **nested}, "response_format.json_schema.name"),
            ("/v1/completions", {"prompt": "Once", **nested}, "response_format.json_schema.name"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                               "text": {"format": {"type": "json_schema", **spec}}},
             "text.format.name")):
        r = post(http, path, body)
        if ok:
            assert r.status_code == 200, (path, r.text)
        else:
            assert "name" in bad(r, param)["message"]


# ---- Anthropic Messages: what Anthropic refuses ------------------------------------------------
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


def anthropic_bad(server, body: dict, words: str, path: str = "/v1/messages") -> None:
    body = {"model": "stories260K", "messages": CHAT, **body}
    if path == "/v1/messages":
        body.setdefault("max_tokens", 2048)
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert words in err["error"]["message"], err


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_tools_need_an_input_schema(server, path):
    anthropic_bad(server, {"tools": [WEATHER, {"name": "f"}], "tool_choice": {"type": "none"}},
                  "tools[1].input_schema", path)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024},
                                      {"type": "adaptive"}])
def test_anthropic_forced_tool_use_with_thinking_is_400(server, choice, thinking):
    anthropic_bad(server, {"tools": [WEATHER], "tool_choice": choice, "thinking": thinking},
                  "Thinking may not be enabled when tool_choice forces tool use")


@pytest.mark.parametrize("thinking,max_tokens,words", [
    ({"type": "enabled", "budget_tokens": 1023}, 2048, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 1024}, 1024, "greater than `thinking.budget_tokens`"),
    ({"type": "enabled"}, 2048, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": "many"}, 2048, "thinking.budget_tokens"),
    ({"type": "disabled", "budget_tokens": 2000}, 4000, "thinking"),
])
def test_anthropic_thinking_budget_is_checked(server, thinking, max_tokens, words):
    anthropic_bad(server, {"thinking": thinking, "max_tokens": max_tokens}, words)


def test_anthropic_thinking_display(server, claude):
    """The client's `thinking.display`: "summarized" is how thinking is returned here anyway
    (it was a 400 'Extra inputs'); "omitted" (redacted thinking) is not implemented: a 400."""
    m = claude.messages.create(model="stories260K", max_tokens=2, messages=CHAT,
                               thinking={"type": "adaptive", "display": "summarized"})
    assert m.usage.output_tokens == 2
    for kind in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}):
        anthropic_bad(server, {"thinking": {**kind, "display": "omitted"}}, "thinking.display")
        anthropic_bad(server, {"thinking": {**kind, "display": "full"}}, "thinking.display")


def test_anthropic_thinking_and_tools_that_anthropic_allows(claude):
    m = claude.messages.create(model="stories260K", max_tokens=3, messages=CHAT,
                               thinking={"type": "adaptive"}, tools=[WEATHER],
                               tool_choice={"type": "none"})
    assert m.stop_reason == "max_tokens"
    m = claude.messages.create(model="stories260K", max_tokens=3, messages=CHAT, tools=[WEATHER],
                               tool_choice={"type": "any"}, thinking={"type": "disabled"})
    assert m.stop_reason in ("tool_use", "max_tokens")


@pytest.mark.parametrize("messages,words", [
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": None}]}]}],
     "messages[2].content[0].content[0].text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5, "signature": ""}]}, {"role": "user", "content": "x"}],
     "messages[1].content[0].thinking"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": 5, "name": "f", "input": {}}]}], "messages[1].content[0].id"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": "x"}]}], "content[0].input"),
    # a tool_result answers a tool_use of the assistant message just before it (Anthropic's)
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "ok"}]}],
     "t9"),
    # and a tool_use needs its tool_result in the next (user) turn, Anthropic's too
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
        {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}],
     "without tool_result blocks immediately after: t2"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": 5}]}], "content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": "yes"}]}], "is_error"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_malformed_blocks_are_400(server, path, messages, words):
    """A block field of the wrong type was a 500 (`sequence item 0: expected str instance`), a
    tool_result for no tool_use was rendered as an answer to nothing: 400s naming the place."""
    anthropic_bad(server, {"messages": messages}, words, path)
    anthropic_bad(server, {"system": [{"type": "text", "text": 5}]}, "system[0].text", path)


def test_anthropic_final_assistant_message_is_a_prefill(server, http, claude):
    """Anthropic: a final assistant message is a prefill, the answer continues it. It was
    rendered as a finished turn, the answer a new one after it."""
    msgs = CHAT + [{"role": "assistant", "content": "there was a little"}]
    want = post(http, "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                    "continue_final_message": True}).json()["tokens"]
    assert claude.messages.count_tokens(model="stories260K", messages=msgs).input_tokens == \
        len(want)
    m = claude.messages.create(model="stories260K", max_tokens=8, messages=msgs,
                               extra_body={"temperature": 0})
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(want)
    text = post(http, "/v1/completions", {"prompt": want, "max_tokens": 8,
                                          "temperature": 0}).json()["choices"][0]["text"]
    assert m.content[0].text == text
    anthropic_bad(server, {"messages": CHAT + [{"role": "assistant", "content": "there was "}]},
                  "trailing whitespace")
    anthropic_bad(server, {"messages": msgs, "thinking": {"type": "adaptive"}}, "prefill")
    anthropic_bad(server, {"messages": CHAT + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, "tool_use")


@pytest.mark.parametrize("body,words", [
    ({"metadata": {"foo": "u1"}}, "metadata.foo"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"cache_control": {"type": "forever"}}, "cache_control.type"),
])
def test_anthropic_request_fields_are_checked(server, claude, body, words):
    """metadata (only user_id), service_tier (auto / standard_only) took anything; the
    anthropic client's own top-level cache_control was refused as an unknown field (on blocks
    it is taken: prefix caching is automatic, the marker a hint)."""
    anthropic_bad(server, body, words)
    m = claude.messages.create(model="stories260K", max_tokens=2, messages=CHAT,
                               metadata={"user_id": "u1"}, service_tier="standard_only",
                               cache_control={"type": "ephemeral", "ttl": "1h"})
    assert m.usage.output_tokens == 2


def test_anthropic_count_tokens_takes_what_messages_take(server, claude):
    """The client's count_tokens sends cache_control and output_config as messages.create does:
    both were 400s ('Extra inputs'); they do not change the prompt, so not the count either.
    A malformed one is still a 400."""
    n = claude.messages.count_tokens(model="stories260K", messages=CHAT).input_tokens
    assert claude.messages.count_tokens(
        model="stories260K", messages=CHAT, cache_control={"type": "ephemeral"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    ).input_tokens == n
    anthropic_bad(server, {"output_config": {"format": {"type": "yaml"}}}, "output_config.format",
                  "/v1/messages/count_tokens")
    anthropic_bad(server, {"cache_control": {"type": "x"}}, "cache_control",
                  "/v1/messages/count_tokens")


def test_logprobs_minus_one_is_the_vocabulary_and_top_logprobs_zero_alone_passes(http):
    """vLLM: -1 asks the whole vocabulary (then held to --max-logprobs); top_logprobs 0 without
    logprobs asks nothing, so it is no error (above 0 it is)."""
    for path, body, field in (("/v1/completions", {"prompt": "Once"}, "logprobs"),
                              ("/v1/completions", {"prompt": "Once"}, "prompt_logprobs"),
                              ("/v1/chat/completions", {"messages": CHAT, "logprobs": True},
                               "top_logprobs")):
        err = bad(post(http, path, {**body, "max_tokens": 1, field: -1}), field)
        assert "512" in err["message"] and "--max-logprobs 30" in err["message"], err
        bad(post(http, path, {**body, "max_tokens": 1, field: -2}), field)
    r = post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    bad(post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "top_logprobs": 1}),
        "top_logprobs")
    from rankserve.runtime.serve import openai_api
    from rankserve.runtime.serve.protocol import CompletionRequest
    from test_server_unit import make_ctx
    ctx = make_ctx(None, reasoning_parser=None, tool_call_parser=None,
                   enable_auto_tool_choice=False)
    ctx.client.model_info = {"vocab_size": 512, "max_model_len": 256, "max_logprobs": 512}
    _, params = openai_api.prepare_completion(ctx, CompletionRequest(
        prompt=[1, 2], logprobs=-1, prompt_logprobs=-1))
    assert params.logprobs == params.prompt_logprobs == 512


def test_explicit_nulls_are_the_defaults(http):
    """OpenAI's (and vLLM's) optional fields are nullable: a client that sends every field, null
    where unset (`"logprobs": null`, `"n": null`, `"stream": null`), gets the defaults, not a 400."""
    nulls = {"logprobs": None, "n": None, "stream": None, "echo": None,
             "presence_penalty": None, "frequency_penalty": None}
    r = post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **nulls,
                                            "top_logprobs": None, "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    c = r.json()["choices"]
    assert len(c) == 1 and c[0]["logprobs"] is None
    r = post(http, "/v1/completions", {"prompt": "Once", "max_tokens": 2, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = post(http, "/v1/completions", {"prompt": "Once", "max_tokens": None, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] > 16  # null is a value here: no limit (vLLM)
    r = post(http, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": None,
                                     "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    bad(post(http, "/v1/chat/completions", {"messages": None, "max_tokens": 2}), "messages")


def test_generation_prompt_options_and_special_token_spacing(http):
    """vLLM's rules: continue_final_message with an explicit add_generation_prompt true is a 400
    (true by default gives way); spaces_between_special_tokens takes its default only."""
    msgs = [{"role": "user", "content": "Once"}, {"role": "assistant", "content": "upon a"}]
    chat = {"model": "stories260K", "messages": msgs}
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        body = {**chat, **extra}
        r = http.post(path, json={**body, "continue_final_message": True, "add_generation_prompt": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
        assert http.post(path, json={**body, "continue_final_message": True}).status_code == 200
    comp = {"model": "stories260K", "prompt": "Once", "max_tokens": 2}
    assert http.post("/v1/completions", json={**comp, "spaces_between_special_tokens": True}).status_code == 200
    r = http.post("/v1/completions", json={**comp, "spaces_between_special_tokens": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"
