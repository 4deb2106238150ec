"""What every endpoint shares: the tokenizer, renderer and parser settings, the engine client,
and the plumbing from a RequestStream to an HTTP response (JSON, or SSE that aborts the request
when the client goes away)."""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
from dataclasses import dataclass
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..parse import ContentDelta, Delta, ParsedMessage, ToolCallDelta, make_parser
from ..parse.families import PARSERS, token_id, with_thinking_tags
from ..parse.types import ToolCall, new_tool_call_id
from ..inputs import bad_words_token_ids
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..render import get_renderer
from .args import ServerArgs
from .client import EngineClient, EngineDeadError, RequestError, RequestStream, Update
from .protocol import APIError
from .tool_schema import required_calls_schema

log = logging.getLogger("rankserve.serve")

TOKENIZER_THREADS = 2  # tokenization and chat rendering run here, never on the event loop
PROMPT_CHARS_SLACK = 2  # a prompt over 2 × max_model_len × (longest token in characters) is refused


class _Renders:
    """Tokenizations done ahead of a handler in the thread pool (`ServeContext.prepare`): while
    `recording`, results are kept by their arguments; then the handler, on the event loop, gets
    them back instead of tokenizing again. A miss only means the work is done again."""

    def __init__(self):
        self.recording, self.items = True, []

    def run(self, key: tuple, fn: Callable[[], Any]):
        if self.recording:
            try:
                result = fn()
            except Exception as e:
                self.items.append((key, None, e))
                raise
            self.items.append((key, result, None))
            return result
        for i, (k, result, err) in enumerate(self.items):
            if k == key:
                del self.items[i]
                if err is not None:
                    raise err
                return result
        return fn()


_RENDERS: contextvars.ContextVar[_Renders | None] = contextvars.ContextVar("rankserve_renders",
                                                                            default=None)


