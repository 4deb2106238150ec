"""The official clients' own helpers against a live server (the tiny random Qwen3 of
test_structured_api, one server shared with it): the openai `chat.completions.stream(...)` /
`responses.stream(...)` event helpers and the anthropic client's models API, which read event
order and shapes the way users' code does."""
from __future__ import annotations

from typing import Literal

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
