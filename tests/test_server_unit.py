"""The API side without processes: the engine client fed with EngineCoreOutputs by hand, and the
OpenAI / Anthropic / Responses stream builders over the real Qwen3 tokenizer and parser."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import zmq
import pytest
import transformers
from fastapi.exceptions import RequestValidationError

from rankserve.runtime.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                        EngineCoreRequestType, FinishReason, LogprobsEntry)
from rankserve.runtime.parse import ContentDelta, ReasoningDelta, ToolCallDelta
from rankserve.runtime.sampling_params import SamplingParams
from rankserve.runtime.serve import anthropic_api, responses_api
from rankserve.runtime.serve.app import validation_message
from rankserve.runtime.serve.args import ServerArgs
from rankserve.runtime.serve.client import EngineClient, EngineDeadError
from rankserve.runtime.serve.context import ChatRun, ServeContext, ToolMode
from rankserve.runtime.serve.engine_proc import engine_addresses
from rankserve.runtime.serve.metrics import Metrics
from rankserve.runtime.serve.openai_api import chat_events
from rankserve.runtime.serve.protocol import APIError, ChatCompletionRequest, validation_param

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
EOS = 151645
ANSWER = ('<think>\nWeather needs a tool.\n</think>\n\nChecking.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")


def make_client(tok) -> EngineClient:
    client = EngineClient("ipc://unused", tok, [EOS], Metrics("m"))
    client.sent = []
    client._send = lambda kind, payload, engine=0: client.sent.append((kind, payload))
    return client


def make_ctx(tok, **args) -> ServeContext:
    args = ServerArgs(**{"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                         "enable_auto_tool_choice": True, **args})
    return ServeContext(args, "m", "/m", tok, make_client(tok))


def chat_req(include_usage: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                 stream_options={"include_usage": include_usage})


def feed(client, request_id: str, token_ids: list[int], finish=FinishReason.STOP, stop=None):
    """The engine's outputs for these tokens, one token per step."""
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id, [t], finish_reason=finish if last else None,
            stop_reason=stop if last else None)]))


def sse_events(chunks: list[bytes]) -> list[tuple[str | None, object]]:
    out = []
    for chunk in chunks:
        event = None
        for line in chunk.decode().splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


async def collect(gen) -> list[bytes]:
    return [c async for c in gen]


# ---- engine client ----------------------------------------------------------------------------
def test_chat_stream_with_tool_call_and_reasoning(tok):
    async def main():
        ctx = make_ctx(tok)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Paris?"}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        run = ChatRun(ctx, prompt, 1, ToolMode(parse=True))
        params = SamplingParams(max_tokens=100, skip_special_tokens=False)
        stream = ctx.client.generate(prompt, params, request_id="r1")
        feed(ctx.client, "r1", tok.encode(ANSWER) + [EOS])
        return await collect(chat_events(ctx, run, stream, "chatcmpl-1", 0, None, chat_req(True)))
    events = [d for _, d in sse_events(asyncio.run(main()))]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == \
        len(tok.encode(ANSWER)) + 1
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Checking." and reasoning == "Weather needs a tool."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all(c["index"] == 0 for c in calls) and all("id" not in c for c in calls[1:])
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"
    assert "<|im_end|>" not in content + args



def test_one_update_with_a_plain_marker_and_the_call_ending_in_eos(tok):
    """An update of many tokens (the consumer was behind, or non-streamed) that ends with the
    EOS: the parser still finds the marker token, not the model's plain spelling before it."""
    plain = [t for part in ("Use the <", "tool_call", "> tag.\n") for t in tok.encode(part)]
    call = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      '</tool_call>')

    async def main():
        ctx = make_ctx(tok, reasoning_parser=None)
        run = ChatRun(ctx, [1, 2], 1, ToolMode(parse=True))
        stream = ctx.client.generate([1, 2], SamplingParams(max_tokens=100, skip_special_tokens=False),
                                     request_id="r")
        ctx.client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput(
            "r", plain + call + [EOS], finish_reason=FinishReason.STOP)]))
        async for upd in stream:
            run.update(upd)
        return run
    run = asyncio.run(main())
    msg = run.result(0)
    assert msg.content == "Use the <tool_call> tag." and run.finish_reason(0) == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"})]

