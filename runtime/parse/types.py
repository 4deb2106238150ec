"""What the parser produces: streaming deltas (OpenAI chat-completion-chunk shaped) and the final
message."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ALNUM = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def mistral_tool_call_id() -> str:
    """Mistral's: 9 alphanumerics (its chat templates refuse history with other ids; vLLM's)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallDelta:
    """One piece of tool call `index`: the first piece carries id and name, later ones only
    more `arguments` text (concatenated, they form the final arguments JSON)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the model wrote it


@dataclass
class ParsedMessage:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def accumulate(deltas: list[Delta]) -> ParsedMessage:
    """What a streaming client reconstructs from the deltas (an OpenAI SDK does the same)."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, ReasoningDelta):
            reasoning.append(d.text)
        else:
            if d.index not in calls:
                calls[d.index] = ToolCall(d.id or "", d.name or "", "")
            calls[d.index].arguments += d.arguments
    return ParsedMessage("".join(content) or None, "".join(reasoning) or None,
                         [calls[i] for i in sorted(calls)])
