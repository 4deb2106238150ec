"""`deepseek_v3`: DeepSeek-V3.1. Its template ignores `tools`, so the tool description of the
model card goes into the system prompt here; `thinking` (or `enable_thinking`) picks the mode."""
from __future__ import annotations

import json

from .base import RENDERERS
from .hf import HfRenderer

TOOL_FORMAT = (
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
    "<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
    "Where:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n")


def tool_description(tools: list[dict]) -> str:
    parts = ["## Tools\nYou have access to the following tools:\n"]
    for t in tools:
        fn = t["function"]
        parts.append(f"### {fn['name']}\nDescription: {fn.get('description') or ''}\n\n"
                     f"Parameters: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}\n")
    return "\n".join(parts) + "\n" + TOOL_FORMAT


@RENDERERS.register("deepseek_v3")
class DeepSeekV3Renderer(HfRenderer):
    def _render(self, messages, tools, kwargs, add_generation_prompt, continue_final_message):
        kwargs["thinking"] = bool(kwargs.pop("thinking", kwargs.pop("enable_thinking", False)))
        if tools:
            desc = tool_description(tools)
            systems = [m for m in messages if m["role"] == "system"]
            if systems:  # the template joins system messages; the tools follow them
                last = systems[-1]
                messages = [dict(m, content=m["content"] + "\n\n" + desc) if m is last else m
                            for m in messages]
            else:
                messages = [{"role": "system", "content": desc}] + messages
        return super()._render(messages, None, kwargs, add_generation_prompt,
                               continue_final_message)