def test_stop_string_aborts_in_the_engine(tok):
    async def main():
        client = make_client(tok)
        stream = client.generate([1, 2], SamplingParams(stop=["Paris"], max_tokens=50),
                                 request_id="r")
        feed(client, "r", tok.encode("It is sunny in Paris today"), finish=None)
        ups = [u async for u in stream]
        return client, ups
    client, ups = asyncio.run(main())
    assert "".join(u.text for u in ups) == "It is sunny in "
    assert (ups[-1].finish_reason, ups[-1].stop_reason) == ("stop", "Paris")
    aborts = [msgspec.msgpack.decode(p) for k, p in client.sent if k == EngineCoreRequestType.ABORT]
    assert aborts == [["r"]]


def test_n_choices_get_distinct_seeds_and_close_aborts(tok):
    async def main():
        client = make_client(tok)
        stream = client.generate([1, 2], SamplingParams(n=2, seed=3, max_tokens=5),
                                 request_id="r")
        feed(client, "0_r", [10, 11], finish=FinishReason.LENGTH)
        ups = [await stream.__anext__()]  # both steps in one update: nobody read in between
        stream.close()  # choice 1 never finished: the client went away
        return client, ups
    client, ups = asyncio.run(main())
    adds = [msgspec.msgpack.decode(p, type=EngineCoreRequest) for k, p in client.sent
            if k == EngineCoreRequestType.ADD]
    assert [(r.request_id, r.sampling_params.seed) for r in adds] == [("0_r", 3), ("1_r", 4)]
    assert adds[0].eos_token_id == EOS
    assert [(u.index, u.token_ids) for u in ups] == [(0, [10, 11])]
    assert ups[-1].finish_reason == "length"
    aborts = [msgspec.msgpack.decode(p) for k, p in client.sent if k == EngineCoreRequestType.ABORT]
    assert aborts == [["1_r"]]
    assert not client.children and not client.streams and not client.processor.states
    text = client.metrics.exposition().decode()
    assert 'finished_reason="abort"' in text and 'finished_reason="length"' in text


def test_updates_merge_while_the_consumer_is_behind(tok):
    """Steps that arrive before the handler reads become one update (one SSE chunk) with every
    token in order; a finished update, another choice or an error is never merged into."""
    async def main():
        client = make_client(tok)
        ids = tok.encode("It is sunny in Paris today, and tomorrow too")
        stream = client.generate([1, 2], SamplingParams(max_tokens=50, logprobs=0, n=2),
                                 request_id="r")
        for i, t in enumerate(ids[:3]):  # three steps, choice 0 only
            client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput(
                "0_r", [t], new_logprobs=[LogprobsEntry([t], [-float(i)], [1])])]))
        client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput("1_r", [ids[0]])]))
        first = await stream.__anext__()
        second = await stream.__anext__()
        # the handler keeps up: one update per step
        client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput("0_r", [ids[3]])]))
        third = await stream.__anext__()
        for t in ids[4:]:
            client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput(
                "0_r", [t], finish_reason=FinishReason.LENGTH if t == ids[-1] else None)]))
        client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput("0_r", [7])]))  # after the end
        last = await stream.__anext__()
        stream.close()
        return ids, first, second, third, last
    ids, first, second, third, last = asyncio.run(main())
    assert (first.index, first.token_ids, first.text) == (0, ids[:3], tok.decode(ids[:3]))
    assert [e.logprobs[0] for e in first.logprobs] == [0.0, -1.0, -2.0]
    assert (second.index, second.token_ids) == (1, ids[:1])
    assert third.token_ids == ids[3:4]
    assert last.token_ids == ids[4:] and last.finish_reason == "length"
    assert first.text + third.text + last.text == tok.decode(ids)


