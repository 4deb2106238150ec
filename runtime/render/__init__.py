"""Rendering: OpenAI chat/completion requests → prompt token ids."""
from __future__ import annotations

from typing import Any

from . import deepseek_v3, hf, mistral  # noqa: F401  (fill RENDERERS)
from .base import RENDERERS, Renderer, load_chat_template, normalize_messages

__all__ = ["RENDERERS", "Renderer", "get_renderer", "is_mistral_tokenizer", "load_chat_template",
           "normalize_messages"]


def is_mistral_tokenizer(tokenizer: Any) -> bool:
    return type(tokenizer).__module__.startswith("mistral_common")


def get_renderer(name: str | None, tokenizer: Any, model_type: str | None = None,
                 chat_template: str | None = None) -> Renderer:
    """An explicit name wins; otherwise mistral-common tokenizers get `mistral`, DeepSeek-V3
    models `deepseek_v3`, everything else the tokenizer's own chat template (`hf`)."""
    if name is None or name == "auto":
        if is_mistral_tokenizer(tokenizer):
            name = "mistral"
        elif model_type == "deepseek_v3":
            name = "deepseek_v3"
        else:
            name = "hf"
    cls = RENDERERS.get(name)
    if (cls is RENDERERS.get("mistral")) != is_mistral_tokenizer(tokenizer):
        raise ValueError(f"renderer {name!r} does not fit a {type(tokenizer).__name__} tokenizer")
    return cls(tokenizer, chat_template)
