"""Structured outputs and tool calling driven as a reviewer would (issue #13's edge cases),
against a live server on a tiny RANDOM-weight Qwen3 with the real Qwen3 tokenizer, through the
`openai` / `anthropic` clients and plain HTTP: every output must satisfy its constraint, and
every constraint the server cannot enforce must be a 400 naming it (never a silent loosening)."""
from __future__ import annotations

import functools
import json
import re

import httpx
import pytest


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Answer as JSON."}]


@pytest.fixture(scope="module")
def server(structured_qwen3_server):  # one server for this module and its sibling (conftest)
    return structured_qwen3_server


def completion(server, **body):
    return httpx.post(server.url + "/v1/completions",
                      json={"prompt": "Answer:", "max_tokens": 8, **body}, timeout=60)


def bad_request(r, *words):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    for w in words:
        assert w in err["message"] or w == err["param"], err
    return err


# xgrammar drops these keywords without an error: the output would not validate
@pytest.mark.parametrize("schema, word", [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     "allOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "lookaround"),
    ({"type": "object", "patternProperties": {"^(?<=a)b$": {"type": "integer"}}}, "lookaround"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}, "'z'"),
    # deep inside: a property of an array item of a $defs entry
    ({"$defs": {"P": {"type": "object", "properties": {"t": {"type": "array", "items": {
        "type": "string", "not": {"const": "x"}}}}}}, "$ref": "#/$defs/P"}, "/$defs/P/properties"),
    # xgrammar's conversion time grows with the cube of the depth (400 levels: 35 s)
    (functools.reduce(lambda s, _: {"type": "array", "items": s}, range(65), {"type": "integer"}),
     "deep"),
    # malformed values the converter took without an error (an empty anyOf, a string required)
    ({"anyOf": []}, "anyOf"), ({"oneOf": []}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": "a"}, "required"),
    ({"type": []}, "type"), ({"type": "strnig"}, "type"), ({"enum": []}, "enum"),
    ({"type": "object", "properties": {"a": {"enum": "x"}}}, "/properties/a/enum"),
])
def test_unenforceable_schema_keywords_are_400(server, schema, word):
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema}}}):
        bad_request(completion(server, **body), word)


def test_supported_schema_keywords_still_work(server):
    """Data that looks like a keyword (an enum value "not") is not refused; a recursive local
    $ref and patternProperties are enforced."""
    tree = {"$defs": {"n": {"type": "object", "properties": {"v": {"enum": ["not", "if"]},
                                                             "c": {"$ref": "#/$defs/n"}},
                            "required": ["v"], "additionalProperties": False}},
            "$ref": "#/$defs/n"}
    r = completion(server, max_tokens=200, temperature=1.0, seed=0, structured_outputs={"json": tree})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":
        import jsonschema
        jsonschema.validate(json.loads(c["text"]), tree)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "shcema": {}}},
     "response_format.json_schema.shcema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "description": 5}},
     "response_format.json_schema.description"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "strict": True},
     "response_format.strict"),
    ({"type": "json_schema", "schema": {"type": "integer"}}, "response_format.schema"),
    ({"type": "json_object", "schema": {"type": "object"}}, "response_format.schema"),
    ({"type": "text", "json_schema": {}}, "response_format.json_schema"),
])
def test_response_format_fields_are_not_dropped(server, fmt, param):
    bad_request(completion(server, response_format=fmt), param)


def test_responses_text_fields_are_not_dropped(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "object"},
                            "strict": 1}}})
    bad_request(r, "text.format.strict")
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 8, "text": {"format": {"type": "text"},
                                                         "verbosity": "low"}})
    bad_request(r, "text.verbosity")


