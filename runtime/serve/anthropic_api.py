"""Anthropic Messages API: /v1/messages (stream and not) and /v1/messages/count_tokens.

A request becomes an OpenAI-style chat (system, messages with tool calls and tool results,
tools) for the renderer; the parser's deltas become Anthropic content blocks."""
from __future__ import annotations

import json
from typing import AsyncIterator

from ..parse import ContentDelta, Delta, ParsedMessage, ReasoningDelta, ToolCallDelta
from ..sampling_params import StructuredOutputsParams
from .context import ChatRun, ServeContext, ToolMode, sse
from .protocol import (APIError, CountTokensRequest, MessagesRequest, SamplingRequest,
                       check_prompts, check_tool_names, check_tool_schemas, random_id,
                       sampling_params)

TOOL_CHOICE = {"auto": "auto", "none": "none", "any": "required"}
# the fields of each tool_choice type (Anthropic's); any other is a 400, not dropped
TOOL_CHOICE_FIELDS = {"auto": {"disable_parallel_tool_use"}, "any": {"disable_parallel_tool_use"},
                      "tool": {"name", "disable_parallel_tool_use"}, "none": set()}
THINKING_FIELDS = {"enabled": {"type", "budget_tokens", "display"}, "disabled": {"type"},
                   "adaptive": {"type", "display"}}
MIN_THINKING_BUDGET = 1024  # Anthropic's
UNKNOWN_RELEASE = "1970-01-01T00:00:00Z"  # Anthropic's `created_at` when the date is unknown


def _field(block: dict, key: str, kind: type, where: str):
    """A block's required field, of its type (Anthropic's; a wrong one was a 500 downstream)."""
    value = block.get(key)
    if not isinstance(value, kind):
        name = {str: "string", dict: "object", bool: "boolean"}[kind]
        raise APIError(f"{where}.{key}: Input should be a valid {name}", param="messages")
    return value


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of blocks")
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(f"{where}: content block {kind!r} is not supported here (only text)")
        parts.append(_field(b, "text", str, f"{where}[{j}]"))
    return "\n".join(parts)


def to_chat(system, messages: list[dict]) -> list[dict]:
    """Anthropic system + messages → OpenAI chat messages."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    # the tool_use ids of the assistant turn just before (a run of messages of one role is one
    # turn, Anthropic's: see _add)
    asked: set[str] = set()
    pending: list[str] = []  # ... and those no tool_result answered yet
    prev = None
    for i, m in enumerate(messages):
        where, role, content = f"messages[{i}]", m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(f"{where}: role must be 'user' or 'assistant', got {role!r}")
        if role == "assistant" and prev != "assistant":
            _check_answered(pending)
            asked = set()
        prev = role
        if isinstance(content, str):
            _add(out, {"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(f"{where}: content must be a string or a list of blocks")
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(content):
            kind, at = b.get("type") if isinstance(b, dict) else None, f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_field(b, "text", str, at))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(_field(b, "thinking", str, at))
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": _field(b, "id", str, at), "type": "function", "function": {
                    "name": _field(b, "name", str, at),
                    "arguments": json.dumps(_field(b, "input", dict, at))}})
            elif kind == "tool_result" and role == "user":
                # tool results come first in a user turn; they answer the previous tool_use
                call_id = _field(b, "tool_use_id", str, at)
                if call_id not in asked:
                    raise APIError(f"{at}: unexpected tool_use_id {call_id!r} in a tool_result "
                                   "block: each tool_result must answer a tool_use block of "
                                   "the assistant message just before")
                if "is_error" in b:
                    _field(b, "is_error", bool, at)
                pending = [p for p in pending if p != call_id]
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": _text(b.get("content", ""), f"{at}.content")})
            else:
                raise APIError(f"{at}: block type {kind!r} is not supported in a {role} message")
        asked |= {c["id"] for c in calls}
        pending += [c["id"] for c in calls]
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            _add(out, msg)
        elif texts:
            _add(out, {"role": "user", "content": "\n".join(texts)})
        elif not content:  # dropping it would make the previous assistant turn a prefill
            raise APIError(f"{where}: a user message needs at least one content block")
    if prev == "user":  # (calls of a final assistant turn: see _check_prefill)
        _check_answered(pending)
    return out


def _check_answered(pending: list[str]) -> None:
    if pending:
        raise APIError("tool_use ids were found without tool_result blocks immediately after: "
                       f"{', '.join(pending)}. Each tool_use block must have a corresponding "
                       "tool_result block in the next message.", param="messages")


def _add(out: list[dict], msg: dict) -> None:
    """Append a turn; consecutive turns of a role are one turn (Anthropic combines them), their
    texts joined as a message's own text blocks are."""
    last = out[-1] if out else None
    if last is None or last["role"] != msg["role"] or msg["role"] not in ("user", "assistant"):
        out.append(msg)
    elif msg["role"] == "user":
        last["content"] += "\n" + msg["content"]
    else:
        last["content"] += msg["content"]
        if msg.get("reasoning_content"):
            last["reasoning_content"] = last.get("reasoning_content", "") + msg["reasoning_content"]
        if msg.get("tool_calls"):
            last["tool_calls"] = last.get("tool_calls", []) + msg["tool_calls"]


