"""Request models (pydantic) of the OpenAI, Anthropic and Responses APIs, the API error, and the
conversion of request fields to SamplingParams. Responses are built as plain dicts."""
from __future__ import annotations

import functools
import json
import re
import secrets
import time
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, WrapValidator, model_validator

from ..sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

# every integer a client sends must fit the 64-bit fields of the engine messages
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Bool = StrictBool  # "stream": "yes" is an error, not true
MAX_SEQS_PER_REQUEST = 256  # n × prompts: one request must not flood the queue
NO_OP = (None, False, [], {}, "")  # values of unsupported fields that change nothing
ON_WHEN_GIVEN = {"web_search_options"}  # fields whose mere presence ({} too) turns a feature on


class APIError(Exception):
    """An error for the client: HTTP status plus an OpenAI-style (or Anthropic-style) body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        # a lone surrogate from the request must not make the error itself unencodable
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
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


class RequestIdMiddleware:
    """Echo the client's `X-Request-Id` on the response (or give one), as vLLM does; pure ASGI
    so streaming and disconnect detection are untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or secrets.token_hex(16).encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)
        await self.app(scope, receive, send_with_id)


def random_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def _utf8_clean(value: Any) -> bool:
    """True when no string of a JSON-like value (keys included) holds a lone surrogate: it then
    encodes to UTF-8 JSON, in one C pass. False (walk it with _check_text) on a surrogate, or a
    value JSON cannot hold."""
    try:
        msgspec.json.encode(value)
    except Exception:  # noqa: BLE001
        return False
    return True


def _check_text(value: Any, where: str) -> None:
    """Lone surrogates (valid JSON escapes, invalid Unicode) anywhere in the body are a 400."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(f"{where or 'body'}: the text contains a lone surrogate (invalid "
                           "Unicode)", param=where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):  # (a token-id prompt: no text, no per-id work)
                _check_text(v, f"{where}[{i}]")


_INT64_LIST = list[Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]]


def _plain_token_ids(value: Any, handler):
    """A list of plain 64-bit ints (a token-id prompt: hundreds of them) is taken in one C pass;
    anything else gets pydantic's own validation, coercions and errors."""
    if type(value) is list:
        try:
            return msgspec.convert(value, _INT64_LIST)
        except msgspec.ValidationError:
            pass
    return handler(value)


class Request(BaseModel):
    """Strict on purpose: an unknown field is a 400 naming it (a field the server would drop
    could change the output the client expects). Known fields the server does not implement
    are listed in UNSUPPORTED with the reason; they pass only with a value that changes nothing."""
    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if not _utf8_clean(data):
            _check_text(data, "")
        for name in cls.UNSUPPORTED.keys() & data.keys():
            if data[name] not in NO_OP or (name in ON_WHEN_GIVEN and data[name] is not None):
                raise APIError(f"{name} is not supported by this server: "
                               f"{cls.UNSUPPORTED[name]}", param=name)
        # an explicit null is "not given" (OpenAI's optional fields are nullable, as vLLM's):
        # the field's default, unless null is a value of the field (completions' max_tokens:
        # no limit); a required field is then missing
        fields = cls.model_fields
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED
                and not (v is None and k in fields and type(None) not in get_args(fields[k].annotation))}


SAMPLING_UNSUPPORTED = {
    "guided_whitespace_pattern": "xgrammar's JSON whitespace rules apply",
    "logits_processors": "no custom logits processors",
    "use_beam_search": "no beam search", "length_penalty": "no beam search",
    "return_tokens_as_token_ids": "use return_token_ids", "cache_salt": "not exposed yet",
    "kv_transfer_params": "no disaggregated serving", "vllm_xargs": "no extra arguments",
    "functions": "use tools", "function_call": "use tool_choice",
    "prediction": "no predicted outputs", "audio": "text only",
    "web_search_options": "no built-in tools", "documents": "no document templates",
    "mm_processor_kwargs": "text only",
}


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: Bool = False  # OpenAI's padding field: never added here

    @model_validator(mode="after")
    def _check(self):
        if self.include_obfuscation:
            raise ValueError("include_obfuscation=true is not supported: no obfuscation padding "
                             "is added to stream events")
        return self


