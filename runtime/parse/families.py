"""The parser families, as tables for the engine, and `make_parser`, which maps the server flags
(--reasoning-parser, --tool-call-parser) onto one StreamingParser."""
from __future__ import annotations

from dataclasses import dataclass

import msgspec
from typing import Any, Callable

from ...models.registry import Registry
from .engine import StreamingParser
from .grammar import Piece, Rule, State, Terminal, combine
from .types import mistral_tool_call_id, new_tool_call_id


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of a single special token, or None if the tokenizer has no such token."""
    if tokenizer is None:
        return None
    inner = getattr(getattr(tokenizer, "instruct_tokenizer", None), "tokenizer", None)
    if inner is not None:  # mistral-common
        try:
            return inner.get_special_token(text)
        except Exception:
            return None
    tid = tokenizer.convert_tokens_to_ids(text)
    return tid if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == text else None


def decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """Token ids -> text with special tokens kept, as the detokenizer feeding a parser gives it."""
    if tokenizer is None:
        return None
    inner = getattr(getattr(tokenizer, "instruct_tokenizer", None), "tokenizer", None)
    if inner is not None:  # mistral-common
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        return lambda ids: inner.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)


def _t(tokenizer: Any, text: str) -> Terminal:
    return Terminal(text, token_id(tokenizer, text))


def think_tags(tok: Any) -> Piece:
    return Piece({"content": State("content", (Rule(_t(tok, "<think>"), "reasoning"),)),
                  "reasoning": State("reasoning", (Rule(_t(tok, "</think>"), "content"),))})


def hermes_tools(tok: Any) -> Piece:
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated
    return Piece({"content": State("content", (Rule(_t(tok, "<tool_call>"), "call"),)),
                  "call": State("tool_json", (Rule(_t(tok, "</tool_call>"), "content"),))})


def llama3_json_tools(tok: Any) -> Piece:
    # the whole output is {"name": ..., "parameters": {...}} (optionally after <|python_tag|>),
    # several joined by ";"; output that starts otherwise is content
    calls, semi = "calls", Terminal(";")
    return Piece({
        "start": State("content", (Rule(_t(tok, "<|python_tag|>"), calls),
                                   Rule(Terminal("{"), calls, consume=False)), other="content"),
        calls: State("tool_json", after="between"),
        "between": State("none", (Rule(semi, calls),), other="content"),
    }, entry="start")


def mistral_tools(tok: Any) -> Piece:
    calls = _t(tok, "[TOOL_CALLS]")
    args = _t(tok, "[ARGS]")
    if args.token_id is None:  # v2/v3: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
        return Piece({"content": State("content", (Rule(calls, "calls"),)),
                      "calls": State("tool_json", json="list", after="content")})
    # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated; v11 writes [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
    return Piece({"content": State("content", (Rule(calls, "name"),)),
                  "name": State("tool_name", (Rule(args, "args"), Rule(_t(tok, "[CALL_ID]"), "id"))),
                  "id": State("tool_id", (Rule(args, "args"),)),
                  "args": State("tool_args", after="between"),
                  "between": State("none", (Rule(calls, "name"),), other="content")})


def deepseek_v31_tools(tok: Any) -> Piece:
    # <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>name<｜tool▁sep｜>{args}<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>
    # and V3 / R1's call: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{args}\n```<｜tool▁call▁end｜>
    t = {k: _t(tok, f"<｜tool▁{k}｜>")
         for k in ("calls▁begin", "calls▁end", "call▁begin", "call▁end", "sep")}
    v3 = Terminal(t["call▁begin"].text + "function" + t["sep"].text)
    return Piece({
        "content": State("content", (Rule(t["calls▁begin"], "calls"),)),
        "calls": State("none", (Rule(t["call▁begin"], "name"), Rule(v3, "v3_name"),
                                Rule(t["calls▁end"], "content"))),
        "name": State("tool_name", (Rule(t["sep"], "args"),)),
        "args": State("tool_args", (Rule(t["call▁end"], "calls"),)),
        "v3_name": State("tool_name", (Rule(Terminal("\n```json\n"), "v3_args"),)),
        "v3_args": State("tool_args", (Rule(Terminal("\n```"), "v3_end"),)),
        "v3_end": State("none", (Rule(t["call▁end"], "calls"),)),
    })


@dataclass(frozen=True)
class Family:
    reasoning: Callable[[Any], Piece] | None
    tools: Callable[[Any], Piece] | None
    call_id: Callable[[], str] = new_tool_call_id  # a new tool call's id


PARSERS: Registry[Family] = Registry("parser")
PARSERS.register("qwen3", "hermes")(Family(think_tags, hermes_tools))
PARSERS.register("llama3_json")(Family(None, llama3_json_tools))
PARSERS.register("mistral")(Family(None, mistral_tools, mistral_tool_call_id))
PARSERS.register("deepseek_v3", "deepseek_v31")(Family(think_tags, deepseek_v31_tools))
# DeepSeek-R1 (vLLM's --reasoning-parser name): <think>...</think>, the opening tag either
# generated or already in the prompt (make_parser decides from the prompt); its tool calls are
# --tool-call-parser deepseek_v3's (as in vLLM)
PARSERS.register("deepseek_r1")(Family(think_tags, None))


ANSWER_SEP = "\n\n"  # what the templates (Qwen3, DeepSeek-R1) put between </think> and the answer


def reasoning_tags(tokenizer: Any, reasoning_parser: str) -> tuple[int | None, int | None]:
    """(opening, closing) tag token ids of a parser's reasoning block."""
    fam = PARSERS.get(reasoning_parser)
    if fam.reasoning is None:
        raise ValueError(f"parser {reasoning_parser!r} has no reasoning format")
    piece = fam.reasoning(tokenizer)
    return (piece.states["content"].rules[0].on.token_id,
            piece.states["reasoning"].rules[0].on.token_id)


