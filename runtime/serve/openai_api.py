"""OpenAI endpoints: /v1/completions, /v1/chat/completions (+ /render, /derender), /tokenize,
/detokenize. Responses and stream chunks are built by small pure functions (tested directly)."""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from ..detokenize import IncrementalDetokenizer, special_token_ids
from ..messages import LogprobsEntry
from ..parse import (ContentDelta, Delta, ParsedMessage, ReasoningDelta,
                                     ToolCallDelta)
from .client import RequestStream, Update
from .context import SSE_DONE, ChatRun, ServeContext, ToolMode, sse, usage
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DerenderRequest,
                       DetokenizeRequest, TokenizeRequest, check_generation_prompt, check_logprobs,
                       check_prompts,
                       check_token_ids, now, random_id, sampling_params, structured_from)


# ---- logprobs ---------------------------------------------------------------------------------
def chat_logprobs(ctx: ServeContext, entries: list[LogprobsEntry] | None,
                  top: int) -> dict | None:
    if entries is None:
        return None

    def item(tid, lp):
        return {"token": ctx.token_text(tid), "logprob": max(lp, -9999.0),
                "bytes": list(ctx.token_bytes(tid))}
    return {"content": [dict(item(e.token_ids[0], e.logprobs[0]), top_logprobs=[
        item(t, lp) for t, lp in zip(e.token_ids[1:top + 1], e.logprobs[1:top + 1])])
        for e in entries]}


def completion_logprobs(ctx: ServeContext, entries: list[LogprobsEntry] | None,
                        text_offset: list[int]) -> dict | None:
    """`text_offset`: where each entry's token starts in the choice's text (TokenOffsets)."""
    if entries is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": text_offset}
    for e in entries:
        text = ctx.token_text(e.token_ids[0])
        out["tokens"].append(text)
        out["token_logprobs"].append(max(e.logprobs[0], -9999.0))
        top = {ctx.token_text(t): max(lp, -9999.0) for t, lp in zip(e.token_ids[1:], e.logprobs[1:])}
        top.setdefault(text, out["token_logprobs"][-1])  # OpenAI, vLLM: the sampled one always
        out["top_logprobs"].append(top)
    return out


class TokenOffsets:
    """Where each generated token's text starts in its choice's text, the tokens detokenized one
    at a time as the output was: the byte tokens of one character (each "�" alone) all start
    where the character does, a skipped special token takes no room."""

    def __init__(self, ctx: ServeContext, prompt: list[int], skip_special_tokens: bool,
                 base: int = 0):
        self.detok = IncrementalDetokenizer(ctx.tokenizer, prompt, skip_special_tokens) \
            if ctx.tokenizer is not None else None
        self.base = base  # (echo: the prompt's text comes first)

    def span(self, token_id: int) -> tuple[int, int]:
        if self.detok is None:
            return self.base, self.base
        start = len(self.detok.text)
        self.detok.push([token_id])
        return self.base + start, self.base + len(self.detok.text)

    def starts(self, token_ids: list[int]) -> list[int]:
        return [self.span(t)[0] for t in token_ids]


def prompt_logprobs(ctx: ServeContext, entries: list[LogprobsEntry | None] | None,
                    top: int) -> list | None:
    """vLLM's `prompt_logprobs`: one entry per prompt token (the first is null), each a dict
    token id → {logprob, rank, decoded_token} with the prompt token and the top alternatives."""
    if entries is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": max(lp, -9999.0), "rank": r, "decoded_token": ctx.token_text(t)}
        for t, lp, r in zip(e.token_ids[:top + 1], e.logprobs[:top + 1], e.ranks[:top + 1])}
        for e in entries]


