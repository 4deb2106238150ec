"""Structured outputs through every API, against a live server on a tiny RANDOM-weight Qwen3
checkpoint with the real Qwen3 tokenizer: at temperature 1.0 and many seeds the unconstrained
output is noise, so every valid output below is the constraint's doing. Through the official
`openai` and `anthropic` clients (chat.completions.parse with a pydantic model, tool_choice
required / named, Anthropic any / tool, Responses text.format), plus vLLM's structured_outputs
and guided_* on completions, token masks, and the 400s for bad constraints."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from test_server import Server

pytestmark = pytest.mark.slow

SEEDS = range(6)
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "Time",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"enum": ["UTC", "CET"]}},
                                               "required": ["tz"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days, as JSON."}]
# no free strings: a token such as </think> can never be part of the answer
CLOSED = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
THINK_END = 151668  # </think>


def valid(text: str | None, schema: dict) -> None:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (TypeError, ValueError, jsonschema.ValidationError) as e:
        raise AssertionError(f"{e}: {text!r}") from None


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=9)


def structured_server(qwen3_chat_dir) -> Server:
    """The real Qwen3 chat template and tokenizer, served with the qwen3 reasoning parser and
    hermes tool calls (model name "q")."""
    return Server(str(qwen3_chat_dir), "--served-model-name", "q", "--max-model-len", "1024",
                  "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                  "--enable-auto-tool-choice")


@pytest.fixture(scope="module")
def server(structured_qwen3_server):  # one server for this module and its sibling (conftest)
    return structured_qwen3_server


def each(fn, seeds=SEEDS) -> list:
    """fn(seed) for every seed, at once: the server batches the requests (far faster than one
    after another); each request's checks are fn's own, and the first failure is raised."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(fn, seeds))


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "q", "messages": MESSAGES, "max_tokens": 300,
                                             "temperature": 1.0, "extra_body": NO_THINK, **kw})


def test_parse_with_a_pydantic_model(client):
    def one(seed):
        r = client.chat.completions.parse(model="q", messages=MESSAGES, response_format=Forecast,
                                          max_tokens=120, temperature=1.0, seed=seed,
                                          extra_body=NO_THINK)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, Forecast)
    each(one)


def test_json_schema_json_object_and_streaming(client):
    def one(seed):
        r = chat(client, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "f", "schema": SCHEMA}})
        valid(r.choices[0].message.content, SCHEMA)
        # a free-form object may run to max_tokens (random weights): then it is cut, else whole
        r = chat(client, seed=seed, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.lstrip().startswith("{"), text
    each(one)
    text = "".join(c.choices[0].delta.content or "" for c in chat(
        client, seed=1, stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "f", "schema": SCHEMA}}) if c.choices)
    valid(text, SCHEMA)


def test_constraint_starts_after_the_reasoning(client):
    """The prompt opens the reasoning block (a template whose generation prompt ends in <think>):
    the reasoning is free text, the answer after </think> follows the schema. A logit bias makes
    the random model close its reasoning at once; the grammar keeps </think> out of the answer."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}<|im_start|>assistant\n<think>\n")
    r = client.chat.completions.create(
        model="q", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=3,
        extra_body={"chat_template": template},
        logit_bias={str(THINK_END): 100}, response_format={"type": "json_schema", "json_schema": {
            "name": "f", "schema": CLOSED}})
    valid(r.choices[0].message.content, CLOSED)


def test_constraint_holds_when_the_model_does_not_think(client):
    """Thinking on (the real template's default), but the model answers without opening a
    reasoning block (<think> banned here): the output is the answer, so the schema holds from
    its first token (it waited for a </think> that never came: free text came back)."""
    def one(seed):
        r = client.chat.completions.create(
            model="q", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=seed,
            logit_bias={str(THINK_END - 1): -100}, response_format={  # <think>
                "type": "json_schema", "json_schema": {"name": "f", "schema": CLOSED}})
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        valid(r.choices[0].message.content, CLOSED)
    each(one)


def test_a_tool_loop_may_think_again_before_the_constrained_answer(client):
    """An earlier turn's reasoning stays in the prompt of a tool loop (<think>…</think> before its
    call): that block is closed, but the new turn may open its own. It was read as 'thinking
    disabled': the constraint held from the first token and <think> was masked out."""
    history = MESSAGES + [
        {"role": "assistant", "content": "", "reasoning_content": "I should call it.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(
        model="q", messages=history, tools=TOOLS, max_tokens=4, temperature=1.0, seed=0,
        logit_bias={str(THINK_END - 1): 100}, response_format={  # <think>
            "type": "json_schema", "json_schema": {"name": "f", "schema": CLOSED}})
    assert getattr(r.choices[0].message, "reasoning_content", None), r.choices[0].message


def test_completions_structured_outputs_and_guided_aliases(server):
    url = server.url + "/v1/completions"
    base = {"prompt": "Answer:", "max_tokens": 300, "temperature": 1.0}

    def one(seed):
        for body, check in (
                ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                 lambda t: t in ("yes", "no", "maybe")),
                ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                ({"structured_outputs": {"regex": r"[a-c]{2}-\d{3}"}},
                 lambda t: re.fullmatch(r"[a-c]{2}-\d{3}", t)),
                ({"guided_regex": r"(ab|cd){1,4}x"}, lambda t: re.fullmatch(r"(ab|cd){1,4}x", t)),
                ({"structured_outputs": {"json": SCHEMA}},
                 lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
                ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
                ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")+ "."'}},
                 lambda t: re.fullmatch(r"x[yz]+\.", t)),
                ({"structured_outputs": {"json": CLOSED}}, lambda t: valid(t, CLOSED) or True)):
            r = httpx.post(url, json={**base, **body, "seed": seed}, timeout=60)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "stop" and check(c["text"]), (body, c)
    each(one)


