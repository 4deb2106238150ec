"""Request models (pydantic) of the OpenAI, Anthropic and Responses APIs, the API error, and the
conversion of request fields to SamplingParams. Responses are built as plain dicts."""
from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class APIError(Exception):
    """An error for the client: HTTP status plus an OpenAI-style (or Anthropic-style) body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    @property
    def type(self) -> str:
        return self.TYPES.get(self.status, "invalid_request_error")

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def random_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class Request(BaseModel):
    # unknown fields are ignored, as vLLM and OpenAI do
    model_config = ConfigDict(extra="ignore")
    model: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(Request):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError("logit_bias is not supported yet", param="logit_bias")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(f"response_format {fmt!r} is not supported yet (no structured output "
                           "/ guided decoding); only 'text'", param="response_format")
        if self.stream_options and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")


def sampling_params(req: SamplingRequest, defaults: dict, max_tokens: int | None,
                    logprobs: int | None, skip_special_tokens: bool | None = None) -> SamplingParams:
    """Request fields → SamplingParams; fields the client left out take the model's
    generation_config defaults (as vLLM does), then the OpenAI defaults."""
    def pick(name, fallback):
        v = getattr(req, name)
        return v if v is not None else defaults.get(name, fallback)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp = SamplingParams(
        n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0), seed=req.seed, max_tokens=max_tokens,
        min_tokens=req.min_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None
        else skip_special_tokens)
    try:
        sp.validate()
    except ValueError as e:
        raise APIError(str(e)) from None
    return sp


# ---- OpenAI -------------------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError("echo is not supported yet", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is not supported (use n)", param="best_of")


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DerenderRequest(Request):
    token_ids: list[int] = Field(min_length=1)
    prompt_token_ids: list[int] | None = None  # decides whether the output starts in reasoning
    tools: list[dict[str, Any]] | None = None


class TokenizeRequest(Request):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Request):
    tokens: list[int]


# ---- Anthropic ----------------------------------------------------------------------------------
class MessagesRequest(Request):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(Request):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None


# ---- Responses ----------------------------------------------------------------------------------
class ResponsesRequest(Request):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
