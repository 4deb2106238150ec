"""Incremental detokenization (tokenizers' DecodeStream) and stop-string matching."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


_SPECIAL: dict[int, tuple[object, frozenset[int]]] = {}  # id(backend) → (backend, its ids)


def special_token_ids(backend) -> frozenset[int]:
    """The ids skip_special_tokens skips: the tokenizer's added tokens marked special (none
    known for a tokenizer without that listing: nothing is dropped then)."""
    known = _SPECIAL.get(id(backend))
    if known is None or known[0] is not backend:
        try:
            ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        except Exception:  # noqa: BLE001
            ids = frozenset()
        known = _SPECIAL[id(backend)] = (backend, ids)
    return known[1]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, with the prompt as left context so the first
    token's leading space and multi-byte characters come out as in a full decode."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, kept_special_token_ids: list[int] | None = None):
        self.backend = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        # skip_special_tokens but for the kept ones (a parser's markers): the others are
        # dropped before decoding, which is what skipping them does
        self.dropped = special_token_ids(self.backend) - set(kept_special_token_ids) \
            if skip_special_tokens and kept_special_token_ids is not None else set()
        if self.dropped:
            skip_special_tokens = False
        # a few prompt tokens are enough context for the decoder's prefix-space handling
        self.skip_special = skip_special_tokens
        self.context = [t for t in prompt_token_ids if t not in self.dropped][-8:]
        self.stream = DecodeStream(ids=self.context, skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens  # as vLLM: stop strings count only after this many tokens
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.sent = 0  # characters handed out as deltas

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet. Until the request ends, the last max_stop_len - 1 characters
        are held back: they may be the start of a stop string that must never be streamed."""
        end = len(self.text)
        if not final and self.stop:
            end = max(self.sent, end - (self.max_stop_len - 1))
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def push(self, token_ids: list[int]) -> tuple[str, str | None, int]:
        """Add tokens; returns (new text, matched stop string or None, tokens used). After a
        match the text is cut at the stop string (kept when include_stop_str_in_output) and the
        tokens after the one that completed it are not taken (several tokens arrive at once
        with speculative decoding: those past a stop must not count as output)."""
        before = len(self.text)
        for n, tok in enumerate(token_ids, 1):
            self.token_ids.append(tok)
            start = len(self.text)
            if tok in self.dropped:
                continue
            try:
                piece = self.stream.step(self.backend, tok)
            except Exception:  # noqa: BLE001  (invalid byte sequences from a sampled token)
                piece = self._resync()
            if piece:
                self.text += piece
                if len(self.token_ids) <= self.min_tokens:
                    continue
                matched = self._check_stop(start)
                if matched is not None:
                    return self.text[before:], matched, n
        return self.text[before:], None, len(token_ids)

    def _resync(self) -> str:
        """Decode everything so far in one go and restart the stream after it."""
        ctx = self.context + [t for t in self.token_ids if t not in self.dropped]
        full = self.backend.decode(ctx, skip_special_tokens=self.skip_special)
        prefix = self.backend.decode(self.context, skip_special_tokens=self.skip_special)
        self.stream = DecodeStream(ids=ctx[-8:], skip_special_tokens=self.skip_special)
        new = full[len(prefix):] if full.startswith(prefix) else full
        if new.startswith(self.text):
            return new[len(self.text):]
        return ""

    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, before - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s