def to_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not t.get("name") or t.get("type") not in (None, "custom"):
            raise APIError(f"tools[{i}]: only custom tools with a name and an input_schema are "
                           "supported")
        schema = t.get("input_schema")
        if schema is None:  # (Anthropic: required)
            raise APIError(f"tools[{i}].input_schema: Field required", param="tools")
        if schema.get("type") != "object":
            raise APIError(f"tools[{i}].input_schema.type: Input should be 'object'", param="tools")
        if t.get("strict") not in (None, True, False):
            raise APIError(f"tools[{i}].strict: Input should be a valid boolean", param="tools")
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": schema}
        if t.get("strict"):  # a call, under auto too, follows the schema
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    check_tool_names(tools)
    return out


def _tool_choice(tc: dict | None):
    if tc is None:
        return None
    kind = tc.get("type")
    extra = sorted(tc.keys() - {"type"} - TOOL_CHOICE_FIELDS.get(kind, set()))
    if kind in TOOL_CHOICE_FIELDS and extra:
        raise APIError(f"tool_choice {kind!r}: unknown field(s) {extra}", param="tool_choice")
    if not isinstance(tc.get("disable_parallel_tool_use", False), bool):
        raise APIError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    if kind not in TOOL_CHOICE:
        raise APIError(f"tool_choice type {kind!r} is unknown", param="tool_choice")
    return TOOL_CHOICE[kind]


def _tool_mode(ctx: ServeContext, tools, choice, tc: dict | None) -> ToolMode:
    """ctx.tool_mode, with its refusals told in Anthropic's terms."""
    parallel = not (tc or {}).get("disable_parallel_tool_use", False)
    try:
        return ctx.tool_mode(tools, choice, parallel)
    except APIError as e:
        kind = json.dumps({"type": (tc or {}).get("type", "auto")})
        if choice in (None, "auto") and e.param == "tool_choice":
            raise APIError(f"tool_choice {kind} needs the server started with "
                           "--enable-auto-tool-choice and --tool-call-parser",
                           param="tool_choice") from None
        if isinstance(choice, dict):
            raise APIError(f"tool_choice names the tool {(tc or {}).get('name')!r}, which is not "
                           "among the tools", param="tool_choice") from None
        raise


def thinking_budget(thinking: dict | None) -> int | None:
    """`thinking.budget_tokens` (type enabled; checked by _thinking): the engine's
    thinking_token_budget."""
    return (thinking or {}).get("budget_tokens") if (thinking or {}).get("type") == "enabled" else None


