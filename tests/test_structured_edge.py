"""Structured outputs and tool calling driven as a reviewer would (issue #13's edge cases),
against a live server on a tiny RANDOM-weight Qwen3 with the real Qwen3 tokenizer, through the
`openai` / `anthropic` clients and plain HTTP: every output must satisfy its constraint, and
every constraint the server cannot enforce must be a 400 naming it (never a silent loosening)."""
from __future__ import annotations

import json

import httpx
import pytest

from test_server import Server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Answer as JSON."}]


@pytest.fixture(scope="module")
def server(qwen3_chat_dir):
    s = Server(str(qwen3_chat_dir), "--served-model-name", "q", "--max-model-len", "1024",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice")
    yield s
    s.stop()


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
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}, "'z'"),
    # deep inside: a property of an array item of a $defs entry
    ({"$defs": {"P": {"type": "object", "properties": {"t": {"type": "array", "items": {
        "type": "string", "not": {"const": "x"}}}}}}, "$ref": "#/$defs/P"}, "/$defs/P/properties"),
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
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "strict": True},
     "response_format.strict"),
    ({"type": "json_schema", "schema": {"type": "integer"}}, "response_format.schema"),
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


@pytest.mark.parametrize("words", [[""], ["  "], ["ok", ""]])
def test_empty_bad_words_are_400(server, words):
    bad_request(completion(server, bad_words=words), "bad_words")