def _text_chars(obj: Any) -> int:
    """Characters of all the strings in a JSON-like value (what a renderer could put in a prompt)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_text_chars(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_text_chars(v) for v in obj)
    return 0


class PlainParser:
    """No --tool-call-parser / --reasoning-parser (or tool_choice none without reasoning): all
    output is content, detokenized as the request asks."""

    def __init__(self):
        self.parts: list[str] = []

    def feed(self, token_ids: list[int], text: str) -> list[Delta]:
        if not text:
            return []
        self.parts.append(text)
        return [ContentDelta(text)]

    def finish(self, truncated: bool = False) -> list[Delta]:
        return []

    def result(self) -> ParsedMessage:
        return ParsedMessage("".join(self.parts) or None)


@dataclass(frozen=True)
class ToolMode:
    parse: bool = False  # auto: --tool-call-parser finds calls in the output
    forced: str | None = None  # "required" or the forced function's name: constrained output
    schema: dict | None = None  # the JSON schema of a forced output
    max_calls: int | None = None  # parallel_tool_calls=false: 1
    tag: dict | None = None  # auto with strict tools: the calls' structural tag

    def structured(self) -> StructuredOutputsParams | None:
        if self.tag:
            return StructuredOutputsParams(structural_tag=json.dumps(self.tag))
        return StructuredOutputsParams(json=self.schema) if self.forced else None


class ForcedToolParser:
    """tool_choice required / named: the (constrained) content is JSON — a list of
    {"name", "parameters"} or the named function's arguments — and becomes tool calls at the end.
    Reasoning passes through the inner parser as it streams."""

    def __init__(self, inner, forced: str, new_id=new_tool_call_id):
        self.inner, self.forced, self.new_id = inner, forced, new_id
        self.marker_token_ids = getattr(inner, "marker_token_ids", None)
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.content: str | None = None

    def _split(self, deltas: list[Delta]) -> list[Delta]:
        self.text += [d.text for d in deltas if isinstance(d, ContentDelta)]
        return [d for d in deltas if not isinstance(d, ContentDelta)]

    def feed(self, token_ids: list[int], text: str) -> list[Delta]:
        return self._split(self.inner.feed(token_ids, text))

    def finish(self, truncated: bool = False) -> list[Delta]:
        out = self._split(self.inner.finish(truncated))
        text = "".join(self.text).strip()
        if not text:
            return out
        try:
            value = None if truncated else json.loads(text)
        except ValueError:  # (cannot happen under the constraint)
            value = None
        if value is None:  # an unfinished call: its text is the content, as with the parsers
            self.content = text
            return out + [ContentDelta(text)]
        if self.forced == "required":
            self.calls = [ToolCall(self.new_id(), c["name"],
                                   json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        else:
            self.calls = [ToolCall(self.new_id(), self.forced, text)]
        return out + [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(self.calls)]

    def result(self) -> ParsedMessage:
        msg = self.inner.result()
        return ParsedMessage(self.content, msg.reasoning, list(self.calls))


class ServeContext:
    def __init__(self, args: ServerArgs, model_name: str | list[str], model_path: str, tokenizer,
                 client: EngineClient, model_type: str | None = None,
                 generation_defaults: dict | None = None):
        # --served-model-name a b: requests may name any; responses report the first (as vLLM)
        self.model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.model_name, self.args, self.model_path = self.model_names[0], args, model_path
        self.tokenizer, self.client = tokenizer, client
        if client is not None and args.enable_log_requests:
            client.log_requests = -1 if args.max_log_len is None else args.max_log_len
        from ..lora import LoRATable  # LoRA adapters served as models (runtime/lora.py)
        self.loras = LoRATable(16)
        self.lora_enabled = False
        self.defaults = generation_defaults or {}
        self.renderer = get_renderer(args.renderer, tokenizer, model_type,
                                     args.chat_template) if tokenizer else None
        if args.tool_call_parser or args.reasoning_parser:  # fail at startup on unknown names
            make_parser(tokenizer, args.tool_call_parser, args.reasoning_parser)
        self._token_text: dict[int, str] = {}
        self._anchor: list[int] | None = None
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="rankserve-tok")
        self.max_prompt_chars = self._max_prompt_chars()

    def _max_prompt_chars(self) -> int | None:
        """No token is longer than the longest vocabulary entry, so a text with more characters
        than max_model_len × that cannot fit: it is refused before any tokenization."""
        max_len = self.client.model_info.get("max_model_len") if self.client else None
        if not max_len or self.tokenizer is None:
            return None
        try:
            longest = max(len(t) for t in self.tokenizer.get_vocab())
        except Exception:  # noqa: BLE001  (a tokenizer without a vocabulary listing)
            return None
        return PROMPT_CHARS_SLACK * max_len * max(longest, 1)

    # ---- off the event loop -----------------------------------------------------------------
    async def run_sync(self, fn: Callable, *args):
        """Run blocking work (tokenization, chat templates, decoding) in the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def prepare(self, fn: Callable, *args) -> None:
        """Run a handler's rendering step (`fn(*args)`) in the tokenizer threads ahead of the
        handler; the handler's own `encode` / `render_chat` calls with the same arguments then
        return at once. Errors are left for the handler to raise in its own order."""
        renders = _Renders()

        def record():
            token = _RENDERS.set(renders)
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001  (the handler raises it again, in its order)
                log.debug("rendering ahead failed: %s", e)
            finally:
                _RENDERS.reset(token)
        await self.run_sync(record)
        renders.recording = False
        _RENDERS.set(renders)  # this request's task (and the tasks it starts) replay them

    def check_prompt_chars(self, text: Any, param: str) -> None:
        """A cheap bound before tokenizing: refuse text that cannot fit in the context."""
        limit = self.max_prompt_chars
        if limit is None:
            return
        n = _text_chars(text)
        if n > limit:
            raise APIError(f"the prompt is too long: {n} characters cannot fit in this model's "
                           f"context of {self.client.model_info['max_model_len']} tokens",
                           param=param, code="context_length_exceeded")

    # ---- requests ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if (name is not None and name not in (*self.model_names, self.model_path)
                and self.loras.get(name) is None):
            raise APIError(f"The model `{name}` does not exist.", 404, "model", "model_not_found")

    def check_priority(self, priority: int) -> None:
        """As vLLM: a priority only means something to an engine that schedules by it."""
        policy = self.client.model_info.get("scheduling_policy", "priority")
        if priority != 0 and policy != "priority":
            raise APIError(f"priority {priority} given, but this engine schedules {policy}: start "
                           "it with --scheduling-policy priority", param="priority")

    def lora_for(self, name: str | None):
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return self.loras.get(name)

    def served_name(self, name: str | None) -> str:
        """The `model` a response reports: the adapter the request named, else the base model."""
        lora = self.lora_for(name)
        return lora.lora_name if lora is not None else self.model_name

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: only token-id prompts are served")

    def encode(self, prompt: str | list[int], bounded: bool = True) -> list[int]:
        """`bounded`: refuse a text too long for the context before tokenizing it (not when the
        request truncates its prompt: truncate_prompt_tokens is for prompts over the context)."""
        if isinstance(prompt, str):
            self.need_tokenizer()
            if bounded:
                self.check_prompt_chars(prompt, "prompt")

        def run():
            try:
                return self.renderer.render_completion(prompt) if self.renderer else list(prompt)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from None
        renders = _RENDERS.get()
        return renders.run(("encode", prompt), run) if renders else run()

    def render_chat(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template: str | None = None, bounded: bool = True) -> list[int]:
        self.need_tokenizer()
        if bounded:  # (as encode's)
            self.check_prompt_chars(messages, "messages")

        def run():
            try:
                return self.renderer.render_chat(messages, tools, template_kwargs,
                                                 add_generation_prompt, continue_final_message,
                                                 chat_template)
            except ValueError as e:  # (a tool the template cannot take is the tools' fault)
                raise APIError(str(e), param="tools" if str(e).startswith("tools") else "messages") from None
        renders = _RENDERS.get()
        key = ("chat", messages, tools, template_kwargs, add_generation_prompt,
               continue_final_message, chat_template)
        return renders.run(key, run) if renders else run()

    def tool_mode(self, tools: list | None, tool_choice: Any, parallel: bool = True) -> ToolMode:
        """How a request's tools are honoured (tool_choice in OpenAI chat's form):
        - auto: the model may call them, found by --tool-call-parser in free output;
        - required / a named function: the output is constrained to a JSON schema of the call(s)
          (vLLM's way) and becomes tool calls whatever the parser; `strict` holds by construction.
        `parallel=False` allows at most one call."""
        if tool_choice == "required" or isinstance(tool_choice, dict):
            if not tools:  # vLLM: a 400 too; without it the output would be silently free
                raise APIError("tool_choice required / a named function needs tools",
                               param="tool_choice")
        if not tools or tool_choice == "none":
            return ToolMode()
        if tool_choice in (None, "auto"):
            if not (self.args.enable_auto_tool_choice and self.args.tool_call_parser):
                raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                               '--tool-call-parser to be set', param="tool_choice")
            return ToolMode(parse=True, max_calls=None if parallel else 1,
                            tag=self._strict_tag(tools))
        schemas = {}
        for t in tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            schemas[fn.get("name")] = fn.get("parameters") or {"type": "object", "properties": {}}
        if tool_choice == "required":
            return ToolMode(forced="required", schema=required_calls_schema(schemas, parallel))
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                           f'"function": {{"name": ...}}}}, got {json.dumps(tool_choice)[:200]}',
                           param="tool_choice")
        if name not in schemas:
            raise APIError(f"tool_choice names the function {name!r}, which is not among the "
                           f"tools ({', '.join(map(str, schemas))})", param="tool_choice")
        return ToolMode(forced=name, schema=schemas[name])

    def prompt_tools(self, tools: list | None, none: bool) -> list | None:
        """The tools the chat template shows: all of them, also under tool_choice none (the
        model knows them but is not asked to call; vLLM's default), unless
        --exclude-tools-when-tool-choice-none."""
        return None if none and self.args.exclude_tools_when_tool_choice_none else tools

    def _strict_tag(self, tools: list) -> dict | None:
        """`strict: true` tools under tool_choice auto: the text stays free, but a call, once
        begun, follows its function's schema (a structural tag triggered by the call marker).
        Only the hermes / qwen3 call format has its structure spelled out here."""
        fns = [t.get("function", t) for t in tools if isinstance(t, dict)]
        if not any(fn.get("strict") for fn in fns):
            return None
        if self.args.tool_call_parser not in ("hermes", "qwen3"):
            raise APIError(f"strict tools with tool_choice auto are enforced for the hermes / qwen3 "
                           f"call format, not {self.args.tool_call_parser!r}; use tool_choice "
                           '"required" or a named function', param="tools")
        return {"triggers": ["<tool_call>"], "structures": [
            {"begin": f'<tool_call>\n{{"name": {json.dumps(fn.get("name"))}, "arguments": ',
             "schema": fn.get("parameters") or {"type": "object"}, "end": "}\n</tool_call>"}
            for fn in fns]}

    def constraint(self, params: StructuredOutputsParams | None,
                   prompt_token_ids: list[int]) -> StructuredOutputsParams | None:
        """With a reasoning parser, the constraint starts once the reasoning ends (the reasoning
        itself is free text), unless the prompt already closed it (thinking disabled)."""
        if params is None or not self.args.reasoning_parser:
            return params
        start, end = token_id(self.tokenizer, "<think>"), token_id(self.tokenizer, "</think>")
        if end is None:
            return params
        # the generation prompt's own tag, if any: the tail after the last turn's end (an earlier
        # turn's closed block, kept in a tool loop, says nothing about this turn)
        turn_ends = set(getattr(self.tokenizer, "all_special_ids", ())) | set(self.client.eos_token_ids)
        tag = next((t for t in reversed(prompt_token_ids) if t in (start, end) or t in turn_ends), None)
        if tag == end:
            return params  # the template closed the reasoning block: constrain from the start
        # the template opened it: the output begins inside it; else the model may open it with
        # its first token, or answer at once (then constrained from that token)
        opener = start if tag != start else None
        return msgspec.structs.replace(params, start_after_token_id=end,
                                       reasoning_start_token_id=opener)

    def with_thinking(self, params: SamplingParams, budget: int | None,
                      param: str = "thinking_token_budget") -> SamplingParams:
        """The request's thinking budget, with the reasoning parser's tags (the engine forces
        the end of reasoning with them); without a reasoning parser it is a 400."""
        if budget is None:
            return params
        if not self.args.reasoning_parser:
            raise APIError(f"{param} needs a reasoning model: start the server with "
                           "--reasoning-parser (e.g. qwen3)", param=param)
        out = with_thinking_tags(msgspec.structs.replace(params, thinking_token_budget=budget),
                                 self.tokenizer, self.args.reasoning_parser)
        if not out.thinking_end_token_ids:
            raise APIError(f"{param}: the tokenizer has no reasoning tags of --reasoning-parser "
                           f"{self.args.reasoning_parser}", param=param)
        return out

    def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """bad_words → token id sequences (the engine bans token ids)."""
        if not params.bad_words:
            return params
        self.need_tokenizer()
        return msgspec.structs.replace(
            params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))

    def new_parser(self, prompt_token_ids: list[int], mode: ToolMode):
        tool = self.args.tool_call_parser if mode.parse else None
        if not (tool or self.args.reasoning_parser):
            inner = PlainParser()
        else:
            inner = make_parser(self.tokenizer, tool, self.args.reasoning_parser,
                                prompt_token_ids=prompt_token_ids)
        if not mode.forced:
            return inner
        fam = self.args.tool_call_parser  # its model's call id format, also for forced calls
        return ForcedToolParser(inner, mode.forced, PARSERS.get(fam).call_id if fam else new_tool_call_id)

    def token_text(self, token_id: int) -> str:
        """A token's text as it appears inside the output (decoded after an anchor token, since
        SentencePiece drops the leading space of a text's first token)."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                return ""
            if self._anchor is None:
                self._anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
            base = self.tokenizer.decode(self._anchor)
            both = self.tokenizer.decode(self._anchor + [token_id])
            text = both[len(base):] if both.startswith(base) else self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs `bytes`): those of its text, but for a token
        holding part of a character (its text alone is "�") the raw byte(s) it stands for, so
        that the bytes of consecutive tokens add up to the output's UTF-8."""
        text = self.token_text(token_id)
        if "\ufffd" not in text or self.tokenizer is None:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece byte fallback
            if m:
                return bytes([int(m[1], 16)])
            if all(ch in _BYTE_OF_CHAR for ch in piece):  # byte-level BPE (GPT-2, Qwen, Llama 3)
                return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return text.encode()

    # ---- responses --------------------------------------------------------------------------
    async def respond(self, streams: list[RequestStream], streaming: bool,
                      collect: Callable[[], Awaitable[dict]],
                      events: Callable[[], AsyncIterator[bytes]],
                      error_body: Callable[[APIError], dict] = APIError.openai_body):
        """Wait for the first update of every stream (so that engine-side refusals become a 400,
        not a broken stream), then answer with JSON or SSE. Streams are aborted whenever the
        response ends early."""
        def close():
            for s in streams:
                s.close()
        handed_over = False  # to the SSE response, which closes the streams when it ends
        try:
            for s in streams:
                await s.peek()
            if streaming:
                handed_over = True
                return SSEResponse(_guarded(events(), error_body), on_close=close)
            return JSONResponse(await collect())
        except RequestError as e:
            raise APIError(str(e)) from None
        except EngineDeadError as e:
            raise APIError(str(e), 503) from None
        finally:
            if not handed_over:
                close()


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is spelt by one printable character (the
    printable Latin-1 bytes by themselves, the others by chr(256 + i) in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_chars()


class ChatRun:
    """Parses the n choices of a chat request as their updates arrive."""

    def __init__(self, ctx: ServeContext, prompt_token_ids: list[int], n: int, mode: ToolMode):
        self.prompt_token_ids = prompt_token_ids
        self.parsers = [ctx.new_parser(prompt_token_ids, mode) for _ in range(n)]
        self.max_calls = mode.max_calls
        # OpenAI ends a forced named function with "stop"; auto and required calls with "tool_calls"
        self.named = mode.forced not in (None, "required")
        self.forced = mode.forced is not None  # the output is tool calls: content null
        self.num_tokens = [0] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[int | str | None] = [None] * n
        self.num_cached_tokens = 0
        self.tool_calls_seen = [False] * n
        self.eos = {t: ctx.token_text(t) for t in ctx.client.eos_token_ids}

    def update(self, upd: Update) -> list[Delta]:
        p = self.parsers[upd.index]
        text, ids = upd.text, upd.token_ids
        if upd.finish_reason == "stop" and upd.stop_reason is None and ids:
            # the EOS that ended the answer is no text, even with include_stop_str_in_output
            # (that keeps stop strings): its marker would end up in the content or a call's JSON
            end = self.eos.get(ids[-1])
            if end and text.endswith(end):
                text = text[:-len(end)]
            ids = ids[:-1]  # (the parser lines tokens up with their text)
        deltas = p.feed(ids, text)
        self.num_tokens[upd.index] += len(upd.token_ids)
        self.num_cached_tokens = upd.num_cached_tokens
        if upd.finish_reason is not None:
            # cut by a stop string or max_tokens: an unfinished tool call becomes content
            deltas += p.finish(upd.finish_reason == "length" or isinstance(upd.stop_reason, str))
            self.finish_reasons[upd.index] = upd.finish_reason
            self.stop_reasons[upd.index] = upd.stop_reason
        if self.max_calls is not None:  # parallel_tool_calls=false: the first call only
            deltas = [d for d in deltas if not isinstance(d, ToolCallDelta) or d.index < self.max_calls]
        if any(isinstance(d, ToolCallDelta) for d in deltas):
            self.tool_calls_seen[upd.index] = True
        return deltas

    def finish_reason(self, i: int) -> str | None:
        fr = self.finish_reasons[i]
        return "tool_calls" if fr == "stop" and not self.named and self.result(i).tool_calls else fr

    def result(self, i: int) -> ParsedMessage:
        msg = self.parsers[i].result()
        if self.max_calls is not None:
            msg.tool_calls = msg.tool_calls[:self.max_calls]
        return msg

    @property
    def completion_tokens(self) -> int:
        return sum(self.num_tokens)


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: Any, event: str | None = None) -> bytes:
    data = b"data: " + msgspec.json.encode(obj) + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