def test_disable_any_whitespace_and_an_empty_constraint(server):
    """vLLM's structured_outputs.disable_any_whitespace (was a 400 "unsupported options"): the
    JSON has no whitespace but xgrammar's ", " / ": " separators, and it is not served from the
    cache of the same schema with whitespace. An empty structured_outputs object is a 400 (was
    silently unconstrained)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    completion(server, structured_outputs={"json": schema}, seed=0)  # (cached with whitespace)
    for seed in range(2):
        r = completion(server, structured_outputs={"json": schema, "disable_any_whitespace": True},
                       max_tokens=60, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert re.fullmatch(r'\{"a": \d+, "b": "[xy]"\}', text), text
    bad_request(completion(server, structured_outputs={}), "structured_outputs")
    bad_request(completion(server, structured_outputs={"json": schema, "whitespace_pattern": " "}),
                "whitespace_pattern")


@pytest.mark.parametrize("words", [[""], ["  "], ["ok", ""]])
def test_empty_bad_words_are_400(server, words):
    bad_request(completion(server, bad_words=words), "bad_words")


def nested_tool_schema() -> dict:
    """What pydantic (and openai.pydantic_function_tool) writes for nested models: $defs and
    local $refs, one of them recursive."""
    import enum

    import pydantic

    class Unit(str, enum.Enum):
        c = "c"
        f = "f"

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        near: list["Place"] = pydantic.Field(default_factory=list, max_length=1)

    class Query(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        place: Place
        unit: Unit
        days: int | None = pydantic.Field(default=None, ge=1, le=7)

    schema = Query.model_json_schema()
    assert "$defs" in schema and "$ref" in json.dumps(schema["properties"])
    return schema


def test_forced_tool_calls_with_refs_in_the_schema(client):
    """tool_choice required builds one schema of all the tools: each tool's local $refs
    (#/$defs/...) must still resolve inside it (was a 400: "Cannot find field '$defs'")."""
    import jsonschema
    schema = nested_tool_schema()
    tools = [{"type": "function", "function": {"name": "look", "parameters": schema}},
             {"type": "function", "function": {"name": "other", "parameters": {
                 "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"],
                 "$defs": {"X": {"enum": [1, 2]}}}}}]
    schemas = {"look": schema, "other": tools[1]["function"]["parameters"]}
    got = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model="q", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=seed,
            extra_body=NO_THINK, tools=tools, tool_choice="required", parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls or []
        assert len(calls) <= 1
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            got += 1
    assert got  # (random weights finish a call within 300 tokens on these seeds)


def test_forced_tool_call_with_properties_named_like_keywords(client):
    """A parameter called "default" / "enum" / "const" / "examples" is a subschema, not data:
    its $ref must be moved with its tool's schema too (was a 400: "Cannot find field 'Mode'")."""
    import jsonschema
    schema = {"$defs": {"Mode": {"enum": ["a", "b"]}}, "type": "object",
              "properties": {k: {"$ref": "#/$defs/Mode"} for k in ("default", "enum", "const")},
              "required": ["default", "enum", "const"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    r = client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=200, seed=0,
                                       extra_body=NO_THINK, tools=tools, tool_choice="required")
    for c in r.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(c.function.arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_choice_without_tools_is_400(client, choice):
    import openai
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=4,
                                       extra_body=NO_THINK, tool_choice=choice)


def test_anthropic_tool_choice_is_checked(claude):
    import anthropic
    tools = [{"name": "w", "input_schema": {"type": "object", "properties": {
        "d": {"type": "integer"}}, "required": ["d"]}}]
    kw = dict(model="q", max_tokens=4, messages=MESSAGES, thinking={"type": "disabled"})
    for tc, tl in (({"type": "any"}, None), ({"type": "tool", "name": "w"}, None),
                   ({"type": "any", "disable_parallel": True}, tools),  # a misspelt field
                   ({"type": "none", "name": "w"}, tools),
                   ({"type": "any", "disable_parallel_tool_use": "yes"}, tools)):
        with pytest.raises(anthropic.BadRequestError, match="tool"):
            claude.messages.create(**kw, tool_choice=tc, **({"tools": tl} if tl else {}))


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_chat_dir):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_chat_dir))


def parse_pieces(tok, pieces: list[str]):
    """Feed the hermes parser one piece at a time, "<tool_call>" as its special token."""
    from rankserve.runtime.parse.families import make_parser
    p = make_parser(tok, "hermes", None)
    for s in pieces:
        p.feed([151657] if s == "<tool_call>" else tok.encode(s, add_special_tokens=False), s)
    p.finish()
    return p.result()


@pytest.mark.parametrize("tail, content", [
    (["</tool_call>"], None),  # the special token
    (["<", "/t", "oo", "l", "_cal", "l", ">"], None),  # the same characters as plain tokens
    (["<", "/t", "oo", "l", "_cal", "l", ">", ">("], ">("),
    (["x"], "x"),  # text that is not the end marker: given back after the call, once
])
def test_hermes_call_closed_by_text_spelled_end_marker(qwen3_tokenizer, tail, content):
    """A strict tool's structural tag ends a call with the text "}\\n</tool_call>", which the
    model may spell with ordinary tokens (seen at temperature 1.0). The call is complete; its
    closing characters were leaked into the content as well ('"}}\\n</tool_call>')."""
    r = parse_pieces(qwen3_tokenizer, ["<tool_call>", '\n{"name": "t", "arguments": {"tz": "', "UTC",
                                       '"}}\n', *tail])
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("t", {"tz": "UTC"})]
    assert (r.content.strip() if r.content else None) == content


