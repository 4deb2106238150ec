"""A character-at-a-time JSON syntax checker. It never builds the value; it tells the caller where
values start and end (and the text of strings), which is all a streaming tool-call reader needs
to know which characters are arguments and when a call is complete."""
from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_CHARS = set("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = set('"\\/bfnrtu')


class JsonScanner:
    """Events returned by `feed(ch)`, in order:
    ("start", depth)                 this char begins a value nested in `depth` containers
    ("key", depth, text)             an object key closed (depth: that of its value)
    ("end", depth, inclusive, str)   a value closed; inclusive: this char is its last one (False
                                     when a number/literal is ended by the delimiter `ch`);
                                     str: the decoded text for string values, else None.
    After an error every later feed returns [] and `error` stays True."""

    def __init__(self):
        self.stack: list[str] = []  # open containers, "{" or "["
        self.expect = "value"  # value | value_or_close | key | key_or_close | colon | comma
        self.chars: list[str] | None = None  # inside a string
        self.is_key = False
        self.escape = 0  # >0 inside an escape; counts the \uXXXX hex digits still due
        self.token = ""  # number or literal in progress
        self.done = False
        self.error = False

    @property
    def depth(self) -> int:
        return len(self.stack)

    def feed(self, ch: str) -> list[tuple]:
        if self.error:
            return []
        events: list[tuple] = []
        if self.chars is not None:
            self._string_char(ch, events)
            return events
        if self.token:
            if ch in _NUMBER_CHARS or ch.isalpha():
                self.token += ch
                if not self._token_prefix_ok():
                    self.error = True
                return events
            if not self._end_token(events, inclusive=False):
                return events
        if ch in " \t\n\r":
            return events
        if self.done:
            self.error = True
            return events
        exp = self.expect
        if exp in ("value", "value_or_close"):
            if ch == "]" and exp == "value_or_close":
                self._close("[", events)
            elif ch in "{[":
                events.append(("start", self.depth))
                self.stack.append(ch)
                self.expect = "key_or_close" if ch == "{" else "value_or_close"
            elif ch == '"':
                events.append(("start", self.depth))
                self.chars, self.is_key = [], False
            elif ch == "-" or ch.isdigit() or ch in "tfn":
                events.append(("start", self.depth))
                self.token = ch
            else:
                self.error = True
        elif exp in ("key", "key_or_close"):
            if ch == "}" and exp == "key_or_close":
                self._close("{", events)
            elif ch == '"':
                self.chars, self.is_key = [], True
            else:
                self.error = True
        elif exp == "colon":
            if ch == ":":
                self.expect = "value"
            else:
                self.error = True
        else:  # comma
            if ch == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
            elif ch in "}]":
                self._close("{" if ch == "}" else "[", events)
            else:
                self.error = True
        return events

    def finish(self) -> None:
        """End of input: a top-level number still open is complete now."""
        if self.token and not self.error:
            self._end_token([], inclusive=False)

    def _string_char(self, ch: str, events: list) -> None:
        if self.escape:
            if self.escape == 5:  # right after the backslash
                if ch not in _ESCAPES:
                    self.error = True
                    return
                self.escape = 4 if ch == "u" else 0
            elif ch in "0123456789abcdefABCDEF":
                self.escape -= 1
            else:
                self.error = True
                return
            self.chars.append(ch)
        elif ch == "\\":
            self.escape = 5
            self.chars.append(ch)
        elif ch == '"':
            text = json.loads('"' + "".join(self.chars) + '"')
            self.chars = None
            if self.is_key:
                events.append(("key", self.depth, text))
                self.expect = "colon"
            else:
                events.append(("end", self.depth, True, text))
                self._after_value()
        elif ch < " ":
            self.error = True
        else:
            self.chars.append(ch)

    def _token_prefix_ok(self) -> bool:
        t = self.token
        if t[0] in "tfn":
            return any(lit.startswith(t) for lit in _LITERALS)
        return all(c in _NUMBER_CHARS for c in t)

    def _end_token(self, events: list, inclusive: bool) -> bool:
        t, self.token = self.token, ""
        if t not in _LITERALS and not _NUMBER.fullmatch(t):
            self.error = True
            return False
        events.append(("end", self.depth, inclusive, None))
        self._after_value()
        return True

    def _close(self, opener: str, events: list) -> None:
        if self.stack[-1] != opener:
            self.error = True
            return
        self.stack.pop()
        events.append(("end", self.depth, True, None))
        self._after_value()

    def _after_value(self) -> None:
        if self.stack:
            self.expect = "comma"
        else:
            self.done = True