class AlignedLogprobs:
    """Streamed completion logprobs leave with the text their tokens produced: while the
    detokenizer holds text back (it may start a stop string, or be the first bytes of a
    character), the entries wait too, so each chunk's tokens and text_offset line up with its
    text (as they do without streaming)."""

    def __init__(self, ctx: ServeContext, offsets: TokenOffsets):
        self.ctx, self.offsets, self.pending = ctx, offsets, []
        self.sent = offsets.base

    def take(self, entries: list[LogprobsEntry] | None, text: str, final: bool) -> dict:
        self.pending += [(e, *self.offsets.span(e.token_ids[0])) for e in entries or []]
        self.sent += len(text)
        n = len(self.pending)
        if not final:
            n = sum(1 for _ in itertools.takewhile(lambda p: p[2] <= self.sent, self.pending))
            while n and self.pending[n - 1][1] == self.pending[n - 1][2] == self.sent:
                n -= 1  # (bytes of a character to come go with it)
        out, self.pending = self.pending[:n], self.pending[n:]
        return completion_logprobs(self.ctx, [e for e, _, _ in out], [s for _, s, _ in out])


# ---- echo -------------------------------------------------------------------------------------
class Echo:
    """echo=true: each prompt's text (the client's string, else its tokens decoded) and where
    each prompt token starts in it, for the logprobs of the prompt (lm-eval scores prompts so)."""

    def __init__(self, ctx: ServeContext, req: CompletionRequest, prompts: list[list[int]]):
        single = isinstance(req.prompt, str) or isinstance(req.prompt[0], int)
        given = [req.prompt] if single else list(req.prompt)
        self.ctx, self.prompts, self.texts, self.offsets = ctx, prompts, [], []
        for orig, ids in zip(given, prompts):
            detok = IncrementalDetokenizer(ctx.tokenizer, [], req.skip_special_tokens)
            offsets = []
            for t in ids:
                offsets.append(len(detok.text))
                detok.push([t])
            keep = isinstance(orig, str) and req.truncate_prompt_tokens is None
            text = orig if keep else detok.text
            if keep:  # the client's own text: its tokens' places in it, not in the decoded text
                offsets = _offsets_in(ctx, orig, ids) or offsets
            self.texts.append(text)
            self.offsets.append([min(o, len(text)) for o in offsets])
        self.top = req.logprobs
        self.generate = req.max_tokens != 0  # 0: the prompt alone (one token is run, not shown)

    def logprobs(self, i: int, entries: list[LogprobsEntry | None] | None) -> dict:
        """Prompt i's part of the completion logprobs (its first token has no logprob)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": self.offsets[i]}
        for t, e in zip(self.prompts[i], entries or [None] * len(self.prompts[i])):
            text = self.ctx.token_text(t)
            out["tokens"].append(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(e.logprobs[0], -9999.0))
            top = {self.ctx.token_text(a): max(lp, -9999.0)
                   for a, lp in zip(e.token_ids[1:self.top + 1], e.logprobs[1:self.top + 1])}
            top.setdefault(text, out["token_logprobs"][-1])
            out["top_logprobs"].append(top)
        return out


def _offsets_in(ctx: ServeContext, text: str, ids: list[int]) -> list[int] | None:
    """Where each token of a text prompt starts in that text, by the tokenizer's offset mapping
    (special-token text and spaces the decoded tokens do not give back are counted); None when
    the tokenizer gives none, or other tokens than the prompt's."""
    try:
        enc = ctx.tokenizer(text, return_offsets_mapping=True)
    except Exception:  # noqa: BLE001  (a tokenizer without offsets: the decoded text's)
        return None
    if list(enc["input_ids"]) != list(ids):
        return None
    return [start for start, _ in enc["offset_mapping"]]


def joined_logprobs(first: dict | None, then: dict | None) -> dict | None:
    if first is None or then is None:
        return first or then
    return {k: first[k] + then[k] for k in first}