def test_engine_refusal_and_engine_death(tok):
    async def main():
        ctx = make_ctx(tok)
        client = ctx.client
        stream = client.generate([1] * 9, SamplingParams(), request_id="bad")
        client._handle(EngineCoreOutputs(outputs=[EngineCoreOutput(
            "bad", [], finish_reason=FinishReason.ERROR, error="the prompt is too long")]))
        with pytest.raises(APIError) as e:
            await ctx.respond([stream], False, None, None)
        assert e.value.status == 400 and "too long" in e.value.message
        assert not client.streams and not client.processor.states  # nothing left behind
        live = client.generate([1, 2], SamplingParams(), request_id="live")
        client._handle(EngineCoreOutputs(engine_dead="RuntimeError: boom"))
        with pytest.raises(EngineDeadError):
            await live.__anext__()
        with pytest.raises(EngineDeadError):
            client.generate([1, 2], SamplingParams())
    asyncio.run(main())


def test_tools_enabled_rules(tok):
    tools = [{"type": "function", "function": {"name": "f"}}]
    ctx = make_ctx(tok)
    assert ctx.tool_mode(tools, None).parse and ctx.tool_mode(tools, "auto").parse
    assert not ctx.tool_mode(tools, "none").parse and not ctx.tool_mode(None, "auto").parse
    assert ctx.tool_mode(tools, "auto", parallel=False).max_calls == 1
    required = ctx.tool_mode(tools, "required", parallel=False)
    assert required.forced == "required" and required.schema["maxItems"] == 1
    named = ctx.tool_mode(tools, {"type": "function", "function": {"name": "f"}})
    assert named.forced == "f" and named.structured().json == {"type": "object", "properties": {}}
    with pytest.raises(APIError, match="not among the tools"):
        ctx.tool_mode(tools, {"type": "function", "function": {"name": "g"}})
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        make_ctx(tok, enable_auto_tool_choice=False).tool_mode(tools, "auto")
    strict = [{"type": "function", "function": {"name": "f", "strict": True}}]
    tag = ctx.tool_mode(strict, "auto").tag  # hermes: a structural tag per function
    assert tag["triggers"] == ["<tool_call>"] and '"name": "f"' in tag["structures"][0]["begin"]
    with pytest.raises(APIError, match="hermes / qwen3 call format"):
        make_ctx(tok, tool_call_parser="llama3_json").tool_mode(strict, "auto")
    with pytest.raises(ValueError, match="unsupported parser"):
        make_ctx(tok, tool_call_parser="nonesuch")




def test_mistral_call_ids_also_for_forced_calls(tok):
    """--tool-call-parser mistral: call ids are Mistral's 9 alphanumerics (its chat templates
    refuse a history with others), for tool_choice required / named calls too."""
    import re
    ctx = make_ctx(tok, tool_call_parser="mistral", reasoning_parser=None)
    for mode, text in ((ToolMode(forced="f"), '{"a": 1}'),
                       (ToolMode(forced="required"), '[{"name": "f", "parameters": {"a": 1}}]'),
                       (ToolMode(parse=True), '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]')):
        p = ctx.new_parser([1], mode)
        p.feed([], text)
        p.finish()
        [call] = p.result().tool_calls
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id) and call.name == "f"
    p = make_ctx(tok).new_parser([1], ToolMode(forced="f"))  # others: OpenAI's call_ ids
    p.feed([], "{}")
    p.finish()
    assert p.result().tool_calls[0].id.startswith("call_")

