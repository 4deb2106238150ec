"""A parser family as data: terminals, states and transitions. The engine (engine.py) is the only
code that interprets them, so adding a model family means writing a table, not a parser.

Each state says what its text is (`emit`):
  content / reasoning  text for that channel (whitespace next to terminals is dropped)
  none                 only whitespace expected; other text leaves for `other`
  tool_name            a function name, ended by a terminal
  tool_id              a call id the model echoes (skipped), ended by a terminal
  tool_args            one JSON value: the arguments
  tool_json            a JSON call object {"name": ..., "arguments"|"parameters": ...}, or a list
                       of them (`json="list"`)
A tool state whose JSON is complete moves to `after` if set, else waits for a terminal; text that
breaks a tool call turns the whole call's text back into content.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

TEXT_KINDS = ("content", "reasoning")
TOOL_KINDS = ("tool_name", "tool_id", "tool_args", "tool_json")


@dataclass(frozen=True)
class Terminal:
    """A marker in the output. With a token id it only counts when the model produced that
    token (so a model writing the same characters as plain text does not trigger it)."""
    text: str
    token_id: int | None = None


@dataclass(frozen=True)
class Rule:
    on: Terminal
    to: str
    consume: bool = True  # False: the terminal's text stays and is read by the next state


@dataclass(frozen=True)
class State:
    emit: str
    rules: tuple[Rule, ...] = ()
    json: str = "object"  # tool_json only: "object" or "list"
    after: str | None = None
    other: str | None = None


@dataclass(frozen=True)
class Piece:
    """The reasoning half or the tool half of a family. `entry` is where plain output starts."""
    states: dict[str, State]
    entry: str = "content"


@dataclass
class Grammar:
    states: dict[str, State] = field(default_factory=dict)
    entry: str = "content"

    @property
    def terminals(self) -> set[Terminal]:
        return {r.on for s in self.states.values() for r in s.rules}


def combine(reasoning: Piece | None, tools: Piece | None) -> Grammar:
    """Merge the two halves: states with the same name pool their rules; reasoning returns to the
    tool half's entry state."""
    g = Grammar(states={"content": State("content")})
    if tools is not None:
        g.entry = tools.entry
    for piece in (tools, reasoning):
        if piece is None:
            continue
        for name, st in piece.states.items():
            if piece is reasoning:
                st = replace(st, rules=tuple(replace(r, to=g.entry) if r.to == "content" else r
                                             for r in st.rules))
            old = g.states.get(name)
            g.states[name] = st if old is None else replace(old, rules=old.rules + st.rules)
    return g