def test_tool_choice_required_and_named(client):
    def one(seed):
        # any number of calls: random weights may write them until max_tokens (then none is
        # returned: an unfinished call is dropped); when the array closes, every call is valid
        r = chat(client, seed=seed, tools=TOOLS, tool_choice="required")
        calls = r.choices[0].message.tool_calls or []
        assert (r.choices[0].finish_reason, bool(calls)) in (("tool_calls", True), ("length", False))
        for c in calls:
            valid(c.function.arguments, SCHEMAS[c.function.name])
        r = chat(client, seed=seed, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        [c] = r.choices[0].message.tool_calls
        valid(c.function.arguments, SCHEMAS[c.function.name])
        r = chat(client, seed=seed, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
        [c] = r.choices[0].message.tool_calls
        assert c.function.name == "get_time"
        assert r.choices[0].finish_reason == "stop"  # OpenAI: a forced function ends with stop
        valid(c.function.arguments, SCHEMAS["get_time"])
    each(one)
    deltas = [c.choices[0].delta for c in chat(client, seed=2, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, stream=True) if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls and all(json.loads(tc.function.arguments) is not None for tc in calls)


def test_anthropic_tool_choice_any_and_tool(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": "x",
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for seed_choice in ({"type": "any", "disable_parallel_tool_use": True},
                        {"type": "tool", "name": "get_weather"},
                        {"type": "any", "disable_parallel_tool_use": True}):
        m = claude.messages.create(model="q", max_tokens=300, tools=tools, tool_choice=seed_choice,
                                   messages=MESSAGES, thinking={"type": "disabled"})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and m.stop_reason == "tool_use"
        for u in uses:
            jsonschema.validate(u.input, SCHEMAS[u.name])
        if seed_choice.get("name"):
            assert {u.name for u in uses} == {"get_weather"}
        if seed_choice.get("disable_parallel_tool_use"):
            assert len(uses) == 1


def test_responses_text_format_and_required_tools(client):
    r = client.responses.create(model="q", input="Weather?", max_output_tokens=300, temperature=1.0,
                                reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "f", "schema": SCHEMA}})
    valid(r.output_text, SCHEMA)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(model="q", input="Weather?", max_output_tokens=300, temperature=1.0,
                                reasoning={"effort": "none"}, tools=tools, tool_choice="required",
                                parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for c in calls:
        valid(c.arguments, SCHEMAS[c.name])


def test_responses_and_anthropic_strict_tools_are_strict(client, claude):
    """`strict: true` on a Responses function tool or an Anthropic tool was dropped on the way to
    the chat form, so a call under tool_choice auto was not held to its schema (chat's strict
    tools are): the schema now holds, and with an output format too that is the same 400."""
    fmt = {"type": "json_schema", "name": "f", "schema": SCHEMA}
    for strict in (True, False):
        tools = [{"type": "function", **t["function"], "strict": strict} for t in TOOLS]
        kw = dict(model="q", input="Weather?", max_output_tokens=2, tools=tools, text={"format": fmt})
        if strict:
            with pytest.raises(openai.BadRequestError, match="strict tools"):
                client.responses.create(**kw)
        else:
            assert client.responses.create(**kw).usage.output_tokens <= 2
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                  "strict": strict} for t in TOOLS]
        kw = dict(model="q", max_tokens=2, messages=MESSAGES, tools=tools,
                  output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
        if strict:
            with pytest.raises(anthropic.BadRequestError, match="strict tools"):
                claude.messages.create(**kw)
        else:
            assert claude.messages.create(**kw).usage.output_tokens <= 2


def test_token_masks(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "a", "max_tokens": 8, "temperature": 1.0,
                              "allowed_token_ids": [1000, 2000], "ignore_eos": True}).json()
    assert set(r["choices"][0]["text"]) <= set("".join(httpx.post(server.url + "/detokenize", json={
        "tokens": [1000, 2000]}).json()["prompt"]))
    r = httpx.post(url, json={"prompt": "a", "max_tokens": 4, "temperature": 1.0,
                              "logit_bias": {"1000": 100}, "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] == [1000] * 4


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, None),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, None),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, None),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": True}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_constraints_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err


def test_forced_tool_choice_refusals(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="constrain the output already"):
        chat(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})


def test_include_stop_str_in_output_leaves_the_eos_out(client):
    """include_stop_str_in_output keeps stop strings; the EOS that ends a chat answer is still no
    text (its '<|im_end|>' was in the content, and made a forced call unreadable: calls lost)."""
    inc = {**NO_THINK, "include_stop_str_in_output": True}
    r = chat(client, extra_body={**inc, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chat(
        client, stream=True, extra_body={**inc, "structured_outputs": {"choice": ["yes", "no"]}}))
    assert text in ("yes", "no")

    def one(seed):
        c = chat(client, seed=seed, tools=TOOLS, extra_body=inc, tool_choice={
            "type": "function", "function": {"name": "get_time"}}).choices[0]
        assert c.finish_reason == "stop" and len(c.message.tool_calls or []) == 1, c
        valid(c.message.tool_calls[0].function.arguments, SCHEMAS["get_time"])
    each(one, range(3))


def test_strict_tools_under_auto(client):
    """Free text, but a call, once the model begins one, follows its function's schema (a bias
    makes the random model open calls; the last one may be cut by max_tokens and is dropped)."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]

    def one(seed):
        r = chat(client, seed=seed, tools=strict, tool_choice="auto",
                 logit_bias={"151657": 30})  # <tool_call>
        for c in r.choices[0].message.tool_calls or []:
            valid(c.function.arguments, SCHEMAS[c.function.name])
        return len(r.choices[0].message.tool_calls or [])
    seen = sum(each(one))
    assert seen
