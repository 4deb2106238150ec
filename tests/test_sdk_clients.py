"""The official clients' own helpers against a live server (the tiny random Qwen3 of
test_structured_api, one server shared with it): the openai `chat.completions.stream(...)` /
`responses.stream(...)` event helpers and the anthropic client's models API, which read event
order and shapes the way users' code does."""
from __future__ import annotations

from typing import Literal

import anthropic
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


class GetWeather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def server(structured_qwen3_server):
    return structured_qwen3_server


def test_chat_stream_helper_closes_a_forced_tool_call(client):
    """The stream helper fires `tool_calls.function.arguments.done` (with the parsed arguments)
    when the next chunk starts another call or carries the finish_reason: a call sent whole in
    the chunk that also finished the choice (a named / required tool_choice) never got it."""
    for choice in ({"type": "function", "function": {"name": "GetWeather"}}, "required"):
        with client.chat.completions.stream(
                model="q", messages=MESSAGES, max_tokens=200, temperature=0,
                tools=[openai.pydantic_function_tool(GetWeather)], tool_choice=choice,
                parallel_tool_calls=False, extra_body=NO_THINK) as s:
            done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
            final = s.get_final_completion().choices[0]
        assert final.finish_reason in ("stop", "tool_calls"), final
        (call,) = final.message.tool_calls
        assert [(e.index, e.name, e.parsed_arguments) for e in done] == \
            [(0, "GetWeather", call.function.parsed_arguments)], choice
        assert isinstance(call.function.parsed_arguments, GetWeather)


def test_anthropic_models_list_and_retrieve(claude, server):
    """The anthropic client's models API (it sends `anthropic-version`) gets Anthropic's shape:
    `type`, `display_name`, `created_at` were missing (None in the client's ModelInfo, whose
    fields they are) and the page had no `has_more`; a wrong id is Anthropic's 404 error."""
    page = claude.models.list()
    (m,) = page.data
    assert (m.type, m.id, m.display_name) == ("model", "q", "q")
    assert m.created_at.year >= 1970 and m.max_input_tokens == 1024
    assert page.has_more is False and page.first_id == page.last_id == "q"
    assert [x.id for x in claude.models.list()] == ["q"]  # auto-pagination ends
    got = claude.models.retrieve("q")
    assert (got.type, got.id, got.display_name, got.created_at) == \
        ("model", "q", "q", m.created_at)
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.models.retrieve("claude-9")
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-9" in e.value.body["error"]["message"]
    assert openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data[0] \
        .object == "model"  # the OpenAI shape without the header


def test_web_search_options_is_refused(client):
    """`web_search_options={}` turns web search on (OpenAI's documented call), so it is no no-op
    to drop: a 400 naming it, as for any value but null."""
    for value in ({}, {"search_context_size": "low"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=2,
                                           web_search_options=value)
        assert e.value.param == "web_search_options" and "web_search_options" in e.value.message
    r = client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=2,
                                       extra_body={"web_search_options": None})
    assert r.usage.completion_tokens == 2


def test_harmless_hints_pass_and_responses_echo_them(client):
    """`prompt_cache_key` and `safety_identifier` (caching / abuse hints that change no token)
    pass on chat as on Responses (chat said 'Extra inputs are not permitted'); a Response
    echoes them and `user`, as OpenAI's does (they came back None)."""
    hints = {"prompt_cache_key": "k1", "safety_identifier": "s1"}
    r = client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=2, **hints)
    assert r.usage.completion_tokens == 2
    r = client.responses.create(model="q", input="Hi", max_output_tokens=2, user="u1", **hints)
    assert (r.prompt_cache_key, r.safety_identifier, r.user) == ("k1", "s1", "u1")


def test_stream_options_continuous_usage_and_obfuscation(client):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far (its
    choice's tokens); `include_obfuscation: false` (the openai client's option) changes nothing
    here, `true` asks for padding the server does not add: a 400 naming it. Both were 400s."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=6, n=2,
                                                 stream=True, stream_options=opts))
    *body, last = chunks
    assert not last.choices and last.usage.completion_tokens == 12
    seen = {0: 0, 1: 0}
    for c in body:
        u = c.usage
        assert u.prompt_tokens == last.usage.prompt_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= seen[c.choices[0].index]
        seen[c.choices[0].index] = u.completion_tokens
    assert seen == {0: 6, 1: 6}
    chunks = list(client.completions.create(model="q", prompt=["Hi", "Hello there"], max_tokens=3,
                                            stream=True, stream_options=opts))
    assert sorted(c.usage.completion_tokens for c in chunks if c.choices)[-2:] == [3, 3]
    assert chunks[-1].usage.completion_tokens == 6
    r = client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=2, stream=True,
                                       stream_options={"include_obfuscation": False})
    assert sum(1 for c in r if c.choices and c.choices[0].finish_reason) == 1
    r = client.responses.create(model="q", input="Hi", max_output_tokens=2, stream=True,
                                stream_options={"include_obfuscation": False})
    assert [e.type for e in r][-1] == "response.incomplete"
    for call in (lambda **kw: client.chat.completions.create(model="q", messages=MESSAGES, **kw),
                 lambda **kw: client.responses.create(model="q", input="Hi", **kw)):
        with pytest.raises(openai.BadRequestError) as e:
            call(stream=True, stream_options={"include_obfuscation": True})
        assert "include_obfuscation" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="q", messages=MESSAGES, stream=True,
                                       stream_options={"continuous_usage_stats": True})
    assert "include_usage" in e.value.message