# ---- completions ------------------------------------------------------------------------------
def completion_prompts(ctx: ServeContext, prompt, bounded: bool = True) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    return [ctx.encode(p, bounded) for p in prompts]


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Update]]:
    """Updates of several streams as they arrive, tagged with the stream's position."""
    if len(streams) == 1:
        async for upd in streams[0]:
            yield 0, upd
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    upd = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, upd
    finally:
        for fut in pending:
            fut.cancel()


def prepare_completion(ctx: ServeContext, req: CompletionRequest):
    """Validate the whole request (every prompt and choice) before anything is sent."""
    ctx.check_model(req.model)
    req.check_unsupported()
    ctx.check_priority(req.priority)
    if req.echo:  # the prompt comes back as text
        ctx.need_tokenizer()
    info = ctx.client.model_info
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # (0: echo alone, as vLLM)
    check_logprobs(req, info, "logprobs", "prompt_logprobs")
    prompts = completion_prompts(ctx, req.prompt, req.truncate_prompt_tokens is None)
    prompts = check_prompts(prompts, info, max_tokens, req.n, truncate=req.truncate_prompt_tokens)
    params = ctx.with_thinking(ctx.with_bad_words(sampling_params(
        req, ctx.defaults, max_tokens, req.logprobs, vocab_size=info.get("vocab_size"),
        structured=structured_from(req))), req.thinking_token_budget)
    if req.echo and req.logprobs is not None:  # the prompt's logprobs come back with it
        params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
    return prompts, params