def test_tool_choice_none_keeps_the_tools_in_the_prompt(tok):
    """vLLM's default: under tool_choice none the template still shows the tools (the model
    knows them, the prompt is the one an auto turn of the same conversation has), no call is
    parsed; --exclude-tools-when-tool-choice-none leaves them out."""
    from rankserve.runtime.serve import openai_api
    from rankserve.runtime.serve.protocol import MessagesRequest, ResponsesRequest
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Paris?"}]
    shown = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    bare = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    for exclude, want in ((False, shown), (True, bare)):
        ctx = make_ctx(tok, exclude_tools_when_tool_choice_none=exclude)
        ctx.client.model_info = {"vocab_size": len(tok), "max_model_len": 4096}
        ids, mode = openai_api.prepare_chat(ctx, ChatCompletionRequest(
            messages=msgs, tools=tools, tool_choice="none"))
        assert ids == want and not mode.parse
        ids = responses_api.render(ctx, ResponsesRequest(
            input="Paris?", tool_choice="none", tools=[{"type": "function", **tools[0]["function"]}]))
        assert ("get_weather" in tok.decode(ids)) != exclude
        ids, mode = anthropic_api._render(ctx, MessagesRequest(
            model="m", max_tokens=10, messages=msgs, tool_choice={"type": "none"},
            tools=[{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}]))
        assert ("get_weather" in tok.decode(ids)) != exclude and not mode.parse

# ---- Anthropic / Responses builders -----------------------------------------------------------
DELTAS = [ReasoningDelta("Think"), ReasoningDelta("ing."), ContentDelta("Hi"),
          ToolCallDelta(0, "call_a", "f", '{"x"'), ToolCallDelta(0, None, None, ": 1}"),
          ToolCallDelta(1, "call_b", "g", "{}")]


def test_anthropic_block_events():
    blocks = anthropic_api.BlockStream()
    events = sse_events(blocks.feed(DELTAS) + blocks.close())
    assert all(name == data["type"] for name, data in events)
    kinds = [(d["type"], d.get("index")) for _, d in events]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_delta", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1), ("content_block_start", 2),
                     ("content_block_delta", 2), ("content_block_delta", 2),
                     ("content_block_stop", 2), ("content_block_start", 3),
                     ("content_block_delta", 3), ("content_block_stop", 3)]
    d = [e for _, e in events]
    assert d[1]["delta"] == {"type": "thinking_delta", "thinking": "Think"}
    assert d[5]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert d[7]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}
    assert d[8]["delta"]["partial_json"] + d[9]["delta"]["partial_json"] == '{"x": 1}'
    assert anthropic_api.stop_reason("stop", None, True) == ("tool_use", None)
    assert anthropic_api.stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert anthropic_api.stop_reason("length", None, True) == ("max_tokens", None)


def test_responses_item_events():
    items = responses_api.ItemStream()
    events = [d for _, d in sse_events(items.feed(DELTAS) + items.close())]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types.count("response.output_item.added") == types.count(
        "response.output_item.done") == 4
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call",
                                                "function_call"]
    assert items.items[0]["content"][0]["text"] == "Thinking."
    assert items.items[1]["content"][0]["text"] == "Hi"
    assert items.items[2]["arguments"] == '{"x": 1}' and items.items[2]["call_id"] == "call_a"
    assert all(i["status"] == "completed" for i in items.items)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"x": 1}', "{}"]


def test_anthropic_and_responses_inputs_become_chats():
    chat = anthropic_api.to_chat([{"type": "text", "text": "Sys"}], [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "42"}]}]}])
    assert chat == [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"}]
    chat = responses_api.to_chat("Be brief", [
        {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        {"type": "reasoning", "id": "rs", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "It is 42."}]}])
    assert chat == [
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "It is 42."}]
    with pytest.raises(APIError, match="web_search"):
        responses_api.to_chat(None, [{"type": "web_search_call"}])
    # OpenAI's: an output for a call the input does not hold is a 400 (the template would render
    # a tool answer to nothing)
    with pytest.raises(APIError, match=r"input\[1\]: no function_call with call_id 'c9'"):
        responses_api.to_chat(None, [{"type": "function_call", "call_id": "c1", "name": "f",
                                      "arguments": "{}"},
                                     {"type": "function_call_output", "call_id": "c9", "output": "x"}])