@pytest.fixture(scope="module")
def think_client(qwen3_chat_dir, tmp_path_factory):
    """The Qwen3 template with a generation prompt that opens the reasoning (as DeepSeek-R1's
    does), so the random model's output is reasoning: a server of its own."""
    from test_server import Server
    template = (qwen3_chat_dir / "chat_template.jinja").read_text()
    head, sep, tail = template.rpartition("{{- '<|im_start|>assistant\\n' }}")
    assert sep, "the Qwen3 template's generation prompt moved"
    path = tmp_path_factory.mktemp("think") / "template.jinja"
    path.write_text(head + "{{- '<|im_start|>assistant\\n<think>\\n' }}" + tail)
    s = Server(str(qwen3_chat_dir), "--served-model-name", "q", "--max-model-len", "1024",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice", "--chat-template", str(path))
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    assert s.stop() == 0


def test_responses_stateless_reasoning_round_trip(think_client):
    """`store=False, include=["reasoning.encrypted_content"]` (how stateless agents keep their
    reasoning across turns) was a 400: the reasoning item now carries an opaque
    `encrypted_content`, streamed and not, and an item sent back with only that is read as the
    reasoning it holds; one this server did not make is a 400, as is another include value."""
    client = think_client
    kw = dict(model="q", input="Weather?", max_output_tokens=4, store=False,
              include=["reasoning.encrypted_content"])
    (item,) = client.responses.create(**kw).output
    text = item.content[0].text
    assert item.type == "reasoning" and text and item.encrypted_content
    with client.responses.stream(**kw) as s:
        done = [e.item for e in s if e.type == "response.output_item.done"]
    assert done[0].encrypted_content and done[0].content[0].text
    ask = [{"role": "user", "content": "Weather?"}]
    replay = {"type": "reasoning", "id": item.id, "summary": [],
              "encrypted_content": item.encrypted_content}
    # a tool loop: the template keeps this turn's reasoning (an earlier turn's it drops)
    loop = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}]
    plain = dict(replay, encrypted_content=None, content=[{"type": "reasoning_text", "text": text}])
    follow = [*ask, replay, *loop]
    tokens = [client.responses.create(model="q", input=i, tools=tools, max_output_tokens=1)
              .usage.input_tokens for i in (follow, [*ask, plain, *loop], [*ask, *loop])]
    assert tokens[0] == tokens[1] > tokens[2]  # the same prompt as the plain reasoning's
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="q", max_output_tokens=1, input=[
            *ask, dict(replay, encrypted_content="gAAAAABo-not-ours"), *follow[2:]])
    assert "encrypted_content" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="q", input="Hi", include=["file_search_call.results"])
    assert "file_search_call.results" in e.value.message


def test_forced_tool_call_content_is_null_streamed_too(client):
    """A forced call's message has `content: null`; streamed, the role chunk's `content: ""`
    made the stream helper's final message say '' (the non-streamed one: None), as OpenAI's
    tool-call streams start with a null content."""
    kw = dict(model="q", messages=MESSAGES, max_tokens=200, temperature=0, extra_body=NO_THINK,
              tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
              parallel_tool_calls=False)
    assert client.chat.completions.create(**kw).choices[0].message.content is None
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion().choices[0].message
    assert final.content is None and final.tool_calls


def test_anthropic_empty_user_turn_is_refused(claude):
    """A user turn with no blocks was dropped, so the assistant turn before it became a prefill
    the model continued: a 400 naming the message, as Anthropic's."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
               {"role": "user", "content": []}]
    for call in (lambda: claude.messages.count_tokens(model="q", messages=history),
                 lambda: claude.messages.create(model="q", messages=history, max_tokens=2)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        assert "messages[2]" in e.value.message


def test_responses_input_tokens_count(client):
    """openai's `responses.input_tokens.count` (POST /v1/responses/input_tokens) was a 404: the
    prompt's tokens, as the response's usage.input_tokens counts them."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}]
    kw = dict(model="q", input=[{"role": "user", "content": "Weather?"}], instructions="Be terse.",
              tools=tools, reasoning={"effort": "none"})
    n = client.responses.input_tokens.count(**kw)
    assert n.object == "response.input_tokens"
    assert n.input_tokens == client.responses.create(**kw, max_output_tokens=1).usage.input_tokens
    assert client.responses.input_tokens.count(model="q", input="Hi").input_tokens < n.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model="q", input="Hi", previous_response_id="resp_1")
    assert "previous_response_id" in e.value.message


def test_anthropic_structured_output_parse(claude):
    """anthropic's `messages.parse(output_format=Model)` sends `output_config.format`
    (Anthropic's structured outputs): it was a 400 ('Extra inputs'); the text now follows the
    schema, streamed too. Beside a forced tool_choice, or with an effort, it is a 400."""
    kw = dict(model="q", max_tokens=300, messages=MESSAGES)
    m = claude.messages.parse(**kw, output_format=GetWeather)
    assert m.stop_reason == "end_turn" and isinstance(m.parsed_output, GetWeather)
    fmt = {"format": {"type": "json_schema", "schema": GetWeather.model_json_schema()}}
    with claude.messages.stream(**kw, output_config=fmt) as s:
        assert GetWeather.model_validate_json(s.get_final_text())
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    for bad, needle in (({"tools": tools, "tool_choice": {"type": "any"}}, "tool_choice"),
                        ({"output_config": {**fmt, "effort": "low"}}, "effort"),
                        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format")):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(**{"output_config": fmt, **kw, **bad})
        assert needle in e.value.message
