"""`hf`: the tokenizer's own chat template (transformers' apply_chat_template)."""
from __future__ import annotations

from .base import RENDERERS, Renderer


@RENDERERS.register("hf")
class HfRenderer(Renderer):
    def _render(self, messages, tools, kwargs, add_generation_prompt, continue_final_message):
        if not kwargs.get("chat_template") and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: start the server with --chat-template "
                             "(a file or the template itself), send chat_template in the request, "
                             "or use /v1/completions")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True, return_dict=False,
                **kwargs)
        except Exception as e:  # template raise_exception() and jinja errors are request errors
            raise ValueError(f"chat template failed: {e}") from e
        return list(ids)