class StreamOptions(ResponsesStreamOptions):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: the usage so far on every chunk

    @model_validator(mode="after")
    def _check_usage(self):
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage=true")
        return self


class SamplingRequest(Request):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""
    UNSUPPORTED = SAMPLING_UNSUPPORTED
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[Int64] | None = None
    ignore_eos: Bool = False
    min_tokens: Int64 = Field(0, ge=0)
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True  # (what a fast tokenizer's decode does; false refused)
    include_stop_str_in_output: Bool = False
    priority: Int64 = 0
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: the vocabulary
    return_token_ids: Bool = False
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)  # -1: max_model_len
    # token masks (OpenAI's logit_bias: token id → bias in [-100, 100]; vLLM's extras)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    # structured outputs: vLLM's object, and its older guided_* aliases (besides response_format)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    # reasoning tokens before the end of reasoning is forced (vLLM's; needs --reasoning-parser;
    # ServeContext.with_thinking)
    thinking_token_budget: Int64 | None = Field(None, ge=0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_unsupported(self) -> None:
        if self.stream_options and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        if self.truncate_prompt_tokens == 0:
            raise APIError("truncate_prompt_tokens must be >= 1 (or -1)",
                           param="truncate_prompt_tokens")
        if not self.spaces_between_special_tokens:
            raise APIError("spaces_between_special_tokens=false is not supported (special tokens "
                           "are decoded as the tokenizer joins them)",
                           param="spaces_between_special_tokens")


def sampling_params(req: SamplingRequest, defaults: dict, max_tokens: int | None,
                    logprobs: int | None, parser=None, vocab_size: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """Request fields → SamplingParams; fields the client left out take the model's
    generation_config defaults (as vLLM does), then the OpenAI defaults. `parser`: the chat
    output's parser, whose markers (special tokens among them) must reach it as text."""
    def pick(name, fallback):
        v = getattr(req, name, None)
        return v if v is not None else defaults.get(name, fallback)
    cap = defaults.get("max_tokens")  # the generation config's max_new_tokens (vLLM: a cap)
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp = SamplingParams(
        n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0), seed=req.seed, max_tokens=max_tokens,
        min_tokens=req.min_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        kept_special_token_ids=getattr(parser, "marker_token_ids", None),
        structured_outputs=structured, logit_bias=logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids, bad_words=list(req.bad_words or []))
    try:
        sp.validate(vocab_size)
    except ValueError as e:
        raise APIError(str(e), param=getattr(e, "param", None)) from None
    return sp


def check_logprobs(req: Request, info: dict, *names: str) -> None:
    """The engine's --max-logprobs (vLLM's): a request asking more is a 400 naming the field.
    -1 (vLLM's) asks the whole vocabulary: the field is set to its size."""
    most = info.get("max_logprobs", 20)
    for name in names:
        value = getattr(req, name)
        if value == -1 and info.get("vocab_size"):
            value = info["vocab_size"]
            setattr(req, name, value)
        if value is not None and value > most:
            raise APIError(f"{name} is {value}, more than this server allows (--max-logprobs "
                           f"{most})", param=name)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids as strings; values in [-100, 100]."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
        if not -100 <= v <= 100:
            raise APIError(f"logit_bias values must be in [-100, 100], got {v}", param="logit_bias")
    return out


def structured_from(req: SamplingRequest, fmt_param: str = "response_format",
                    fmt: dict | None = None) -> StructuredOutputsParams | None:
    """The request's one output constraint, from response_format (OpenAI), structured_outputs or
    the guided_* aliases (vLLM). Two sources at once, or a malformed one, is a 400."""
    fmt = req.response_format if fmt is None else fmt
    found: list[tuple[str, StructuredOutputsParams]] = []
    if fmt is not None:
        kind = fmt.get("type")
        extra = sorted(fmt.keys() - {"type"})
        if kind in ("text", "json_object") and extra:  # (e.g. a schema beside json_object)
            raise APIError(f"{fmt_param}: unknown field(s) {extra} for type {kind}",
                           param=f"{fmt_param}.{extra[0]}")
        if kind == "json_object":
            found.append((fmt_param, StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            found.append((fmt_param, StructuredOutputsParams(json=_json_schema_format(fmt, fmt_param))))
        elif kind == "structural_tag":
            found.append((fmt_param, StructuredOutputsParams(structural_tag=json.dumps(fmt))))
        elif kind != "text":
            raise APIError(f"{fmt_param}.type must be text, json_object, json_schema or "
                           f"structural_tag, got {kind!r}", param=f"{fmt_param}.type")
    if req.structured_outputs is not None:  # (an empty one is a 400 below: no constraint)
        so = req.structured_outputs
        extra = so.keys() - {*StructuredOutputsParams.KINDS, *StructuredOutputsParams.OPTIONS}
        if extra:  # e.g. whitespace_pattern: options we would otherwise ignore
            raise APIError(f"structured_outputs: unsupported options {sorted(extra)}",
                           param="structured_outputs")
        try:
            found.append(("structured_outputs", msgspec.convert(so, StructuredOutputsParams)))
        except msgspec.ValidationError as e:
            raise APIError(f"structured_outputs: {e}", param="structured_outputs") from None
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{kind: value})))
    if len(found) > 1:
        raise APIError("give one output constraint, not " + " and ".join(n for n, _ in found),
                       param=found[1][0])
    if not found:
        return None
    name, params = found[0]
    try:
        _ = params.kind  # exactly one constraint inside
    except ValueError as e:
        raise APIError(str(e), param=name) from None
    if params.choice is not None and (not params.choice or not all(
            isinstance(c, str) and c for c in params.choice)):
        raise APIError("choice must be a non-empty list of non-empty strings", param=name)
    return params


JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def _json_schema_format(fmt: dict, fmt_param: str) -> dict:
    """The schema of a json_schema format: chat / completions nest it (`json_schema: {name,
    schema, strict}`), Responses puts it beside the type. An unknown key is a 400, not dropped;
    `strict` true or false both get the schema enforced (false only allows, not asks, less)."""
    nested = fmt_param == "response_format"
    spec = fmt.get("json_schema", {}) if nested else fmt  # (missing: the schema is missing)
    where = f"{fmt_param}.json_schema" if nested else fmt_param
    outer = {"type", "json_schema"} if nested else {"type", *JSON_SCHEMA_KEYS}
    for obj, allowed, at in ((fmt, outer, fmt_param), (spec, JSON_SCHEMA_KEYS if nested else outer, where)):
        if not isinstance(obj, dict):
            raise APIError(f"{at} must be an object", param=at)
        extra = sorted(obj.keys() - allowed)
        if extra:
            raise APIError(f"{at}: unknown field(s) {extra}", param=f"{at}.{extra[0]}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(f"{where}.strict must be a boolean", param=f"{where}.strict")
    if not isinstance(spec.get("description") or "", str):
        raise APIError(f"{where}.description must be a string", param=f"{where}.description")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(f"{where}.schema must be a JSON schema object", param=f"{where}.schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
        raise APIError(f"{where}.name is required: 1 to 64 of a-z, A-Z, 0-9, _ and -; got "
                       f"{json.dumps(name)[:80]}", param=f"{where}.name")
    return schema


def check_prompts(prompts: list[list[int]], info: dict, max_tokens: int | None, n: int = 1,
                  prompt_param: str = "prompt", tokens_param: str = "max_tokens",
                  truncate: int | None = None) -> list[list[int]]:
    """Everything the engine would refuse, checked for the WHOLE request before any of it is
    sent: token ids in the vocabulary, prompt and max_tokens within the context (a 400, as vLLM,
    never a silent clamp), n × prompts within MAX_SEQS_PER_REQUEST. Applies
    truncate_prompt_tokens (keep the last k tokens)."""
    if n * len(prompts) > MAX_SEQS_PER_REQUEST:
        raise APIError(f"n × prompts is {n * len(prompts)}; at most {MAX_SEQS_PER_REQUEST} "
                       "sequences per request", param="n")
    vocab, limit = info.get("vocab_size"), info.get("max_model_len")
    if truncate is not None:
        keep = limit if truncate == -1 and limit else truncate
        prompts = [p[-keep:] for p in prompts]
    for p in prompts:
        if not p:
            raise APIError("the prompt is empty", param=prompt_param)
        if vocab:
            check_token_ids(p, vocab, prompt_param)
        if limit and len(p) >= limit:
            raise APIError(f"This model's maximum context length (max_model_len) is {limit} "
                           f"tokens, but the prompt has {len(p)} tokens; it must leave room for "
                           "at least one new token", param=prompt_param,
                           code="context_length_exceeded")
        if limit and max_tokens is not None and len(p) + max_tokens > limit:
            raise APIError(f"This model's maximum context length (max_model_len) is {limit} "
                           f"tokens. However, you requested {len(p) + max_tokens} tokens "
                           f"({len(p)} in the prompt, {max_tokens} for the completion). Reduce "
                           f"the prompt or {tokens_param}.", param=tokens_param,
                           code="context_length_exceeded")
    return prompts


@functools.lru_cache(maxsize=8)
def _ids_below(vocab_size: int):
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    try:  # the usual case in one C pass; the walk below names the first bad id
        msgspec.convert(ids, _ids_below(vocab_size))
        return
    except msgspec.ValidationError:
        pass
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"{param}: token ids must be in [0, {vocab_size}), got {bad}", param=param)


def check_tool_schemas(tools: list[dict] | None, key: str = "parameters",
                       where: str = "tools[{i}].function.parameters") -> None:
    """A tool's parameters must be a valid JSON schema (the model is shown it verbatim)."""
    import jsonschema  # a dependency of mistral-common
    for i, t in enumerate(tools or []):
        fn = t.get("function", t) if isinstance(t, dict) else None
        schema = fn.get(key) if isinstance(fn, dict) else None
        if schema is None:
            continue
        name = where.format(i=i)
        if not isinstance(schema, dict):
            raise APIError(f"{name} must be a JSON schema object", param=name)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise APIError(f"{name} is not a valid JSON schema: {e.message}", param=name) from None


def check_tool_names(tools: list) -> None:
    """Tools (Anthropic's or Responses', flat) have a name and a description, both strings,
    and the names are unique (a forced call names one; both APIs refuse duplicates)."""
    seen = set()
    for i, t in enumerate(tools):
        for key in ("name", "description"):
            if (key == "name" or t.get(key) is not None) and not isinstance(t.get(key), str):
                raise APIError(f"tools[{i}].{key}: Input should be a valid string", param="tools")
        if t["name"] in seen:
            raise APIError(f"tools[{i}].name: tool names must be unique; {t['name']!r} is twice",
                           param="tools")
        seen.add(t["name"])


def validation_param(errors: list[dict]) -> str | None:
    """The field a pydantic validation error is about, for the error body's `param`."""
    for e in errors:
        if e.get("type") == "json_invalid":
            return None  # its loc is a character offset, not a field
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc:
            return ".".join(loc)
    return None


# ---- OpenAI -------------------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: Annotated[str | list[str] | list[Int64] | list[list[Int64]],
                      WrapValidator(_plain_token_ids)]
    max_tokens: Int64 | None = Field(16, ge=0)  # 0: with echo only (the prompt, scored)
    logprobs: int | None = Field(None, ge=-1)
    echo: Bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens must be >= 1 (0 only with echo=true)", param="max_tokens")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is not supported (use n)", param="best_of")


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Int64 | None = Field(None, ge=1)
    max_completion_tokens: Int64 | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: int | None = Field(None, ge=-1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    echo: Bool = False
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: Bool = True
    metadata: dict[str, Any] | None = None
    store: Literal[False] | None = None  # nothing is stored
    service_tier: str | None = None
    modalities: list[Literal["text"]] | None = None
    safety_identifier: str | None = None  # hints that change no token (as on Responses)
    prompt_cache_key: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        check_generation_prompt(self)
        if not self.include_reasoning:
            raise APIError("include_reasoning=false is not supported yet",
                           param="include_reasoning")
        check_tool_schemas(self.tools)


def check_generation_prompt(req) -> None:
    """vLLM's rule: continuing the final message and opening a new turn are exclusive (an
    add_generation_prompt left at its default true gives way)."""
    if req.continue_final_message and req.add_generation_prompt \
            and "add_generation_prompt" in req.model_fields_set:
        raise APIError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                       "True.", param="continue_final_message")