def test_offline_bad_words_and_unenforceable_schema_are_errors(qwen3_chat_dir):
    """Through `LLM`: the same refusals as the server's 400s (an empty bad word was an
    IndexError from the tokenization, an unenforceable keyword was silently dropped)."""
    from rankserve.runtime.llm import LLM
    from rankserve.runtime.sampling_params import SamplingParams, StructuredOutputsParams
    llm = LLM(str(qwen3_chat_dir), max_model_len=256)
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, bad_words=["ok", " "]))
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            json={"type": "array", "uniqueItems": True})))
    [out] = llm.generate(["hi"], SamplingParams(max_tokens=40, temperature=1.0, seed=0,
                                                structured_outputs=StructuredOutputsParams(
                                                    choice=["alpha", "beta"])))
    assert out.outputs[0].text in ("alpha", "beta")


@pytest.mark.parametrize("extra", [{"min_tokens": 3}, {"allowed_token_ids": [1000]}])
def test_constraint_conflicting_with_token_restrictions_is_400_naming_them(server, extra):
    """choice "a" ends after one token, so min_tokens (EOS banned) or allowed_token_ids leave
    no token the grammar allows: a 400 that says why, and nothing left running."""
    err = bad_request(completion(server, structured_outputs={"choice": ["a"]}, **extra))
    assert "min_tokens" in err["message"] and "allowed_token_ids" in err["message"], err
    m = httpx.get(server.url + "/metrics").text
    assert 'rankserve:num_requests_running{engine="0",model_name="q"} 0.0' in m
    assert 'rankserve:kv_cache_blocks_used{engine="0",model_name="q"} 0.0' in m


def test_choices_outside_the_basic_plane(server):
    """A choice with a character beyond U+FFFF (an emoji) was written into the grammar as a
    JSON surrogate-pair escape, which matches no UTF-8 text: the output was '' (not a choice)."""
    seen = set()
    for seed, choices in enumerate((["😀", "🙂"], ["😀", "x"], ["😀", "𝔵y", 'a"b\\c', "tab\there"]) * 2):
        r = completion(server, max_tokens=30, temperature=1.0, seed=seed,
                       structured_outputs={"choice": choices})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["text"] in choices and c["finish_reason"] == "stop", c
        seen.add(c["text"])
    assert "😀" in seen


def test_abort_while_the_grammar_compiles_leaks_nothing(server):
    """Streams closed at once, and a client that gives up, while their (distinct, slow-ish)
    grammars compile: nothing stays running or waiting, no KV block stays used, and the
    server still answers a constrained request."""
    import time
    big = {"type": "object", "required": [f"p{i}" for i in range(60)], "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 30}}}x(ab|cd)*$"}
        for i in range(60)}}
    body = {"prompt": "x" * 40, "max_tokens": 100}
    for k in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                **body, "stream": True, "structured_outputs": {"json": {**big, "title": f"t{k}"}}}):
            pass
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.05,
                   json={**body, "structured_outputs": {"json": {**big, "title": "late"}}})
    metrics = ""
    for _ in range(100):
        metrics = httpx.get(server.url + "/metrics").text
        if all(f'rankserve:{m}{{engine="0",model_name="q"}} 0.0' in metrics for m in (
                "num_requests_running", "num_requests_waiting", "kv_cache_blocks_used")):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(metrics)
    r = completion(server, structured_outputs={"choice": ["done"]})
    assert r.json()["choices"][0]["text"] == "done"


def test_api_death_stops_engine(server):
    """Last user of the shared qwen3 server (test_server_chat, test_structured_api, this module;
    conftest starts a new one for any module after this): the API process killed, the engine
    process exits with 1 and says why."""
    import os
    import signal
    (api,) = server.children()
    os.kill(api, signal.SIGKILL)
    server.proc.wait(30)
    assert server.proc.returncode == 1
    assert any("API process exited" in line for line in server.lines)
