"""`mistral`: mistral-common's own request encoding (the reference for Mistral models)."""
from __future__ import annotations

import json
import re

from .base import RENDERERS, Renderer


def mistral_call_id(call_id: str) -> str:
    """Mistral models use 9-character alphanumeric call ids; keep the last 9 of ours."""
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return (alnum[-9:] if len(alnum) >= 9 else alnum.rjust(9, "0")) if alnum else "0" * 9


@RENDERERS.register("mistral")
class MistralRenderer(Renderer):
    uses_chat_template = False
    def _render(self, messages, tools, kwargs, add_generation_prompt, continue_final_message):
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        if kwargs:
            raise ValueError(f"the mistral renderer takes no chat_template_kwargs ({sorted(kwargs)})")
        msgs = []
        for m in messages:
            # (mistral-common takes a name on tool messages only)
            m = {k: v for k, v in m.items()
                 if k != "reasoning_content" and (k != "name" or m["role"] == "tool")}
            if "tool_calls" in m:
                m["content"] = m["content"] or None
                m["tool_calls"] = [{"id": mistral_call_id(tc["id"]), "type": "function",
                                    "function": {"name": tc["function"]["name"],
                                                 "arguments": json.dumps(tc["function"]["arguments"],
                                                                         ensure_ascii=False)}}
                                   for tc in m["tool_calls"]]
            if m["role"] == "tool":
                m["tool_call_id"] = mistral_call_id(m["tool_call_id"])
            msgs.append(m)
        try:
            req = ChatCompletionRequest.from_openai(msgs, tools,
                                                    continue_final_message=continue_final_message)
            return list(self.tokenizer.encode_chat_completion(req).tokens)
        except Exception as e:  # mistral-common validation errors are request errors
            raise ValueError(f"mistral-common rejected the request: {e}") from e

    def _encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.instruct_tokenizer.tokenizer.encode(prompt, bos=True, eos=False)