class DerenderRequest(Request):
    token_ids: list[Int64] = Field(min_length=1)
    prompt_token_ids: list[Int64] | None = None  # decides whether the output starts in reasoning
    tools: list[dict[str, Any]] | None = None


class TokenizeRequest(Request):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Request):
    tokens: list[Int64]


class LoadLoRAAdapterRequest(Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(Request):
    lora_name: str = Field(min_length=1)
    lora_int_id: Int64 | None = None


# ---- Anthropic ----------------------------------------------------------------------------------
class AnthropicMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class CacheControl(BaseModel):
    """A prompt-caching marker: a hint only (prefix caching is automatic), so it is taken."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class MessagesRequest(Request):
    UNSUPPORTED = {"container": "no code execution", "mcp_servers": "no MCP servers"}
    model: str
    max_tokens: Int64 = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: Bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format`: structured outputs
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None


class CountTokensRequest(Request):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # checked; it does not change the prompt
    cache_control: CacheControl | None = None


# ---- Responses ----------------------------------------------------------------------------------
# OpenAI's metadata: up to 16 pairs, keys up to 64 characters, string values up to 512
OpenAIMetadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                                Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ResponsesRequest(Request):
    UNSUPPORTED = {"background": "responses are not stored",
                   "conversation": "responses are not stored", "prompt": "no stored prompts",
                   "top_logprobs": "no logprobs in responses yet",
                   "max_tool_calls": "not enforced yet"}
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: Int64 | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: Bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    store: Bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: OpenAIMetadata | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_unsupported(self) -> None:
        if self.stream_options and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        if self.store:
            raise APIError("store=true is not supported: responses are not stored", param="store")
        for value in self.include or []:
            if value != "reasoning.encrypted_content":
                raise APIError(f"include {value!r} is not supported: only "
                               "reasoning.encrypted_content", param="include")
        extra = sorted((self.reasoning or {}).keys() - {"effort", "summary", "generate_summary"})
        if extra:
            raise APIError(f"reasoning: unknown field {extra[0]!r}", param=f"reasoning.{extra[0]}")
        for key in ("summary", "generate_summary"):  # taken; the reasoning item has it whole
            if (self.reasoning or {}).get(key) not in (None, "auto", "concise", "detailed"):
                raise APIError(f"reasoning.{key} must be auto, concise or detailed",
                               param=f"reasoning.{key}")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none", "minimal", "low", "medium", "high"):
            raise APIError(f"reasoning.effort must be none, minimal, low, medium or high; got "
                           f"{effort!r}", param="reasoning.effort")
        check_tool_schemas(self.tools, where="tools[{i}].parameters")