def _thinking(req, forced: bool) -> bool:
    """Whether thinking is on, after Anthropic's checks: the fields of each type, a budget of
    at least 1024 tokens below max_tokens (the engine cuts the reasoning at it: thinking_budget),
    no thinking while tool_choice forces a tool."""
    if req.thinking is None:
        return False
    kind = req.thinking.get("type")
    if kind not in THINKING_FIELDS:
        raise APIError(f"thinking.type must be enabled, disabled or adaptive; got {kind!r}")
    extra = sorted(req.thinking.keys() - THINKING_FIELDS[kind])
    if extra:
        raise APIError(f"thinking.{extra[0]}: Extra inputs are not permitted (thinking type "
                       f"{kind!r})", param="thinking")
    if req.thinking.get("display") not in (None, "summarized"):  # (summarized: as returned)
        raise APIError(f"thinking.display: only 'summarized' is supported (the thinking is "
                       f"returned), got {json.dumps(req.thinking['display'])[:40]}",
                       param="thinking.display")
    if kind == "enabled":
        budget = req.thinking.get("budget_tokens")
        if type(budget) is not int or budget < MIN_THINKING_BUDGET:
            raise APIError("thinking.budget_tokens: an integer of at least "
                           f"{MIN_THINKING_BUDGET} is required, got {json.dumps(budget)[:40]}",
                           param="thinking")
        max_tokens = getattr(req, "max_tokens", None)  # (count_tokens has none)
        if max_tokens is not None and max_tokens <= budget:
            raise APIError(f"`max_tokens` must be greater than `thinking.budget_tokens` ({budget}), "
                           f"got {max_tokens}", param="max_tokens")
    if kind != "disabled" and forced:
        raise APIError("Thinking may not be enabled when tool_choice forces tool use.",
                       param="tool_choice")
    return kind != "disabled"


def _render(ctx: ServeContext, req) -> tuple[list[int], ToolMode]:
    ctx.check_model(req.model)
    check_tool_schemas(req.tools, "input_schema", "tools[{i}].input_schema")
    tools = to_tools(req.tools)
    choice = _tool_choice(req.tool_choice)
    thinking = _thinking(req, forced=choice == "required" or isinstance(choice, dict))
    counting = isinstance(req, CountTokensRequest)  # counting calls nothing
    mode = ToolMode() if counting else _tool_mode(ctx, tools, choice, req.tool_choice)
    chat = to_chat(req.system, req.messages)
    prefill = req.messages[-1].get("role") == "assistant"
    if prefill:
        _check_prefill(chat[-1], thinking)
    ids = ctx.render_chat(chat, ctx.prompt_tools(tools, choice == "none"), {"enable_thinking": thinking},
                          add_generation_prompt=not prefill, continue_final_message=prefill)
    return ids, mode


def _check_prefill(msg: dict, thinking: bool) -> None:
    """A final assistant message is a prefill: the answer continues its text (Anthropic's)."""
    if thinking:
        raise APIError("an assistant prefill (a final assistant message) cannot be used with "
                       "thinking", param="messages")
    if msg.get("tool_calls"):
        raise APIError("the final assistant message (a prefill) cannot end with tool_use "
                       "blocks: answer them with tool_result blocks in a user message",
                       param="messages")
    if msg["content"] != msg["content"].rstrip():
        raise APIError("final assistant content cannot end with trailing whitespace",
                       param="messages")


def output_format(cfg: dict | None) -> StructuredOutputsParams | None:
    """output_config.format, Anthropic's structured outputs (the client's messages.parse)."""
    extra = sorted((cfg or {}).keys() - {"format", "effort"})
    if extra:
        raise APIError(f"output_config: unknown field(s) {extra}", param=f"output_config.{extra[0]}")
    if (cfg or {}).get("effort") is not None:
        raise APIError("output_config.effort is not supported (thinking's budget_tokens is)",
                       param="output_config.effort")
    fmt = (cfg or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or fmt.keys() - {"type", "schema"} or not isinstance(fmt.get("schema"), dict):
        raise APIError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                       param="output_config.format")
    return StructuredOutputsParams(json=fmt["schema"])


def stop_reason(finish: str | None, stop: int | str | None, tool_calls: bool) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if tool_calls else "end_turn"), None


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(msg: ParsedMessage) -> list[dict]:
    blocks = []
    if msg.reasoning:
        blocks.append({"type": "thinking", "thinking": msg.reasoning, "signature": ""})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    for c in msg.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return blocks