SSE_DONE = b"data: [DONE]\n\n"


async def _guarded(events: AsyncIterator[bytes], error_body) -> AsyncIterator[bytes]:
    """An error after the stream began can only be reported inside it: OpenAI streams get the
    error object then `data: [DONE]`; streams of named events (Anthropic, Responses) an `error`
    event (Anthropic's error body; Responses' `{"type": "error", "code", "message", "param"}`)."""
    named = False
    try:
        async for chunk in events:
            named = named or chunk.startswith(b"event: ")
            yield chunk
    except Exception as e:
        if isinstance(e, (EngineDeadError, RequestError)):
            err = APIError(str(e), 503 if isinstance(e, EngineDeadError) else 400)
        else:
            log.exception("error while streaming a response")
            err = APIError(f"internal error: {e}", 500)
        body = error_body(err)
        if body.get("type") == "error":  # Anthropic
            yield sse(body, "error")
        elif named:  # Responses
            yield sse({**body["error"], "type": "error"}, "error")
        else:
            yield sse(body)
            yield SSE_DONE


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and abort the request, as soon as the client disconnects
    (also between chunks, e.g. during a long prefill), whatever the ASGI server's version."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
        tasks = [asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(watch())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0].done() and not tasks[0].cancelled():
                tasks[0].exception()  # retrieved (a disconnect during send ends up here)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.on_close()
            await self.body_iterator.aclose()


async def cancel_on_disconnect(receive, coro: Awaitable):
    """Run a handler; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.cancelled() or not watcher.done():
            raise  # we are being cancelled ourselves
        return Response(status_code=499)  # nobody is listening any more
