"""What both front ends (the offline `LLM` and the API server) do before the engine sees a
request: load the tokenizer, find the end-of-sequence ids, build the EngineCoreRequest. A neutral
module so that the server does not import the offline `llm.py` (and the reverse)."""
from __future__ import annotations

import time

import msgspec

from .messages import EngineCoreRequest
from .sampling_params import ParamError, SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The HF tokenizer, or None for a model directory without one (e.g. a dummy-weight
    benchmark config): such an engine takes token ids and returns token ids. A tokenizer that
    ships its own code (auto_map) runs it only with --trust-remote-code."""
    import os
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:  # an explicit False: transformers would otherwise ask [y/N] on a terminal
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"the tokenizer of {path!r} ships its own code (auto_map in "
                         "tokenizer_config.json): pass --trust-remote-code to run it "
                         "(LLM(trust_remote_code=True))") from None


# generation_config.json fields that are sampling defaults for a request that leaves them out
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config(model_dir: str) -> dict:
    """The checkpoint's generation_config.json; without one, config.json (whose generation
    fields transformers' GenerationConfig.from_model_config, and so vLLM, read instead)."""
    import json
    import os
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def generation_overrides(text: str | None) -> dict:
    """--override-generation-config: a JSON object of generation_config.json's sampling fields
    (ValueError naming the flag or the field otherwise)."""
    if not text:
        return {}
    import json
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--override-generation-config is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. "
                         "'{\"temperature\": 0.5}'")
    unknown = sorted(set(data) - set(GENERATION_DEFAULTS) - {"max_new_tokens"})
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(map(repr, unknown))} not a sampling "
                         f"field; use {', '.join(GENERATION_DEFAULTS)} or max_new_tokens")
    # values too: every request would otherwise fail with them (offline: a TypeError)
    for k, v in data.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or (k == "max_new_tokens" and not isinstance(v, int))):
            raise ValueError(f"--override-generation-config: {k} must be a number, got {v!r}")
    from .sampling_params import SamplingParams
    try:
        SamplingParams(**{("max_tokens" if k == "max_new_tokens" else k): v
                          for k, v in data.items() if v is not None}).validate()
    except ValueError as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    return data


def sampling_defaults(model_dir: str, source: str = "auto", override: str | None = None) -> dict:
    """The SamplingParams fields the generation config sets (vLLM's get_diff_sampling_param:
    `max_new_tokens` becomes `max_tokens`). `source` (--generation-config): auto, the model's;
    vllm, none; else a directory with a generation_config.json. `override`
    (--override-generation-config) goes on top."""
    gen = {} if source == "vllm" else generation_config(model_dir if source == "auto" else source)
    gen = dict(gen, **generation_overrides(override))
    out = {k: gen[k] for k in GENERATION_DEFAULTS if gen.get(k) is not None}
    if isinstance(gen.get("max_new_tokens"), int):
        out["max_tokens"] = gen["max_new_tokens"]
    return out


def eos_token_ids_of(tokenizer, model_dir: str) -> list[int]:
    """All end-of-sequence ids (the generation config may list several, e.g. Llama 3's
    eot/eom), then the tokenizer's."""
    eos = generation_config(model_dir).get("eos_token_id")
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if isinstance(eos, int) else [])
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as is, and with a leading space when that
    gives a different first token in as many tokens (a word mid-sentence)."""
    out = []
    for word in words:
        if not isinstance(word, str) or not word.strip():  # no tokens to ban (was an IndexError)
            raise ParamError("bad_words must be non-empty words (not only whitespace)", "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [w for w in out if w]


def engine_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   eos_token_ids: list[int], priority: int = 0, cache_salt: str | None = None,
                   index: int = 0, tokenizer=None, lora_request=None) -> EngineCoreRequest:
    """The EngineCoreRequest for choice `index` of a request: extra EOS ids become stop tokens,
    seeded choices get seed + index so they still differ from each other, and `bad_words` are
    tokenized (with `tokenizer`) into `bad_words_token_ids`, and a thinking_token_budget given
    without its tags gets the tokenizer's <think> / </think>."""
    changes = {}
    if params.bad_words and not params.bad_words_token_ids:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids instead")
        changes["bad_words_token_ids"] = bad_words_token_ids(tokenizer, params.bad_words)
    if params.thinking_token_budget is not None and not params.thinking_end_token_ids:
        from .parse.families import with_thinking_tags  # (offline: the tokenizer's <think> tags)
        params = with_thinking_tags(params, tokenizer)
    if len(eos_token_ids) > 1 and not params.ignore_eos:
        extra = [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra:
            changes["stop_token_ids"] = params.stop_token_ids + extra
    if params.seed is not None and index:
        changes["seed"] = params.seed + index
    if changes:
        params = msgspec.structs.replace(params, **changes)
    return EngineCoreRequest(request_id, prompt_token_ids, params, time.monotonic(), priority,
                             cache_salt, eos_token_ids[0] if eos_token_ids else None, lora_request)
