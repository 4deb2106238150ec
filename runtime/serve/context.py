"""What every endpoint shares: the tokenizer, renderer and parser settings, the engine client,
and the plumbing from a RequestStream to an HTTP response (JSON, or SSE that aborts the request
when the client goes away)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..parse import ContentDelta, Delta, ParsedMessage, ToolCallDelta, make_parser
from ..render import get_renderer
from .args import ServerArgs
from .client import (EngineClient, EngineDeadError, RequestError,
                                            RequestStream, Update)
from .protocol import APIError

log = logging.getLogger("rankserve.serve")


class PlainParser:
    """No --tool-call-parser / --reasoning-parser (or tool_choice none without reasoning): all
    output is content, detokenized as the request asks."""
    skip_special_tokens = None

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


class ServeContext:
    def __init__(self, args: ServerArgs, model_name: str, model_path: str, tokenizer,
                 client: EngineClient, model_type: str | None = None,
                 generation_defaults: dict | None = None):
        self.args, self.model_name, self.model_path = args, model_name, model_path
        self.tokenizer, self.client = tokenizer, client
        self.defaults = generation_defaults or {}
        self.renderer = get_renderer(args.renderer, tokenizer, model_type,
                                     args.chat_template) if tokenizer else None
        if args.tool_call_parser or args.reasoning_parser:  # fail at startup on unknown names
            make_parser(tokenizer, args.tool_call_parser, args.reasoning_parser)
        self._token_text: dict[int, str] = {}
        self._anchor: list[int] | None = None

    # ---- requests ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.model_path):
            raise APIError(f"The model `{name}` does not exist.", 404, "model", "model_not_found")

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: only token-id prompts are served")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.need_tokenizer()
        try:
            return self.renderer.render_completion(prompt) if self.renderer else list(prompt)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

    def render_chat(self, messages: list[dict], tools: list[dict] | None,
                    template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template: str | None = None) -> list[int]:
        self.need_tokenizer()
        try:
            return self.renderer.render_chat(messages, tools, template_kwargs,
                                             add_generation_prompt, continue_final_message,
                                             chat_template)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def tools_enabled(self, tools: list | None, tool_choice: Any) -> bool:
        """Whether the output is parsed for tool calls; refuses the choices we cannot honour."""
        if not tools or tool_choice == "none":
            return False
        if tool_choice in (None, "auto"):
            if not (self.args.enable_auto_tool_choice and self.args.tool_call_parser):
                raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                               '--tool-call-parser to be set', param="tool_choice")
            return True
        raise APIError(f"tool_choice {json.dumps(tool_choice)} is not supported yet (it needs "
                       "guided decoding); use 'auto' or 'none'", param="tool_choice")

    def new_parser(self, prompt_token_ids: list[int], tools_on: bool):
        tool = self.args.tool_call_parser if tools_on else None
        if not (tool or self.args.reasoning_parser):
            return PlainParser()
        return make_parser(self.tokenizer, tool, self.args.reasoning_parser,
                           prompt_token_ids=prompt_token_ids)

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


class ChatRun:
    """Parses the n choices of a chat request as their updates arrive."""

    def __init__(self, ctx: ServeContext, prompt_token_ids: list[int], n: int, tools_on: bool):
        self.prompt_token_ids = prompt_token_ids
        self.parsers = [ctx.new_parser(prompt_token_ids, tools_on) for _ in range(n)]
        self.num_tokens = [0] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[int | str | None] = [None] * n
        self.num_cached_tokens = 0
        self.tool_calls_seen = [False] * n

    def update(self, upd: Update) -> list[Delta]:
        p = self.parsers[upd.index]
        deltas = p.feed(upd.token_ids, upd.text)
        self.num_tokens[upd.index] += len(upd.token_ids)
        self.num_cached_tokens = upd.num_cached_tokens
        if upd.finish_reason is not None:
            # cut by a stop string or max_tokens: an unfinished tool call is dropped
            deltas += p.finish(upd.finish_reason == "length" or isinstance(upd.stop_reason, str))
            self.finish_reasons[upd.index] = upd.finish_reason
            self.stop_reasons[upd.index] = upd.stop_reason
        if any(isinstance(d, ToolCallDelta) for d in deltas):
            self.tool_calls_seen[upd.index] = True
        return deltas

    def finish_reason(self, i: int) -> str | None:
        fr = self.finish_reasons[i]
        return "tool_calls" if fr == "stop" and self.result(i).tool_calls else fr

    def result(self, i: int) -> ParsedMessage:
        return self.parsers[i].result()

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
    """An error after the stream began can only be reported inside it."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:  # noqa: BLE001
        if isinstance(e, (EngineDeadError, RequestError)):
            err = APIError(str(e), 503 if isinstance(e, EngineDeadError) else 400)
        else:
            log.exception("error while streaming a response")
            err = APIError(f"internal error: {e}", 500)
        body = error_body(err)
        yield sse(body, "error" if body.get("type") == "error" else None)  # Anthropic names it


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