def with_thinking_tags(params, tokenizer: Any, reasoning_parser: str = "qwen3"):
    """SamplingParams with a thinking_token_budget get the tags the engine needs: the opening
    tag, and the sequence forced once the budget is spent (the closing tag, then the answer's
    separator unless a structured output constrains the answer). Unchanged where the tokenizer
    has no such tags (the engine then refuses the budget)."""
    if params.thinking_token_budget is None or params.thinking_end_token_ids or tokenizer is None:
        return params
    start, end = reasoning_tags(tokenizer, reasoning_parser)
    if end is None:
        return params
    sep = [] if params.structured_outputs else tokenizer.encode(ANSWER_SEP, add_special_tokens=False)
    return msgspec.structs.replace(params, thinking_start_token_id=start,
                                   thinking_end_token_ids=[end, *sep])


def prompt_opens_reasoning(tokenizer: Any, reasoning_parser: str, prompt_token_ids: list[int]) -> bool:
    """Whether the generation prompt itself opened the reasoning block: its opening tag after the
    last turn marker (any other special token). A tag in a user's text, or an earlier turn's
    closed block, says nothing about this turn."""
    opener, closer = reasoning_tags(tokenizer, reasoning_parser)
    turn_marks = set(getattr(tokenizer, "all_special_ids", None) or ())
    for t in reversed(prompt_token_ids):
        if t == opener:
            return True
        if t == closer or t in turn_marks:
            return False
    return False


def make_parser(tokenizer: Any, tool_parser: str | None = None,
                reasoning_parser: str | None = None, *, starts_in_reasoning: bool | None = None,
                prompt_token_ids: list[int] | None = None) -> StreamingParser:
    """One parser per request. `starts_in_reasoning=None` decides from the prompt: when the chat
    template already opened the reasoning block (<think> after the last </think>), the output
    starts inside it."""
    reasoning = tools = None
    new_id = new_tool_call_id
    if reasoning_parser:
        fam = PARSERS.get(reasoning_parser)
        if fam.reasoning is None:
            raise ValueError(f"parser {reasoning_parser!r} has no reasoning format")
        reasoning = fam.reasoning(tokenizer)
    if tool_parser:
        fam = PARSERS.get(tool_parser)
        if fam.tools is None:
            raise ValueError(f"parser {tool_parser!r} has no tool-call format")
        tools, new_id = fam.tools(tokenizer), fam.call_id
    grammar = combine(reasoning, tools)
    start = None
    if reasoning is not None:
        if starts_in_reasoning is None and prompt_token_ids:
            starts_in_reasoning = prompt_opens_reasoning(tokenizer, reasoning_parser,
                                                         prompt_token_ids)
        if starts_in_reasoning:
            start = "reasoning"
    return StreamingParser(grammar, start, decoder(tokenizer), new_id)
