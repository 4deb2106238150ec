"""Streaming extraction of reasoning and tool calls from model output (one declarative engine)."""
from .engine import StreamingParser
from .families import PARSERS, Family, make_parser
from .types import (ContentDelta, Delta, ParsedMessage, ReasoningDelta,
                                           ToolCall, ToolCallDelta, accumulate)

__all__ = ["PARSERS", "ContentDelta", "Delta", "Family", "ParsedMessage", "ReasoningDelta",
           "StreamingParser", "ToolCall", "ToolCallDelta", "accumulate", "make_parser"]
