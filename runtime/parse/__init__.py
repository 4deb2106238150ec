"""Streaming extraction of reasoning and tool calls from model output (one declarative engine)."""
from rankserve.runtime.parse.engine import StreamingParser
from rankserve.runtime.parse.families import PARSERS, Family, make_parser
from rankserve.runtime.parse.types import (ContentDelta, Delta, ParsedMessage, ReasoningDelta,
                                           ToolCall, ToolCallDelta, accumulate)

__all__ = ["PARSERS", "ContentDelta", "Delta", "Family", "ParsedMessage", "ReasoningDelta",
           "StreamingParser", "ToolCall", "ToolCallDelta", "accumulate", "make_parser"]