def test_validation_message_and_addresses():
    exc = RequestValidationError([{"type": "json_invalid", "loc": ("body", 5),
                                   "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}])
    assert validation_message(exc) == ("the request body is not valid JSON: Expecting value "
                                       "(at character 5)")
    assert validation_param(exc.errors()) is None  # not "5": an offset is no field
    exc = RequestValidationError([{"type": "greater_than_equal", "loc": ("body", "max_tokens"),
                                   "msg": "Input should be greater than or equal to 1"}])
    assert validation_message(exc) == "max_tokens: Input should be greater than or equal to 1"
    assert engine_addresses("tcp://0.0.0.0:5555") == ("tcp://0.0.0.0:5555", "tcp://127.0.0.1:5555")
    bind, connect = engine_addresses(None)
    assert bind == connect and bind.startswith("ipc://")
    with pytest.raises(ValueError, match="--engine-address"):
        ServerArgs(engine_address="http://x").validate()
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(enable_auto_tool_choice=True).validate()
    with pytest.raises(ValueError, match="--reasoning-parser.*unsupported parser 'nope'"):
        ServerArgs(reasoning_parser="nope").validate()
    with pytest.raises(ValueError, match="--renderer"):
        ServerArgs(renderer="nope").validate()


@pytest.mark.parametrize("flag,name,listed,unlisted", [
    ("reasoning_parser", "mistral", "deepseek_r1", "llama3_json"),  # no reasoning format
    ("reasoning_parser", "nope", "qwen3", "mistral"),
    ("tool_call_parser", "deepseek_r1", "llama3_json", "deepseek_r1"),  # no tool-call format
])
def test_a_parser_without_that_format_is_refused_at_the_cli(flag, name, listed, unlisted):
    """`serve --reasoning-parser mistral` passed the CLI and failed only once the model had loaded
    (on every rank), without naming the flag; the CLI listed tool-call parsers as reasoning ones."""
    with pytest.raises(ValueError) as e:
        ServerArgs(**{flag: name}).validate()
    msg = str(e.value)
    assert msg.startswith("--" + flag.replace("_", "-")) and repr(name) in msg, msg
    supported = msg.split("supported: ")[1].split(", ")
    assert listed in supported and unlisted not in supported, msg
    ServerArgs(**{flag: listed}).validate()


def test_engine_death_mid_stream_ends_the_stream_with_an_error(tok):
    from rankserve.runtime.serve.context import _guarded
    from rankserve.runtime.serve.protocol import APIError as E

    async def main():
        ctx = make_ctx(tok, reasoning_parser=None, tool_call_parser=None,
                       enable_auto_tool_choice=False)
        run = ChatRun(ctx, [1, 2], 1, ToolMode())
        stream = ctx.client.generate([1, 2], SamplingParams(max_tokens=50), request_id="r")
        feed(ctx.client, "r", tok.encode("Hello there"), finish=None)
        ctx.client._handle(EngineCoreOutputs(engine_dead="RuntimeError: CUDA error"))
        return await collect(_guarded(chat_events(ctx, run, stream, "c", 0, None, chat_req(False)),
                                      E.openai_body))
    events = [d for _, d in sse_events(asyncio.run(main()))]
    assert events[-1] == "[DONE]"  # an OpenAI stream still ends with [DONE] after its error
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == \
        "Hello there"
    assert "CUDA error" in events[-2]["error"]["message"]
    assert events[-2]["error"]["type"] == "service_unavailable"


def test_output_loop_gives_the_handlers_a_turn(tok):
    """Engine messages that keep arriving never starve the handlers: after at most
    MAX_MESSAGES_PER_TURN messages they run (a ready recv does not yield to the event loop)."""
    from rankserve.runtime.messages import encoder
    from rankserve.runtime.serve.client import MAX_MESSAGES_PER_TURN

    class BusySocket:  # always another message queued, until the last
        def __init__(self, msgs):
            self.msgs = msgs

        async def recv(self):
            if not self.msgs:
                await asyncio.Event().wait()
            return self.msgs.pop(0)

        def getsockopt(self, opt):
            return zmq.POLLIN if self.msgs else 0

    async def main():
        client = make_client(tok)
        stream = client.generate([1, 2], SamplingParams(max_tokens=1000, ignore_eos=True),
                                 request_id="r")
        n = 3 * MAX_MESSAGES_PER_TURN
        client.socks = [BusySocket([encoder.encode(EngineCoreOutputs(outputs=[EngineCoreOutput(
            "r", [100 + i], finish_reason=FinishReason.LENGTH if i == n - 1 else None)]))
            for i in range(n)])]
        loop = asyncio.create_task(client._recv_loop(0))
        sizes = [len(u.token_ids) async for u in stream]
        loop.cancel()
        return n, sizes
    n, sizes = asyncio.run(main())
    assert sum(sizes) == n and max(sizes) <= MAX_MESSAGES_PER_TURN and len(sizes) >= 3


def test_generation_config_max_new_tokens_caps_a_requests_max_tokens(tmp_path):
    """As vLLM: a generation_config.json `max_new_tokens` is the default max_tokens and caps a
    larger one the request asks for; other defaults fill what the request leaves out."""
    from rankserve.runtime.serve.app import _model_files
    from rankserve.runtime.serve.protocol import CompletionRequest, sampling_params
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 5, "temperature": 0.4}')
    model_type, defaults = _model_files(str(tmp_path))
    assert model_type == "llama"
    for asked, got in ((None, 5), (100, 5), (3, 3)):
        sp = sampling_params(CompletionRequest(prompt="x"), defaults, asked, None)
        assert sp.max_tokens == got and sp.temperature == 0.4
    assert _model_files(str(tmp_path), "vllm")[1] == {}


def test_engine_logs_throughput_every_interval_unless_disabled(caplog):
    """As vLLM's server: every RANKSERVE_LOG_STATS_INTERVAL seconds with work, one line of
    prompt / generation throughput, running / waiting requests, KV-cache use and prefix hits
    (what a Slurm job's output shows); nothing while idle; --disable-log-stats: nothing."""
    import logging

    from rankserve.runtime.messages import SchedulerStats
    from rankserve.runtime.serve.engine_proc import StatsLog
    clock = [100.0]
    log = StatsLog(interval=10.0, clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="rankserve.serve"):
        for i in range(20):  # 20 steps over 10 s: 400 prompt and 1000 generated tokens
            clock[0] += 0.5
            log.observe(SchedulerStats(num_running=50, num_waiting=3, kv_usage=0.375,
                                       num_prompt_tokens=20, num_generation_tokens=50,
                                       prefix_queries=100 * (i + 1), prefix_hits=25 * (i + 1)))
        lines = [r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage()]
        assert len(lines) == 1, lines
        line = lines[0]
        for part in ("40.0 tokens/s prompt", "100.0 tokens/s generation throughput",
                     "50 running", "3 waiting", "KV cache 37.5 %", "prefix cache hit rate 25.0 %"):
            assert part in line, line
        caplog.clear()
        clock[0] += 60  # idle: no step, nothing logged at the next observation either
        log.observe(SchedulerStats())
        assert not [r for r in caplog.records if "throughput" in r.getMessage()]
    assert ServerArgs(disable_log_stats=True).disable_log_stats


@pytest.mark.parametrize("parser,mode,text", [
    ("llama3_json", ToolMode(parse=True), '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", ToolMode(parse=True), '{"na'),
    ("hermes", ToolMode(parse=True),
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("hermes", ToolMode(forced="get_weather"), '{"city": "Pa'),
    ("hermes", ToolMode(forced="required"), '[{"name": "get_weather", "parameters": {"ci'),
])
def test_a_tool_call_cut_by_max_tokens_comes_back_as_content(tok, parser, mode, text):
    """Output cut by max_tokens inside a tool call: finish_reason length and the text as content
    (vLLM, whose parsers give unparsable output back as content), streamed or not."""
    async def main(streamed: bool):
        ctx = make_ctx(tok, tool_call_parser=parser, reasoning_parser=None)
        run = ChatRun(ctx, [1, 2], 1, mode)
        stream = ctx.client.generate([1, 2], SamplingParams(max_tokens=100), request_id="r")
        feed(ctx.client, "r", tok.encode(text), finish=FinishReason.LENGTH)
        if streamed:
            req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
            return await collect(chat_events(ctx, run, stream, "c", 0, None, req)), run
        async for upd in stream:
            run.update(upd)
        return None, run
    _, run = asyncio.run(main(False))
    assert run.result(0).content == text and run.finish_reason(0) == "length"
    chunks, run = asyncio.run(main(True))
    choices = [d["choices"][0] for _, d in sse_events(chunks)[:-1]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == text
    assert choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_anthropic_budget_reaches_the_engine_only_with_a_reasoning_parser(tok, parser):
    """Anthropic clients send budget_tokens with every enabled thinking: without
    --reasoning-parser no output is reasoning (nothing to cut), so it is no 400; with one, the
    engine gets it as thinking_token_budget."""
    from rankserve.runtime.serve.protocol import MessagesRequest
    ctx = make_ctx(tok, reasoning_parser=parser)
    ctx.client.model_info = {"vocab_size": len(tok), "max_model_len": 4096}
    req = MessagesRequest(model="m", max_tokens=2000, messages=[{"role": "user", "content": "hi"}],
                          thinking={"type": "enabled", "budget_tokens": 1024})

    async def main():
        task = asyncio.ensure_future(anthropic_api.create_message(ctx, req))
        await asyncio.sleep(0.05)
        task.cancel()
    asyncio.run(main())
    adds = [msgspec.msgpack.decode(p, type=EngineCoreRequest) for k, p in ctx.client.sent
            if k == EngineCoreRequestType.ADD]
    assert len(adds) == 1
    assert adds[0].sampling_params.thinking_token_budget == (1024 if parser else None)


def test_responses_stream_marks_a_cut_call_incomplete():
    """A call cut by max_output_tokens comes back as text after its streamed item: that
    function_call item is `incomplete` (its arguments are no JSON), never `completed` (a
    client would run it); a whole call followed by text stays `completed`."""
    for args, status in (('{"city": "Par', "incomplete"), ('{"city": "Paris"}', "completed")):
        items = responses_api.ItemStream()
        events = [d for _, d in sse_events(
            items.feed([ToolCallDelta(0, "call_1", "get_weather", args),
                        ContentDelta('<tool_call>{"name": "get_weather", "arguments": ')])
            + items.close("incomplete"))]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [(i["type"], i["status"]) for i in done] == [("function_call", status),
                                                             ("message", "incomplete")]
        assert items.items[0]["status"] == status


def test_detokenizer_keeps_only_the_named_special_tokens():
    """skip_special_tokens with kept ids (a parser's markers, e.g. Llama 3's <|python_tag|>):
    those stay in the text, the other special tokens are skipped as by skip_special_tokens."""
    from rankserve.runtime.detokenize import IncrementalDetokenizer
    llama = transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "llama3")
    tag, other = 128010, 128002  # <|python_tag|>, <|reserved_special_token_0|>
    ids = [other, tag, *llama.encode('{"a": 1}', add_special_tokens=False), other]
    for kept, want in ((None, '{"a": 1}'), ([tag], '<|python_tag|>{"a": 1}')):
        d = IncrementalDetokenizer(llama, [128000, other], True, kept_special_token_ids=kept)
        for t in ids:
            d.push([t])
        assert d.text == want