async def create_completion(ctx: ServeContext, req: CompletionRequest):
    prompts, params = prepare_completion(ctx, req)
    echo = await ctx.run_sync(Echo, ctx, req, prompts) if req.echo else None
    lora = ctx.lora_for(req.model)
    streams = [ctx.client.generate(p, params, priority=req.priority, lora_request=lora)
               for p in prompts]
    rid, created, n = random_id("cmpl-"), now(), req.n
    num_prompt = sum(len(p) for p in prompts)

    def choice(index, text, logprobs, finish, stop_reason, token_ids=None, plps=None,
               first=False):
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
               "stop_reason": stop_reason}
        if req.prompt_logprobs is not None and (first or not req.stream):
            out["prompt_logprobs"] = prompt_logprobs(ctx, plps, req.prompt_logprobs)
        if req.return_token_ids:
            if first or not req.stream:
                out["prompt_token_ids"] = prompts[index // n]
            out["token_ids"] = token_ids
        return out

    async def collect() -> dict:
        texts = [[] for _ in range(len(prompts) * n)]
        ids = [[] for _ in texts]
        lps: list[list | None] = [[] if req.logprobs is not None else None for _ in texts]
        plps: list = [None] * len(prompts)
        ends: list = [(None, None)] * len(texts)
        tokens = cached = 0
        async for i, upd in _merge(streams):
            k = i * n + upd.index
            if upd.prompt_logprobs is not None:
                plps[i] = upd.prompt_logprobs
            if echo and not echo.generate:
                upd = Update(upd.index, "", [], [], upd.finish_reason, upd.stop_reason,
                             upd.num_cached_tokens)
            texts[k].append(upd.text)
            ids[k] += upd.token_ids
            if upd.logprobs is not None and lps[k] is not None:
                lps[k].extend(upd.logprobs)
            tokens += len(upd.token_ids)
            cached = max(cached, upd.num_cached_tokens)
            if upd.finish_reason:
                ends[k] = (upd.finish_reason, upd.stop_reason)
        choices = []
        for k, t in enumerate(texts):
            head = echo.texts[k // n] if echo else ""
            lp = None
            if lps[k] is not None:
                spans = TokenOffsets(ctx, prompts[k // n], req.skip_special_tokens, len(head))
                starts = await ctx.run_sync(spans.starts, [e.token_ids[0] for e in lps[k]])
                lp = completion_logprobs(ctx, lps[k], starts)
            if echo and lp is not None:
                lp = joined_logprobs(echo.logprobs(k // n, plps[k // n]), lp)
            choices.append(choice(k, head + "".join(t), lp, *ends[k], ids[k], plps[k // n]))
        return {"id": rid, "object": "text_completion", "created": created,
                "model": ctx.served_name(req.model), "choices": choices,
                "usage": usage(num_prompt, tokens, cached)}

    async def events():
        aligned = [AlignedLogprobs(ctx, TokenOffsets(ctx, prompts[k // n], req.skip_special_tokens,
                                                     len(echo.texts[k // n]) if echo else 0))
                   for k in range(len(prompts) * n) if req.logprobs is not None]
        started = [False] * (len(prompts) * n)
        plps: list = [None] * len(prompts)
        tokens = cached = 0
        counts = [0] * len(started)  # tokens of each choice so far

        def usage_so_far(k) -> dict:  # OpenAI: null until the last chunk; vLLM's continuous
            if req.continuous_usage:
                return {"usage": usage(len(prompts[k // n]), counts[k], cached)}
            return {"usage": None} if req.include_usage else {}
        async for i, upd in _merge(streams):
            k = i * n + upd.index
            if upd.prompt_logprobs is not None:
                plps[i] = upd.prompt_logprobs
            if echo and not echo.generate:
                upd = Update(upd.index, "", [], [], upd.finish_reason, upd.stop_reason,
                             upd.num_cached_tokens)
            tokens += len(upd.token_ids)
            counts[k] += len(upd.token_ids)
            cached = max(cached, upd.num_cached_tokens)
            lp = aligned[k].take(upd.logprobs, upd.text, upd.finish_reason is not None) \
                if req.logprobs is not None else None
            first = not started[k]
            if not upd.text and not upd.finish_reason and not (lp and lp["tokens"]) \
                    and not (req.return_token_ids and upd.token_ids) and not (echo and first):
                continue
            started[k] = True
            text = upd.text
            if echo and first:  # the prompt leads the choice's first chunk
                text = echo.texts[i] + text
                if lp is not None:
                    lp = joined_logprobs(echo.logprobs(i, plps[i]), lp)
            yield sse({"id": rid, "object": "text_completion", "created": created,
                       "model": ctx.served_name(req.model), **usage_so_far(k),
                       "choices": [choice(k, text, lp, upd.finish_reason, upd.stop_reason,
                                          upd.token_ids, plps[i], first)]})
        if req.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created,
                       "model": ctx.served_name(req.model), "choices": [],
                       "usage": usage(num_prompt, tokens, cached)})
        yield SSE_DONE

    return await ctx.respond(streams, req.stream, collect, events)


# ---- chat -------------------------------------------------------------------------------------
def prepare_chat(ctx: ServeContext, req: ChatCompletionRequest) -> tuple[list[int], ToolMode]:
    """Render and validate the whole request before anything is sent."""
    ctx.check_model(req.model)
    req.check_unsupported()
    ctx.check_priority(req.priority)
    mode = ctx.tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls)
    tools = ctx.prompt_tools(req.tools, req.tool_choice == "none")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # as for the Responses API's reasoning.effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort not in ("none", "minimal"))
    ids = ctx.render_chat(req.messages, tools, kwargs,
                          req.add_generation_prompt and not req.continue_final_message,
                          req.continue_final_message, req.chat_template,
                          bounded=req.truncate_prompt_tokens is None)
    tokens_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    [ids] = check_prompts([ids], ctx.client.model_info, req.max_completion_tokens or req.max_tokens,
                          req.n, "messages", tokens_param, req.truncate_prompt_tokens)
    return ids, mode


def chat_sampling_params(ctx: ServeContext, req: ChatCompletionRequest, run_parser,
                         mode: ToolMode, prompt_ids: list[int]) -> object:
    if req.top_logprobs and not req.logprobs:  # (0 asks nothing: no error, as vLLM)
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    check_logprobs(req, ctx.client.model_info, "top_logprobs", "prompt_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured = structured_from(req)
    if structured is not None and mode.structured() is not None:
        raise APIError("the tools constrain the output already (tool_choice required / named, or "
                       "strict tools); drop response_format / structured_outputs", param="tool_choice")
    structured = ctx.constraint(structured or mode.structured(), prompt_ids)
    return ctx.with_thinking(ctx.with_bad_words(sampling_params(
        req, ctx.defaults, req.max_completion_tokens or req.max_tokens, logprobs, run_parser,
        ctx.client.model_info.get("vocab_size"), structured)), req.thinking_token_budget)


def echo_text(req: ChatCompletionRequest) -> str:
    """`echo` (vLLM): the last message's content is prepended when it is the assistant's own
    (the answer continues it)."""
    last = req.messages[-1]
    if not req.echo or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def message_dict(msg: ParsedMessage) -> dict:
    out = {"role": "assistant", "content": msg.content}
    if msg.content is None and msg.reasoning is None and not msg.tool_calls:
        out["content"] = ""  # an empty answer (stop or EOS at once): "" as OpenAI's, not null
    if msg.reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in msg.tool_calls]
    return out


def delta_dict(deltas: list[Delta]) -> dict:
    """One chunk's `delta` from the parser's deltas of one update."""
    out: dict = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            out["content"] = out.get("content", "") + d.text
        elif isinstance(d, ReasoningDelta):
            out["reasoning"] = out["reasoning_content"] = out.get("reasoning", "") + d.text
        elif isinstance(d, ToolCallDelta):
            call: dict = {"index": d.index}
            if d.id is not None:
                call.update(id=d.id, type="function")
            call["function"] = {"arguments": d.arguments}
            if d.name is not None:
                call["function"]["name"] = d.name
            out.setdefault("tool_calls", []).append(call)
    return out


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None,
               stop_reason=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}


async def chat_events(ctx: ServeContext, run: ChatRun, stream: RequestStream, rid: str,
                      created: int, top: int | None, req: ChatCompletionRequest
                      ) -> AsyncIterator[bytes]:
    """SSE chunks of a streamed chat completion: a role chunk per choice (with the echo), then
    one chunk per update that says something, the last one with finish_reason; usage; [DONE]."""
    n = len(run.parsers)

    def extra(i) -> dict:  # OpenAI: usage null until the last chunk; vLLM's continuous: so far
        if req.continuous_usage:
            return {"usage": usage(len(run.prompt_token_ids), run.num_tokens[i],
                                   run.num_cached_tokens)}
        return {"usage": None} if req.include_usage else {}

    def chunk(i, delta, finish=None, lp=None, stop=None, **more) -> bytes:
        c = chat_chunk(rid, created, ctx.served_name(req.model), i, delta, finish, lp, stop)
        c["choices"][0].update(more)
        return sse({**c, **extra(i)})
    head = {"prompt_token_ids": run.prompt_token_ids} if req.return_token_ids else {}
    if req.prompt_logprobs is not None:
        head["prompt_logprobs"] = prompt_logprobs(ctx, (await stream.peek()).prompt_logprobs,
                                                  req.prompt_logprobs)
    echo = echo_text(req)
    for i in range(n):
        yield sse({**chat_chunk(rid, created, ctx.served_name(req.model), i,
                                {"role": "assistant", "content": None if run.forced else ""}),
                   **head, **extra(i)})
        if echo:
            yield chunk(i, {"content": echo})
    held: list[list] = [[] for _ in range(n)]  # logprobs of tokens whose text is held back
    ids = {"token_ids": []} if req.return_token_ids else {}
    async for upd in stream:
        delta = delta_dict(run.update(upd))
        if top is not None and upd.logprobs:
            held[upd.index].extend(upd.logprobs)
        finish = run.finish_reason(upd.index) if upd.finish_reason else None
        if req.return_token_ids:
            ids = {"token_ids": upd.token_ids}
        if not delta and finish is None and not (ids and upd.token_ids):
            continue
        lp = chat_logprobs(ctx, held[upd.index], top) if top is not None else None
        held[upd.index] = []
        if finish is not None and "tool_calls" in delta:
            # the finish_reason in a chunk of its own, as OpenAI: the SDK's stream helper closes
            # a call (tool_calls.function.arguments.done) on the chunk after its last delta
            yield chunk(upd.index, delta, None, lp, **ids)
            delta, lp, ids = {}, None, {"token_ids": []} if ids else {}
        yield chunk(upd.index, delta, finish, lp, upd.stop_reason if finish else None, **ids)
    if req.include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": ctx.served_name(req.model), "choices": [],
                   "usage": usage(len(run.prompt_token_ids), run.completion_tokens,
                                  run.num_cached_tokens)})
    yield SSE_DONE


async def create_chat_completion(ctx: ServeContext, req: ChatCompletionRequest):
    prompt_ids, mode = prepare_chat(ctx, req)
    run = ChatRun(ctx, prompt_ids, req.n, mode)
    params = chat_sampling_params(ctx, req, run.parsers[0], mode, prompt_ids)
    stream = ctx.client.generate(prompt_ids, params, priority=req.priority,
                                 lora_request=ctx.lora_for(req.model))
    rid, created = random_id("chatcmpl-"), now()
    top = (req.top_logprobs or 0) if req.logprobs else None
    echo = echo_text(req)

    async def collect() -> dict:
        lps = [[] for _ in range(req.n)]
        ids = [[] for _ in range(req.n)]
        plps = None
        async for upd in stream:
            run.update(upd)
            ids[upd.index] += upd.token_ids
            plps = upd.prompt_logprobs if upd.prompt_logprobs is not None else plps
            if top is not None and upd.logprobs:
                lps[upd.index].extend(upd.logprobs)
        choices = []
        for i in range(req.n):
            msg = message_dict(run.result(i))
            if echo:
                msg["content"] = echo + (msg["content"] or "")
            choices.append({"index": i, "message": msg,
                            "logprobs": chat_logprobs(ctx, lps[i], top) if top is not None
                            else None, "finish_reason": run.finish_reason(i),
                            "stop_reason": run.stop_reasons[i]})
            if req.return_token_ids:
                choices[-1]["token_ids"] = ids[i]
        out = {"id": rid, "object": "chat.completion", "created": created,
               "model": ctx.served_name(req.model), "choices": choices,
               "usage": usage(len(prompt_ids), run.completion_tokens, run.num_cached_tokens)}
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(ctx, plps, req.prompt_logprobs)
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out

    return await ctx.respond([stream], req.stream, collect,
                             lambda: chat_events(ctx, run, stream, rid, created, top, req))


# ---- render / derender / tokenize -------------------------------------------------------------
def render_chat(ctx: ServeContext, req: ChatCompletionRequest) -> dict:
    ids, _ = prepare_chat(ctx, req)
    return {"model": ctx.model_name, "prompt_token_ids": ids, "prompt": ctx.tokenizer.decode(ids)}


def render_completion(ctx: ServeContext, req: CompletionRequest) -> dict:
    prompts, _ = prepare_completion(ctx, req)
    return {"model": ctx.model_name,
            "prompts": [{"prompt_token_ids": ids,
                         "prompt": ctx.tokenizer.decode(ids) if ctx.tokenizer else None}
                        for ids in prompts]}


def derender(ctx: ServeContext, req: DerenderRequest) -> dict:
    """Token ids of a model answer → the message the API would return for them."""
    ctx.check_model(req.model)
    ctx.need_tokenizer()
    vocab = ctx.client.model_info.get("vocab_size") or len(ctx.tokenizer)
    check_token_ids(req.token_ids, vocab, "token_ids")
    check_token_ids(req.prompt_token_ids or [], vocab, "prompt_token_ids")
    parser = ctx.new_parser(req.prompt_token_ids or [], ToolMode(parse=bool(ctx.args.tool_call_parser)))
    ids = list(req.token_ids)
    eos = set(ctx.client.eos_token_ids)
    finish = "length"
    if ids and ids[-1] in eos:  # the answer ended: its EOS is no text
        ids, finish = ids[:-1], "stop"
    kept = getattr(parser, "marker_token_ids", None)  # (special tokens skipped but these)
    if kept is not None:
        dropped = special_token_ids(ctx.tokenizer._tokenizer if hasattr(ctx.tokenizer, "_tokenizer")
                                    else ctx.tokenizer) - set(kept)
        ids = [t for t in ids if t not in dropped]
    text = ctx.tokenizer.decode(ids, skip_special_tokens=kept is None)
    parser.feed(ids, text)
    parser.finish()
    msg = parser.result()
    if finish == "stop" and msg.tool_calls:
        finish = "tool_calls"
    return {"model": ctx.model_name, "message": message_dict(msg), "finish_reason": finish}


def tokenize(ctx: ServeContext, req: TokenizeRequest) -> dict:
    ctx.check_model(req.model)
    ctx.need_tokenizer()
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        check_generation_prompt(req)
        ids = ctx.render_chat(req.messages, req.tools, req.chat_template_kwargs,
                              req.add_generation_prompt and not req.continue_final_message,
                              req.continue_final_message, req.chat_template)
    else:
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": ctx.client.model_info.get("max_model_len"),
            "tokens": list(ids)}


def detokenize(ctx: ServeContext, req: DetokenizeRequest) -> dict:
    ctx.check_model(req.model)
    ctx.need_tokenizer()
    check_token_ids(req.tokens, ctx.client.model_info.get("vocab_size") or len(ctx.tokenizer),
                    "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


def model_card(ctx: ServeContext, model_id: str | None = None) -> dict:
    """GET /v1/models/{id} (openai's models.retrieve); 404 for other ids."""
    ctx.check_model(model_id)
    lora = ctx.lora_for(model_id)
    if lora is not None:  # an adapter: a model whose parent is the base model
        return {"id": lora.lora_name, "object": "model", "created": now(), "owned_by": "rankserve",
                "root": lora.lora_path, "parent": lora.base_model_name or ctx.model_name,
                "max_model_len": ctx.client.model_info.get("max_model_len")}
    name = model_id if model_id in ctx.model_names else ctx.model_name
    return {"id": name, "object": "model", "created": now(), "owned_by": "rankserve",
            "root": ctx.model_path, "parent": None,
            "max_model_len": ctx.client.model_info.get("max_model_len")}


# ---- LoRA adapters at runtime (vLLM's endpoints) ------------------------------------------------
def load_lora_adapter(ctx: ServeContext, req, problem: str = "") -> str:
    """`problem`: the engine's objection to the adapter's tensors ("" if they fit the model)."""
    if not ctx.lora_enabled:
        raise APIError("LoRA is not enabled: start the server with --enable-lora", param="lora_name")
    if req.lora_name in (*ctx.model_names, ctx.model_path):
        raise APIError(f"`{req.lora_name}` is the base model's name", param="lora_name")
    if problem:
        raise APIError(problem, param="lora_path")
    try:
        ctx.loras.add(req.lora_name, req.lora_path, req.base_model_name)
    except ValueError as e:
        raise APIError(str(e), param="lora_path") from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


def unload_lora_adapter(ctx: ServeContext, req) -> str:
    """Requests already running keep their adapter (they carry it to every rank); new requests
    naming it get 404."""
    try:
        ctx.loras.remove(req.lora_name)
    except KeyError:
        raise APIError(f"The LoRA adapter `{req.lora_name}` does not exist.", 404, "lora_name",
                       "model_not_found") from None
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
