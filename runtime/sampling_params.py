"""Per-request sampling and stopping parameters (vLLM / OpenAI semantics)."""
from __future__ import annotations

import msgspec

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the sampler's float32: a larger value becomes inf
MAX_STOP_STRINGS = 1024  # each is searched at every token, on the API server's event loop
MAX_BAD_WORDS = 1024  # each is tokenized for the request and checked at every step


class ParamError(ValueError):
    """A bad sampling parameter; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """One output constraint (vLLM's `structured_outputs`): exactly one of the fields below."""
    json: dict | str | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None  # xgrammar structural tag (JSON text)
    # JSON (json / json_object): no free whitespace, only xgrammar's ", " and ": " (vLLM's option)
    disable_any_whitespace: bool = False
    # the constraint starts after this token (a reasoning model's end-of-reasoning token): the
    # reasoning itself is free text; None: from the first output token
    start_after_token_id: int | None = None
    # with start_after_token_id: the token that opens the reasoning. An output whose first token
    # is another one has no reasoning, and the constraint holds from that first token
    reasoning_start_token_id: int | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    OPTIONS = ("disable_any_whitespace",)  # the API's options besides the kinds

    @property
    def kind(self) -> str:
        """The one constraint that is set; ParamError if none or several."""
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParamError("structured_outputs must set exactly one of "
                             f"{', '.join(self.KINDS)}; got {given or 'none'}", "structured_outputs")
        return given[0]


class SamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # with skip_special_tokens: special tokens that stay in the text all the same (a tool or
    # reasoning parser's markers, filled by the frontend); None: all are skipped
    kept_special_token_ids: list[int] | None = None
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None  # offline: keep the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id → added to its logit (clamped to ±100)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = []  # never generated (as words; the frontend tokenizes them)
    bad_words_token_ids: list[list[int]] = []  # filled by the frontend from bad_words
    # reasoning tokens allowed before the end of reasoning is forced (runtime/thinking_budget.py;
    # None: no limit). The tags are the reasoning parser's, filled by the frontend (or by
    # `LLM` from the tokenizer's <think> / </think>): the opening tag (None: only the prompt opens
    # the reasoning) and the sequence forced, whose first token is the closing tag
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_ids: list[int] = []

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words", "thinking_end_token_ids"):
            if getattr(self, name) is None:  # vLLM's default for these: none
                setattr(self, name, [])
        if self.top_k == -1:
            self.top_k = 0

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise ValueError (ParamError) naming the field and the allowed range. With the
        vocabulary size, token ids are checked too: an id out of range would crash the sampler.
        `max_logprobs`: the engine's --max-logprobs (-1: the vocabulary size; None: unchecked)."""
        def bad(name, rule):
            raise ParamError(f"{name} must be {rule}, got {getattr(self, name)!r}", name)
        if self.n < 1:
            bad("n", ">= 1")
        if not self.temperature >= 0:  # (NaN too)
            bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            bad("top_k", ">= 0 (or -1 to disable)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "> 0")
        for name in ("temperature", "repetition_penalty"):  # (inf: NaN logits, masks lost)
            if getattr(self, name) > FLOAT32_MAX:
                bad(name, f"at most {FLOAT32_MAX:.4g}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", ">= 1")
        if self.min_tokens < 0:
            bad("min_tokens", ">= 0")
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1):
            bad("truncate_prompt_tokens", ">= 1 (or -1: max_model_len)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        most = INT64_MAX if max_logprobs is None else max_logprobs
        if most == -1:
            most = vocab_size or INT64_MAX
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= most:
                bad(name, f"in [0, {most}] (--max-logprobs)" if max_logprobs is not None else ">= 0")
        if any(not s for s in self.stop):
            raise ParamError("stop strings must be non-empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX - self.n:
            bad("seed", f"a 64-bit integer (at most {INT64_MAX - self.n} with n={self.n})")
        if self.max_tokens is not None and self.max_tokens > INT64_MAX:
            bad("max_tokens", "a 64-bit integer")
        hi = vocab_size if vocab_size else INT64_MAX + 1
        if any(not 0 <= t < hi for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids in [0, {hi})")
        if self.logit_bias and any(not 0 <= t < hi for t in self.logit_bias):
            raise ParamError(f"logit_bias keys must be token ids in [0, {hi})", "logit_bias")
        if self.logit_bias and any(v != v for v in self.logit_bias.values()):
            raise ParamError("logit_bias values must be numbers", "logit_bias")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not 0 <= t < hi for t in self.allowed_token_ids)):
            bad("allowed_token_ids", f"a non-empty list of token ids in [0, {hi})")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ParamError(f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}", "bad_words")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):  # (no tokens)
            raise ParamError("bad_words must be non-empty words (not only whitespace)", "bad_words")
        if any(not w or any(not 0 <= t < hi for t in w) for w in self.bad_words_token_ids):
            raise ParamError(f"bad_words must be non-empty words of token ids in [0, {hi})", "bad_words")
        if self.thinking_token_budget is not None:
            if not 0 <= self.thinking_token_budget <= INT64_MAX:
                bad("thinking_token_budget", ">= 0")
            if not self.thinking_end_token_ids:
                raise ParamError("thinking_token_budget needs a reasoning model: the server's "
                                 "--reasoning-parser (or thinking_end_token_ids) tells where the "
                                 "reasoning ends", "thinking_token_budget")
        ids = self.thinking_end_token_ids + [t for t in [self.thinking_start_token_id] if t is not None]
        if any(not 0 <= t < hi for t in ids):
            raise ParamError(f"thinking_start_token_id / thinking_end_token_ids must be token ids "
                             f"in [0, {hi})", "thinking_token_budget")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            so.kind  # noqa: B018 - raises unless exactly one constraint is set
            for name in ("start_after_token_id", "reasoning_start_token_id"):
                t = getattr(so, name)
                if t is not None and not 0 <= t < hi:
                    raise ParamError(f"structured_outputs.{name} must be in [0, {hi})",
                                     "structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)
