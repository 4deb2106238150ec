"""Renderer: an OpenAI chat request → prompt token ids. Subclasses differ only in how they turn
the (validated, normalised) messages into tokens."""
from __future__ import annotations

import json
import os
from typing import Annotated, Any

import msgspec

from ...models.registry import Registry

RENDERERS: Registry[type["Renderer"]] = Registry("renderer")
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]

ROLES = ("system", "developer", "user", "assistant", "tool")
# names apply_chat_template itself takes; a chat_template_kwargs entry must not shadow them
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "add_generation_prompt",
                   "continue_final_message", "tokenize", "return_dict", "return_tensors",
                   "chat_template", "tokenizer_kwargs"}


def load_chat_template(value: str) -> str:
    """`--chat-template` / `chat_template`, as vLLM takes it: a file path, or the template
    itself (anything with Jinja-ish characters)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} looks like a file path, but it cannot be read")


class Renderer:
    uses_chat_template = True  # renderers with their own encoder (mistral) take no template

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = load_chat_template(chat_template) if chat_template else None
        if self.chat_template and not self.uses_chat_template:
            raise ValueError(f"renderer {type(self).__name__} does not use chat templates")

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template: str | None = None) -> list[int]:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        msgs = normalize_messages(messages)
        if continue_final_message and msgs[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        kwargs = dict(chat_template_kwargs or {})
        if clash := RESERVED_KWARGS & kwargs.keys():
            raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}")
        template = chat_template or self.chat_template  # the request's, then the server's
        if template:
            if not self.uses_chat_template:
                raise ValueError("this model's renderer does not use chat templates; "
                                 "chat_template cannot be set")
            kwargs["chat_template"] = template
        return self._render(msgs, validate_tools(tools), kwargs, add_generation_prompt,
                            continue_final_message)

    def render_completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode_prompt(prompt)
        try:  # plain non-negative ints (the usual token-id prompt), checked in one C pass
            if prompt:
                return msgspec.convert(prompt, _TOKEN_IDS)
        except msgspec.ValidationError:
            pass
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                 for t in prompt):
            raise ValueError("prompt must be a string or a non-empty list of token ids")
        return list(prompt)

    def _render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        raise NotImplementedError

    def _encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))


def _text(content: Any, where: str) -> str:
    """OpenAI content (None, str, or a list of text parts) → one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: unsupported content part {kind!r} (only text)")
            texts.append(part["text"])
        return "\n".join(texts)  # how vLLM joins text parts
    raise ValueError(f"{where}: content must be a string or a list of parts")


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning",
                  "reasoning_content"}
# OpenAI's answer fields a client may send back in the history: only as null (or empty)
MESSAGE_NULL_FIELDS = {"refusal", "annotations", "audio", "function_call"}


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validate OpenAI chat messages and bring them to one shape for the templates: content is a
    string, developer is system, tool-call arguments are dicts, reasoning is `reasoning_content`."""
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        for key in m.keys() - MESSAGE_FIELDS:
            if key not in MESSAGE_NULL_FIELDS or m[key] not in (None, "", [], {}):
                raise ValueError(f"{where}: the field {key!r} is not supported (a message has "
                                 f"{', '.join(sorted(MESSAGE_FIELDS))})")
        if role != "assistant" and m.get("content") is None:  # (OpenAI: required but there)
            raise ValueError(f"{where}: a {role} message needs content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(m.get("content"), where)}
        if m.get("name") is not None:  # the participant's name (OpenAI's), for the template
            if not isinstance(m["name"], str):
                raise ValueError(f"{where}: name must be a string")
            msg["name"] = m["name"]
        if role == "tool":
            if not m.get("tool_call_id"):
                raise ValueError(f"{where}: a tool message needs tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                msg["reasoning_content"] = _text(reasoning, where)
            if m.get("tool_calls"):
                msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{j}]")
                                     for j, tc in enumerate(m["tool_calls"])]
        elif m.get("tool_calls"):
            raise ValueError(f"{where}: only assistant messages have tool_calls")
        out.append(msg)
    return out


def _tool_call(tc: Any, where: str) -> dict:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: needs function.name")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: function.arguments is not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: function.arguments must be a JSON object")
    return {"id": tc.get("id") or "", "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def validate_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
    return tools
