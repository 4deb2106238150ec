"""Reads tool calls out of JSON text one character at a time, on top of JsonScanner.

Modes: "args" (the whole value is the arguments), "object" ({"name": ..., "arguments": ...}) and
"list" (a JSON list of such objects). `feed(ch)` returns actions for the engine:
("name", str), ("args", str), ("call_end",), ("error",)."""
from __future__ import annotations

from .json_scan import JsonScanner

NAME_KEYS = ("name",)
ARGS_KEYS = ("arguments", "parameters")
OTHER_KEYS = ("id", "type")  # mistral v3 echoes ids; Llama 3.2 writes "type": "function"


class CallReader:
    def __init__(self, mode: str):
        self.mode = mode
        self.scanner = JsonScanner()
        self.call_depth = 1 if mode == "list" else 0  # depth of a call object
        self.key: str | None = None
        self.capturing = False
        self.has_name = False
        self.has_args = False

    @property
    def done(self) -> bool:
        return self.scanner.done

    @property
    def started(self) -> bool:
        return self.scanner.done or bool(self.scanner.stack) or bool(self.scanner.token) \
            or self.scanner.chars is not None

    def finish(self) -> list[tuple]:
        if self.mode == "args" and self.scanner.token:  # a bare number as arguments
            self.scanner.finish()
            return [("call_end",)] if self.scanner.done else [("error",)]
        return []

    def feed(self, ch: str) -> list[tuple]:
        events = self.scanner.feed(ch)
        if self.scanner.error:
            return [("error",)]
        if self.mode == "args":
            return self._feed_args(ch, events)
        acts: list[tuple] = []
        was_capturing, belongs = self.capturing, self.capturing
        fields = self.call_depth + 1
        for ev in events:
            kind, depth = ev[0], ev[1]
            if kind == "start":
                if depth == 0 and self.mode == "list" and ch != "[":
                    return [("error",)]
                if depth == self.call_depth:
                    if ch != "{":
                        return [("error",)]
                    self.has_name = self.has_args = False
                    self.key = None
                elif depth == fields and self.key in ARGS_KEYS:
                    if self.has_args:  # a second arguments value: no one JSON text
                        return [("error",)]
                    self.capturing = belongs = self.has_args = True
            elif kind == "key" and depth == fields:
                if ev[2] not in NAME_KEYS + ARGS_KEYS + OTHER_KEYS:
                    return [("error",)]  # not a tool call (e.g. plain JSON content)
                self.key = ev[2]
            elif kind == "end":
                inclusive, text = ev[2], ev[3]
                if depth == fields and self.key in NAME_KEYS:
                    if not isinstance(text, str) or not text or self.has_name \
                            or not text.isprintable():  # (control characters, a lone
                        return [("error",)]  # surrogate: no reply could carry it)
                    self.has_name = True
                    acts.append(("name", text))
                elif depth == fields and self.capturing:
                    self.capturing = False
                    belongs = inclusive if was_capturing else belongs
                elif depth == self.call_depth:
                    if not self.has_name:
                        return [("error",)]
                    acts.append(("call_end",))
        if belongs:
            # the argument character goes before a call_end it may have caused
            acts.insert(0 if not acts or acts[0][0] != "name" else 1, ("args", ch))
        return acts

    def _feed_args(self, ch: str, events: list) -> list[tuple]:
        acts: list[tuple] = []
        belongs = self.capturing
        for ev in events:
            if ev[0] == "start" and ev[1] == 0:
                self.capturing = belongs = True
            elif ev[0] == "end" and ev[1] == 0:
                self.capturing = False
                belongs = ev[2]
                acts.append(("call_end",))
        if belongs:
            acts.insert(0, ("args", ch))
        return acts