class BlockStream:
    """Parser deltas → content_block_start / _delta / _stop events, one block at a time."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None

    def _switch(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(sse({"type": "content_block_start", "index": self.index,
                        "content_block": block}, "content_block_start"))
        return out

    def _delta(self, delta: dict) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                   "content_block_delta")

    def feed(self, deltas: list[Delta]) -> list[bytes]:
        out = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if self.kind != "text":
                    out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, ReasoningDelta):
                if self.kind != "thinking":
                    out += self._switch("thinking", {"type": "thinking", "thinking": "",
                                                     "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            elif isinstance(d, ToolCallDelta):
                if d.name is not None:
                    out += self._switch("tool_use", {"type": "tool_use", "id": d.id,
                                                     "name": d.name, "input": {}})
                if d.arguments:
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": d.arguments}))
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]


async def create_message(ctx: ServeContext, req: MessagesRequest):
    prompt_ids, mode = _render(ctx, req)
    check_prompts([prompt_ids], ctx.client.model_info, req.max_tokens, prompt_param="messages")
    structured = output_format(req.output_config)
    if structured is not None and mode.structured() is not None:
        raise APIError("the tools constrain the output already (tool_choice any / tool, or "
                       "strict tools); drop output_config.format", param="tool_choice")
    run = ChatRun(ctx, prompt_ids, 1, mode)
    sreq = SamplingRequest(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                           stop=req.stop_sequences)
    params = ctx.with_thinking(sampling_params(sreq, ctx.defaults, req.max_tokens, None,
                                               run.parsers[0],
                                               ctx.client.model_info.get("vocab_size"),
                                               ctx.constraint(structured or mode.structured(),
                                                              prompt_ids)),
                               # without a reasoning parser no output is reasoning: nothing to
                               # cut (and Anthropic clients send budget_tokens with every enabled)
                               thinking_budget(req.thinking) if ctx.args.reasoning_parser else None,
                               "thinking.budget_tokens")
    stream = ctx.client.generate(prompt_ids, params, lora_request=ctx.lora_for(req.model))
    mid = random_id("msg_")

    def message(content, reason=None, seq=None, output_tokens=0, cached=0) -> dict:
        # Anthropic counts cache reads apart from input_tokens (clients add the two)
        return {"id": mid, "type": "message", "role": "assistant", "model": ctx.served_name(req.model),
                "content": content, "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": len(prompt_ids) - cached,
                          "output_tokens": output_tokens, "cache_read_input_tokens": cached}}

    async def collect() -> dict:
        async for upd in stream:
            run.update(upd)
        msg = run.result(0)
        reason, seq = stop_reason(run.finish_reasons[0], run.stop_reasons[0], bool(msg.tool_calls))
        return message(content_blocks(msg), reason, seq, run.completion_tokens,
                       run.num_cached_tokens)

    async def events() -> AsyncIterator[bytes]:
        cached = (await stream.peek()).num_cached_tokens
        yield sse({"type": "message_start", "message": message([], cached=cached)},
                  "message_start")
        blocks = BlockStream()
        async for upd in stream:
            for chunk in blocks.feed(run.update(upd)):
                yield chunk
        for chunk in blocks.close():
            yield chunk
        reason, seq = stop_reason(run.finish_reasons[0], run.stop_reasons[0],
                                  bool(run.result(0).tool_calls))
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                   "usage": {"output_tokens": run.completion_tokens}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    return await ctx.respond([stream], req.stream, collect, events, APIError.anthropic_body)


def count_tokens(ctx: ServeContext, req: CountTokensRequest) -> dict:
    output_format(req.output_config)
    ids, _ = _render(ctx, req)
    return {"input_tokens": len(ids)}


def model_info(ctx: ServeContext, model_id: str | None = None) -> dict:
    """GET /v1/models[/{id}] from the anthropic client (it sends `anthropic-version`): Anthropic's
    ModelInfo; 404 for other ids."""
    ctx.check_model(model_id)
    lora = ctx.lora_for(model_id)
    base = model_id if model_id in ctx.model_names else ctx.model_name
    name = lora.lora_name if lora is not None else base
    return {"type": "model", "id": name, "display_name": name, "created_at": UNKNOWN_RELEASE,
            "lifecycle": "active", "max_input_tokens": ctx.client.model_info.get("max_model_len")}


def model_list(ctx: ServeContext, names: list) -> dict:
    data = [model_info(ctx, n) for n in names]
    return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
