"""Live server on a tiny random Qwen3 checkpoint with the real Qwen3 tokenizer and chat template:
chat completions, render/derender, the Anthropic Messages and the Responses APIs through the
official clients. Random weights cannot be made to call a tool, so the parser path is checked
through /derender with real token ids (and in test_server_unit.py)."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import transformers


SHARED = Path(__file__).resolve().parents[1].parent / "shared"
QWEN3_TOK = SHARED / "tokenizers" / "qwen3"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model_dir(qwen3_chat_dir) -> Path:
    return qwen3_chat_dir


@pytest.fixture(scope="module")
def server(structured_qwen3_server):
    """The qwen3 reasoning parser and hermes tool calls on the chat template, model name "q":
    one server with test_structured_api and test_structured_edge (conftest); the API process's
    death, which ends it, is checked at the end of test_structured_edge."""
    return structured_qwen3_server


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "q", "messages": MESSAGES,
                                             "max_tokens": 12, "temperature": 0, **kw})


# ---- OpenAI chat ------------------------------------------------------------------------------
def test_chat_stream_equals_non_stream(client, tok):
    full = chat(client)
    c = full.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    assert full.usage.prompt_tokens == len(prompt) and full.usage.completion_tokens == 12
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning") or ""
                        for ch in chunks if ch.choices)
    assert content == (c.message.content or "")
    assert reasoning == ((c.message.model_extra or {}).get("reasoning") or "")
    assert content or reasoning
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_n_seed_logprobs(client):
    kw = dict(n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
    a, b = chat(client, **kw), chat(client, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 24
    for c in a.choices:
        lps = c.logprobs.content
        assert len(lps) == 12
        assert all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in lps)
        assert all(x.bytes == list(x.token.encode()) for x in lps)


def test_chat_stop_and_max_completion_tokens(client):
    text = chat(client, max_tokens=20).choices[0].message.content
    assert text and len(text) > 8
    stop = text[len(text) // 2:len(text) // 2 + 3]
    c = chat(client, max_tokens=20, stop=[stop]).choices[0]
    assert c.finish_reason == "stop" and stop not in (c.message.content or "")
    assert text.startswith(c.message.content or "")
    assert chat(client, max_tokens=None, max_completion_tokens=3).usage.completion_tokens == 3


def test_special_tokens_other_than_the_parsers_markers_are_skipped(client):
    """With a tool or reasoning parser the output was detokenized with every special token
    kept (the parser needs its markers), whatever skip_special_tokens (default true) said: a
    sampled <|im_start|> (no marker of hermes / qwen3) ended up in the content, where vLLM
    skips it. Now only the parser's markers stay; skip_special_tokens=false keeps them all."""
    kw = dict(max_tokens=3, logit_bias={"151644": 100})  # <|im_start|>
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    c = chat(client, **kw, extra_body=off).choices[0]
    assert c.message.content == "" and c.finish_reason == "length", c
    streamed = chat(client, **kw, extra_body=off, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == ""
    kept = chat(client, **kw, extra_body={**off, "skip_special_tokens": False}).choices[0]
    assert kept.message.content == "<|im_start|>" * 3


def test_tools_and_tool_choice(client):
    r = chat(client, tools=TOOLS, tool_choice="auto")  # parsed; random weights call nothing
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # required / named: constrained output (tests/test_structured_api.py)


def test_render_equals_chat_template(server, tok):
    r = httpx.post(server.url + "/v1/chat/completions/render",
                   json={"messages": MESSAGES, "tools": TOOLS}).json()
    want = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert r["prompt_token_ids"] == list(want)
    assert "get_weather" in r["prompt"]


def test_derender_parses_reasoning_and_tool_calls(server, tok):
    answer = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    ids = tok.encode(answer)
    assert 151657 in ids and 151667 in ids  # <tool_call> and <think> are single tokens
    r = httpx.post(server.url + "/v1/chat/completions/derender", json={"token_ids": ids}).json()
    msg = r["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "The user wants weather."
    assert msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert r["finish_reason"] == "tool_calls"
    # a prompt that opened <think> makes the output start inside the reasoning
    prompt = tok.encode("<|im_start|>assistant\n<think>\n")
    r = httpx.post(server.url + "/v1/chat/completions/derender",
                   json={"token_ids": tok.encode("hmm</think>ok"), "prompt_token_ids": prompt})
    assert r.json()["message"]["reasoning"] == "hmm" and r.json()["message"]["content"] == "ok"


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "q"}, 400, "messages: Field required"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "unknown role"),
    ({"messages": MESSAGES, "model": "llama"}, 404, "llama"),
    ({"messages": [{"role": "user", "content": "word " * 1100}]}, 400, "max_model_len"),
    ({"messages": MESSAGES, "n": 0}, 400, "n:"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
])
def test_bad_chat_requests(server, body, status, needle):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_tool_names_the_tools_param(server):
    for url, tools in (("/v1/chat/completions", [{"type": "custom", "custom": {"name": "x"}}]),
                       ("/v1/responses", [{"type": "function", "parameters": {}}])):
        body = {"messages": MESSAGES, "max_tokens": 2} if "chat" in url else {"input": "hi"}
        r = httpx.post(server.url + url, json={**body, "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_unknown_reasoning_settings_are_400(server):
    """As chat's reasoning_effort: an effort or thinking type the API does not have is refused,
    not read as 'thinking on'."""
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                          "reasoning": {"effort": "max"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
    r = httpx.post(server.url + "/v1/messages", json={
        "model": "q", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "on"}})
    assert r.status_code == 400 and "thinking.type" in r.json()["error"]["message"], r.text


def test_responses_tool_choice_errors_speak_responses(server):
    """Chat's {"type": "function", "function": {...}} sent to Responses: the 400 shows the
    Responses form (it showed chat's, with the name read as null)."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    r = httpx.post(server.url + "/v1/responses", json={
        "input": "hi", "max_output_tokens": 2, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice", r.text
    assert '{"type": "function", "name": ...}' in err["message"] and "null" not in err["message"]


# ---- Anthropic --------------------------------------------------------------------------------
def test_anthropic_messages(claude):
    m = claude.messages.create(model="q", max_tokens=8, system="You are terse.",
                               messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"temperature": 0})
    assert m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 5
    assert m.content and m.content[0].type in ("text", "thinking")


def test_anthropic_stream_events_in_order(claude):
    with claude.messages.stream(model="q", max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "adaptive"}) as s:
        events = [e.type for e in s if e.type in (
            "message_start", "content_block_start", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop")]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    body = events[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert body.count("content_block_start") == body.count("content_block_stop") == \
        len(final.content)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    text = "".join(getattr(b, "text", "") or getattr(b, "thinking", "") for b in final.content)
    assert text


def test_anthropic_tool_history_and_count_tokens(claude, server):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "Thanks"}]}]
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    n = claude.messages.count_tokens(model="q", messages=history, tools=tools).input_tokens
    openai_msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"}]
    ids = httpx.post(server.url + "/tokenize", json={
        "messages": openai_msgs, "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert n == len(ids)
    m = claude.messages.create(model="q", max_tokens=4, messages=history, tools=tools,
                               tool_choice={"type": "auto"})
    # Anthropic counts cached prompt tokens apart (a server shared with other modules may hit)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n


def test_anthropic_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="q", max_tokens=0,
                               messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-9", max_tokens=5,
                               messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model="q", max_tokens=5, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])


# ---- Responses --------------------------------------------------------------------------------
def test_responses_non_stream(client):
    r = client.responses.create(model="q", input="Hi", instructions="Be terse.",
                                max_output_tokens=8, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 3
    assert r.output_text or any(item.type == "reasoning" for item in r.output)


def test_responses_stream(client):
    kw = dict(model="q", input="Hi", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == client.responses.create(**kw).output_text
    assert types.count("response.output_item.added") == types.count("response.output_item.done") \
        == len(final.output)


def test_responses_function_call_items(client):
    r = client.responses.create(model="q", max_output_tokens=4, tools=[{
        "type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOLS[0]["function"]["parameters"]}], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert r.usage.input_tokens > 20
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="q", input="Hi", previous_response_id="resp_1")


def test_stored_response_routes_say_nothing_is_stored(client):
    """retrieve / delete / cancel / input_items of a response id were a bare 404 "Not Found",
    as for a route the server lacks: now a 404 naming the id and why (no response is stored)."""
    for call in (lambda: client.responses.retrieve("resp_1"),
                 lambda: client.responses.delete("resp_1"),
                 lambda: client.responses.cancel("resp_1"),
                 lambda: client.responses.input_items.list("resp_1")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "resp_1" in e.value.message and "not stored" in e.value.message, e.value.message


def test_anthropic_consecutive_turns_of_a_role_are_one_turn(claude, server):
    """Anthropic: "Consecutive user or assistant turns in your request will be combined into a
    single turn." They were rendered as separate turns (a different prompt)."""
    def tokens(msgs):
        return httpx.post(server.url + "/tokenize", json={
            "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    cases = [([{"role": "user", "content": "a"}, {"role": "user", "content": [
                {"type": "text", "text": "b"}]}],
              [{"role": "user", "content": "a\nb"}]),
             ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
               {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
               {"role": "user", "content": "z"}],
              [{"role": "user", "content": "q"}, {"role": "assistant", "content": "xy"},
               {"role": "user", "content": "z"}]),
             # results split over two user messages answer the calls of the turn before
             ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
               {"role": "assistant", "content": [
                   {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}],
              [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
                  {"id": t, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                  for t in ("t1", "t2")]},
               {"role": "tool", "tool_call_id": "t1", "content": ""},
               {"role": "tool", "tool_call_id": "t2", "content": ""}])]
    for given, combined in cases:
        n = claude.messages.count_tokens(model="q", messages=given).input_tokens
        assert n == len(tokens(combined))


def test_responses_text_parts_join_as_chat_parts(client, server):
    """A message's text parts are joined with a newline, as chat's (vLLM's) are: Responses glued
    them ("Weather inParis?"), so one conversation made two prompts on the two APIs."""
    parts = ["Weather in", "Paris?"]
    n = client.responses.input_tokens.count(model="q", reasoning={"effort": "none"}, input=[
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in parts]}]).input_tokens
    ids = httpx.post(server.url + "/tokenize", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in parts]}],
        "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert n == len(ids)
