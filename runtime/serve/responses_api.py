"""OpenAI Responses API: /v1/responses (stream and not; stateless: nothing is stored).

Input items become a chat for the renderer; the parser's deltas become output items: reasoning,
message (output_text) and function_call."""
from __future__ import annotations

import base64
import binascii
import json
from typing import AsyncIterator

from ..parse import ContentDelta, Delta, ReasoningDelta, ToolCallDelta
from .context import ChatRun, ServeContext, sse
from .protocol import (APIError, ResponsesRequest, SamplingRequest, check_prompts,
                       check_tool_names, now, random_id, sampling_params, structured_from)

TEXT_PARTS = ("input_text", "output_text", "text")
# include=["reasoning.encrypted_content"]: the reasoning's text, encoded (opaque to clients, but
# not encrypted: nothing is stored, so a later request must be able to read it back)
SEALED = "rankserve-reasoning-v1:"


def seal(text: str) -> str:
    return SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def unseal(token, where: str) -> str:
    if isinstance(token, str) and token.startswith(SEALED):
        try:
            return base64.urlsafe_b64decode(token[len(SEALED):].encode()).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    raise APIError(f"{where}: encrypted_content was not made by this server (send the reasoning "
                   "item as this server returned it)", param="input")


def _text(content, where: str, sep: str = "\n") -> str:
    """A string, or text parts joined as chat's (vLLM's) are."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of parts", param="input")
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(f"{where}: content part {kind!r} is not supported (only text)",
                           param="input")
        if not isinstance(p.get("text", ""), str):
            raise APIError(f"{where}: a text part's text must be a string", param="input")
        parts.append(p.get("text", ""))
    return sep.join(parts)


def to_chat(instructions: str | None, items) -> list[dict]:
    """Responses input → OpenAI chat messages. Reasoning and function_call items join the
    assistant turn they belong to."""
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not items:
        raise APIError("input must not be empty", param="input")

    def assistant() -> dict:
        if not msgs or msgs[-1]["role"] != "assistant":
            msgs.append({"role": "assistant", "content": ""})
        return msgs[-1]
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}: role must be user, assistant, system or developer, "
                               f"got {role!r}", param="input")
            text = _text(item.get("content"), where)
            last = msgs[-1] if msgs else None
            if role == "assistant" and last and last["role"] == "assistant" \
                    and not last["content"] and not last.get("tool_calls"):
                last["content"] = text  # after its reasoning item
            else:
                msgs.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content")
            if not parts and item.get("encrypted_content") is not None:
                assistant()["reasoning_content"] = unseal(item["encrypted_content"], where)
                continue
            parts = parts or item.get("summary") or []
            assistant()["reasoning_content"] = _text(
                [dict(p, type="text") if isinstance(p, dict) else p for p in parts]
                if isinstance(parts, list) else parts, where, sep="")
        elif kind == "function_call":
            fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
            if not all(isinstance(v, str) for v in fields.values()):
                raise APIError(f"{where}: a function_call needs call_id, name and arguments, "
                               "all strings", param="input")
            assistant().setdefault("tool_calls", []).append({
                "id": fields["call_id"], "type": "function",
                "function": {"name": fields["name"], "arguments": fields["arguments"]}})
        elif kind == "function_call_output":
            out, call_id = item.get("output", ""), item.get("call_id", "")
            if not any(tc["id"] == call_id for m in msgs for tc in m.get("tool_calls", ())):
                raise APIError(f"{where}: no function_call with call_id {call_id!r} comes before this "
                               "function_call_output (send the call item too)", param="input")
            msgs.append({"role": "tool", "tool_call_id": call_id,
                         "content": out if isinstance(out, str) else _text(out, where)})
        else:
            raise APIError(f"{where}: item type {kind!r} is not supported", param="input")
    answered = {m["tool_call_id"] for m in msgs if m["role"] == "tool"}
    for tc in (tc for m in msgs for tc in m.get("tool_calls", ())):
        if tc["id"] not in answered:  # (OpenAI's words)
            raise APIError(f"No tool output found for function call {tc['id']}.", param="input")
    return msgs


def to_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not t.get("name"):
            raise APIError(f"tools[{i}]: only function tools are supported", param="tools")
        if t.get("strict") not in (None, True, False):
            raise APIError(f"tools[{i}].strict must be a boolean", param="tools")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("strict"):  # a call, under auto too, follows the schema
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    check_tool_names(tools)
    return out


def _tool_choice(tc):
    if tc is None or isinstance(tc, str):  # (the literals are checked by the request's model)
        return tc
    if tc.get("type") == "function" and isinstance(tc.get("name"), str) and len(tc) == 2:
        return {"type": "function", "function": {"name": tc["name"]}}
    raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   f'"name": ...}}, got {json.dumps(tc)}', param="tool_choice")


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status != "in_progress" else []}


def reasoning_item(item_id: str, text: str, status: str = "completed",
                   sealed: bool = False) -> dict:
    item = {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}
    if sealed and status != "in_progress":
        item["encrypted_content"] = seal(text)
    return item


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class ItemStream:
    """Parser deltas → Responses streaming events; collects the output items on the way."""

    def __init__(self, sealed: bool = False):
        self.sealed = sealed  # reasoning items carry encrypted_content
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being streamed, with its text so far

    def event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def _start(self, item: dict) -> list[bytes]:
        out = self.close()
        self.open = {"item": item, "text": ""}
        self.items.append(item)
        idx = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=idx, item=item))
        part = {"message": {"type": "output_text", "text": "", "annotations": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=idx, content_index=0, part=part))
        return out

    def _delta(self, kind: str, text: str, **extra) -> bytes:
        self.open["text"] += text
        return self.event(kind, item_id=self.open["item"]["id"], output_index=len(self.items) - 1,
                          delta=text, **extra)

    def feed(self, deltas: list[Delta]) -> list[bytes]:
        out = []
        for d in deltas:
            kind = self.open["item"]["type"] if self.open else None
            if isinstance(d, ContentDelta):
                if kind != "message":
                    out += self._start(message_item(random_id("msg_"), "", "in_progress"))
                out.append(self._delta("response.output_text.delta", d.text, content_index=0,
                                       logprobs=[]))
            elif isinstance(d, ReasoningDelta):
                if kind != "reasoning":
                    out += self._start(reasoning_item(random_id("rs_"), "", "in_progress"))
                out.append(self._delta("response.reasoning_text.delta", d.text, content_index=0))
            elif isinstance(d, ToolCallDelta):
                if d.name is not None:
                    out += self._start(call_item(random_id("fc_"), d.id, d.name, "", "in_progress"))
                if d.arguments and self.open and self.open["item"]["type"] == "function_call":
                    out.append(self._delta("response.function_call_arguments.delta", d.arguments))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """End the open item; `incomplete`: the output was cut (max_output_tokens)."""
        if self.open is None:
            return []
        item, text = self.open["item"], self.open["text"]
        self.open = None
        idx = len(self.items) - 1
        out = []
        if item["type"] == "message":
            done = message_item(item["id"], text, status)
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=idx, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=idx, content_index=0, part=done["content"][0]))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status, self.sealed)
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=idx, content_index=0, text=text))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=idx, content_index=0, part=done["content"][0]))
        else:  # a call cut short (its text then comes back as a message) is no call to run
            done = call_item(item["id"], item["call_id"], item["name"], text,
                             status if _is_json(text) else "incomplete")
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=idx, name=item["name"], arguments=text))
        self.items[idx] = done
        out.append(self.event("response.output_item.done", output_index=idx, item=done))
        return out


def render(ctx: ServeContext, req: ResponsesRequest) -> list[int]:
    """The prompt of a request: its instructions, input and tools through the chat template."""
    tools, choice = to_tools(req.tools), _tool_choice(req.tool_choice)
    kwargs = {}
    if req.reasoning is not None and req.reasoning.get("effort") is not None:
        kwargs["enable_thinking"] = req.reasoning["effort"] not in ("none", "minimal")
    return ctx.render_chat(to_chat(req.instructions, req.input),
                           ctx.prompt_tools(tools, choice == "none"), kwargs)


def check(ctx: ServeContext, req: ResponsesRequest) -> None:
    ctx.check_model(req.model)
    req.check_unsupported()
    if req.previous_response_id:
        raise APIError("previous_response_id is not supported: responses are not stored; send "
                       "the whole conversation as input", param="previous_response_id")


def count_input_tokens(ctx: ServeContext, req: ResponsesRequest) -> dict:
    """POST /v1/responses/input_tokens (openai's responses.input_tokens.count)."""
    check(ctx, req)
    return {"object": "response.input_tokens", "input_tokens": len(render(ctx, req))}


async def create_response(ctx: ServeContext, req: ResponsesRequest):
    check(ctx, req)
    extra = sorted((req.text or {}).keys() - {"format"})
    if extra:  # e.g. verbosity: not implemented, so not silently accepted
        raise APIError(f"text: unsupported field(s) {extra}", param=f"text.{extra[0]}")
    fmt = (req.text or {}).get("format")
    structured = structured_from(SamplingRequest(), "text.format", fmt) if fmt else None
    tools, choice = to_tools(req.tools), _tool_choice(req.tool_choice)
    mode = ctx.tool_mode(tools, choice, req.parallel_tool_calls)
    if structured is not None and mode.structured() is not None:
        raise APIError("the tools constrain the output already (tool_choice required / named, or "
                       "strict tools); drop text.format", param="tool_choice")
    sealed = "reasoning.encrypted_content" in (req.include or [])
    prompt_ids = render(ctx, req)
    check_prompts([prompt_ids], ctx.client.model_info, req.max_output_tokens,
                  prompt_param="input", tokens_param="max_output_tokens")
    run = ChatRun(ctx, prompt_ids, 1, mode)
    params = sampling_params(SamplingRequest(temperature=req.temperature, top_p=req.top_p),
                             ctx.defaults, req.max_output_tokens, None,
                             run.parsers[0],
                             ctx.client.model_info.get("vocab_size"),
                             ctx.constraint(structured or mode.structured(), prompt_ids))
    stream = ctx.client.generate(prompt_ids, params, lora_request=ctx.lora_for(req.model))
    rid, created = random_id("resp_"), now()

    def response(status: str, output: list[dict], usage: dict | None = None) -> dict:
        incomplete = run.finish_reasons[0] == "length" and status != "in_progress"
        return {"id": rid, "object": "response", "created_at": created,
                "status": "incomplete" if incomplete else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": ctx.served_name(req.model), "output": output,
                "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
                "reasoning": req.reasoning, "store": False,
                "temperature": params.temperature, "top_p": params.top_p,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "truncation": "disabled", "usage": usage,
                "metadata": req.metadata or {}, "user": req.user,
                "safety_identifier": req.safety_identifier,
                "prompt_cache_key": req.prompt_cache_key}

    def cut() -> bool:  # OpenAI: the item max_output_tokens ended is `incomplete` too
        return run.finish_reasons[0] == "length"

    def usage() -> dict:
        reasoning = run.result(0).reasoning
        n_reasoning = len(ctx.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return {"input_tokens": len(prompt_ids),
                "input_tokens_details": {"cached_tokens": run.num_cached_tokens},
                "output_tokens": run.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": n_reasoning},
                "total_tokens": len(prompt_ids) + run.completion_tokens}

    async def collect() -> dict:
        async for upd in stream:
            run.update(upd)
        msg = run.result(0)
        output = []
        if msg.reasoning:
            output.append(reasoning_item(random_id("rs_"), msg.reasoning, sealed=sealed))
        if msg.content:
            output.append(message_item(random_id("msg_"), msg.content))
        output += [call_item(random_id("fc_"), c.id, c.name, c.arguments) for c in msg.tool_calls]
        if output and cut():
            output[-1]["status"] = "incomplete"
        return response("completed", output, usage())

    async def events() -> AsyncIterator[bytes]:
        items = ItemStream(sealed)
        yield items.event("response.created", response=response("in_progress", []))
        yield items.event("response.in_progress", response=response("in_progress", []))
        async for upd in stream:
            for chunk in items.feed(run.update(upd)):
                yield chunk
        for chunk in items.close("incomplete" if cut() else "completed"):
            yield chunk
        final = response("completed", items.items, usage())
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield items.event(kind, response=final)

    return await ctx.respond([stream], req.stream, collect, events)

