"""The one streaming parser engine: it walks a Grammar (grammar.py) over the model's output as
it arrives and turns it into content / reasoning / tool-call deltas.

Input contract: `feed(token_ids, text)` gets the new token ids and their detokenized text with
the parser's marker tokens kept (`marker_token_ids`), since markers such as <tool_call> or
[TOOL_CALLS] are special tokens. Feeding the same output in any chunking gives the same result."""
from __future__ import annotations

import re
from collections.abc import Callable

from .calls import CallReader
from .grammar import TEXT_KINDS, TOOL_KINDS, Grammar, Rule, State
from .types import (ContentDelta, Delta, ParsedMessage, ReasoningDelta,
                                           ToolCall, ToolCallDelta, new_tool_call_id)

_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


class _Call:
    def __init__(self, index: int, id: str, name: str):
        self.index, self.id, self.name, self.args = index, id, name, []


class StreamingParser:
    def __init__(self, grammar: Grammar, start: str | None = None,
                 decode: Callable[[list[int]], str] | None = None,
                 new_id: Callable[[], str] = new_tool_call_id):
        self.g = grammar
        self._new_id = new_id  # the tool-call id format
        self.state = start or grammar.entry
        self.buf = ""  # received text not yet consumed
        self._base = 0  # characters consumed before buf
        self._id_terms = {t.token_id: t.text for t in grammar.terminals if t.token_id is not None}
        # where the special tokens' texts are: output positions (`_marks`), found with `decode`
        # (token ids -> text, special tokens kept) when a feed holds the token and the text after
        # it; otherwise only counted (`_pending`: the next occurrences of the text are the token)
        self._decode = decode
        self._marks: dict[int, set[int]] = {}
        self._pending: dict[int, int] = {}
        self._out: list[Delta] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []
        # drop whitespace right after a terminal (a prompt-opened block counts as one); the
        # output's own leading and trailing whitespace is content and stays
        self._lstrip = start is not None
        self._held_ws = ""  # trailing whitespace, dropped if a terminal follows
        self._raw: str | None = None  # text of the tool region so far; None outside one
        self._call: _Call | None = None
        self._early_args: list[str] = []  # arguments seen before the name
        self._reader: CallReader | None = None
        self._name = ""
        self._index = 0
        self._next: str | None = None  # set by a handler: move to this state
        self._broken = False  # set by a handler: the tool call is not valid
        self._raw_skip = 0  # characters of the text being consumed that belong to an ended call

    @property
    def marker_token_ids(self) -> list[int]:
        """The tokens the detokenizer feeding this parser must keep (its markers): its text
        needs them even when special; other special tokens may be skipped."""
        return list(self._id_terms)

    # public API -----------------------------------------------------------------------------
    def feed(self, token_ids: list[int], text: str) -> list[Delta]:
        at = self._base + len(self.buf)
        tail, end = "", len(token_ids)  # the text after the token at hand, from the last one back
        for j in reversed(range(len(token_ids))):
            t = token_ids[j]
            if t not in self._id_terms:
                continue
            if tail is not None and j + 1 < end:  # (decoded piecewise between special tokens)
                tail = None if self._decode is None else self._decode(token_ids[j + 1:end]) + tail
            marker, end = self._id_terms[t], j
            pos = self._locate(text, marker, tail)
            if pos is None:
                self._pending[t] = self._pending.get(t, 0) + 1
            else:
                self._marks.setdefault(t, set()).add(at + pos)
            tail = None if tail is None else marker + tail
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self, truncated: bool = False) -> list[Delta]:
        """End of output. An unfinished tool call, whether the model stopped there or the output
        was cut (`truncated`: stop string, max_tokens), is given back as content, as vLLM's
        parsers do: the text is never lost (finish_reason tells the client it was cut)."""
        self._run(final=True)
        st = self.g.states[self.state]
        if st.emit in TOOL_KINDS:
            if st.emit == "tool_args" and self._reader is not None:
                for act in self._reader.finish():
                    self._act(act)
            complete = self._reader is not None and self._reader.done and self._call is None
            if self._broken or not complete:
                self._break()
        elif st.emit in TEXT_KINDS and self._held_ws:  # no terminal followed: it is text
            cls = ContentDelta if st.emit == "content" else ReasoningDelta
            self._emit(cls(self._held_ws))
            self._held_ws = ""
        return self._take()

    def result(self) -> ParsedMessage:
        return ParsedMessage("".join(self._content) or None, "".join(self._reasoning) or None,
                             list(self.tool_calls))

    @staticmethod
    def _locate(text: str, marker: str, tail: str | None) -> int | None:
        """Where in `text` a special token is, given the text of the tokens after it in this feed
        (a plain spelling of its text elsewhere in the feed is not it); None if the text does not
        show it so (held back by the detokenizer, or no decoder: `tail` None)."""
        if tail is None:
            return None
        pos = len(text) - len(tail) - len(marker)
        if pos >= 0 and text.startswith(marker, pos) and text.endswith(tail):
            return pos
        return None

    def _token_at(self, tid: int, text: str) -> int:
        """Index in buf of the first occurrence of special token `tid`, or -1."""
        found = [m - self._base for m in self._marks.get(tid, ())]
        if self._pending.get(tid):
            found.append(self.buf.find(text))
        found = [i for i in found if i >= 0]
        return min(found) if found else -1

    # the walk -------------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while self.buf:
            st = self.g.states[self.state]
            pos, rule, hold = self._find(st, final)
            limit = pos if rule else hold
            n = self._handle(st, self.buf[:limit])
            self._consume(n)
            if self._broken:
                self._break()
                continue
            if self._next:
                self._enter(self._next)
                continue
            if n < limit:  # the handler stopped early (a tool call's JSON ended): look again
                continue
            if rule is None:
                return
            self._transition(st, rule)

    def _find(self, st: State, final: bool) -> tuple[int, Rule | None, int]:
        """Earliest terminal of this state in the buffer, and where a literal terminal might be
        starting at the end of the buffer (text from there on waits for more)."""
        best, best_rule, hold = len(self.buf), None, len(self.buf)
        # a finished call's closing marker also counts as plain text: a constrained call (a
        # strict tool's structural tag) ends with the marker's text, in whatever tokens
        closed = self._reader is not None and self._reader.done and self._call is None
        for rule in st.rules:
            t = rule.on
            literal = t.token_id is None or (closed and st.emit in TOOL_KINDS)
            i = self.buf.find(t.text) if literal else self._token_at(t.token_id, t.text)
            if i >= 0 and (i < best or (i == best and best_rule and len(t.text) > len(best_rule.on.text))):
                best, best_rule = i, rule
            if literal and not final:
                for k in range(min(len(t.text) - 1, len(self.buf)), 0, -1):
                    if self.buf.endswith(t.text[:k]):
                        hold = min(hold, len(self.buf) - k)
                        break
        if best_rule is not None and hold <= best:  # a longer literal may be starting there
            best_rule = None
        return best, best_rule, hold

    def _consume(self, n: int) -> None:
        eaten, self.buf = self.buf[:n], self.buf[n:]
        self._base += n
        skip, self._raw_skip = self._raw_skip, 0  # the part of `eaten` that ended a call
        for tid, text in self._id_terms.items():
            marks = self._marks.get(tid)
            gone = 0
            if marks:
                kept = {m for m in marks if m >= self._base}
                gone, self._marks[tid] = len(marks) - len(kept), kept
            if self._pending.get(tid) and text in eaten:
                self._pending[tid] = max(0, self._pending[tid] - (eaten.count(text) - gone))
        if self._raw is not None:
            self._raw += eaten[skip:]

    def _transition(self, st: State, rule: Rule) -> None:
        if st.emit == "tool_name":
            if _NAME.fullmatch(self._name.strip()):
                self._start_call(self._name.strip())
            else:
                self._broken = True
        elif st.emit in ("tool_args", "tool_json") and not (self._reader.done and self._call is None):
            self._broken = True
        if self._broken:  # the terminal is then read again as plain content
            self._break()
            return
        if self.g.states[rule.to].emit not in TEXT_KINDS and self._raw is None:
            self._raw = self._held_ws  # so a broken call gives back its text exactly
        if rule.consume:
            self._consume(len(rule.on.text))
        if st.emit in ("tool_args", "tool_json"):  # the call is complete: its end marker is
            self._raw = ""  # its own, never text to give back if what follows breaks
        self._enter(rule.to)

    def _enter(self, name: str) -> None:
        self.state, self._next = name, None
        self._lstrip, self._held_ws, self._reader = True, "", None
        st = self.g.states[name]
        if st.emit in TEXT_KINDS:
            self._raw = None
        elif st.emit == "tool_json":
            self._reader = CallReader(st.json)
        elif st.emit == "tool_args":
            self._reader = CallReader("args")
        elif st.emit == "tool_name":
            self._name = ""

    def _break(self) -> None:
        """Give the tool region's text back as content and continue in plain content."""
        raw = self._raw or ""
        self._raw, self._call, self._reader, self._broken = None, None, None, False
        self._early_args = []
        self._enter("content")
        self._lstrip = False
        if raw:
            self._emit(ContentDelta(raw))

    # handlers: return how many characters of `text` they consumed -----------------------------
    def _handle(self, st: State, text: str) -> int:
        if st.emit in TEXT_KINDS:
            if st.other and text.strip():
                self._next = st.other
                return 0
            self._text(st.emit, text)
            return len(text)
        if st.emit == "none":
            body = text.lstrip()
            if not body:
                return len(text)
            if (self._raw or "").strip():  # an unfinished tool region (whitespace after a call is not)
                self._broken = True
            else:
                self._next = st.other or "content"
            return len(text) - len(body)
        if st.emit == "tool_name":
            self._name += text
            return len(text)
        if st.emit == "tool_id":
            return len(text)
        done_before = self._reader.done
        for i, ch in enumerate(text):
            for act in self._reader.feed(ch):
                self._act(act)
                if act[0] == "call_end" and self._raw is not None:
                    self._raw_skip = i + 1  # (see _consume)
                if self._broken:
                    return i
            if self._reader.done and not done_before:  # the value is complete: what may follow
                self._next = st.after  # it (a closing marker) is looked for again from here
                return i + 1
        return len(text)

    def _text(self, kind: str, text: str) -> None:
        if self._lstrip:
            body = text.lstrip()
            if self._content if kind == "content" else self._reasoning:
                # text resumed after a tool call: its opening whitespace separates it from the
                # text before (held, so a terminal right after still drops it)
                self._held_ws += text[:len(text) - len(body)]
            text, self._lstrip = body, not body
        body = text.rstrip()
        if body:
            cls = ContentDelta if kind == "content" else ReasoningDelta
            self._emit(cls(self._held_ws + body))
            self._held_ws = ""
        self._held_ws += text[len(body):]

    def _act(self, act: tuple) -> None:
        kind = act[0]
        if kind == "error":
            self._broken = True
        elif kind == "name":
            self._start_call(act[1])
            for piece in self._early_args:
                self._args(piece)
            self._early_args = []
        elif kind == "args":
            if self._call is None:
                self._early_args.append(act[1])
            else:
                self._args(act[1])
        elif kind == "call_end":
            self._end_call()

    # tool calls -----------------------------------------------------------------------------
    def _start_call(self, name: str) -> None:
        self._call = _Call(self._index, self._new_id(), name)
        self._index += 1
        self._emit(ToolCallDelta(self._call.index, self._call.id, name, ""))

    def _args(self, text: str) -> None:
        self._call.args.append(text)
        self._emit(ToolCallDelta(self._call.index, arguments=text))

    def _end_call(self) -> None:
        call = self._call
        if call is None:
            self._broken = True
            return
        if not call.args:
            self._args("{}")
        self.tool_calls.append(ToolCall(call.id, call.name, "".join(call.args)))
        self._call, self._raw = None, ""

    # output ---------------------------------------------------------------------------------
    def _emit(self, d: Delta) -> None:
        if isinstance(d, ContentDelta):
            self._content.append(d.text)
        elif isinstance(d, ReasoningDelta):
            self._reasoning.append(d.text)
        last = self._out[-1] if self._out else None
        if type(last) is type(d) and not isinstance(d, ToolCallDelta):
            last.text += d.text
        elif isinstance(d, ToolCallDelta) and isinstance(last, ToolCallDelta) \
                and last.index == d.index and d.name is None:
            last.arguments += d.arguments
        else:
            self._out.append(d)

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def parse(self, token_ids: list[int], text: str) -> ParsedMessage:
        """Non-streaming: the whole output in one feed (call on a fresh parser)."""
        self.feed(token_ids, text)
        self.finish()
        return self.result()
