"""Thinking-token budget (`SamplingParams.thinking_token_budget`, vLLM's name): once a request
has produced that many tokens inside its reasoning (`<think>` ... `</think>`), the end-of-reasoning
sequence (`thinking_end_token_ids`, e.g. `</think>` "\\n\\n") is forced, one token a step, and the
model goes on to answer.

The scheduler keeps one `ThinkingBudget` per budgeted request and reads the request's known output
tokens into it. When a step samples for the request, `forced` says which token (if any) each
sampled row must take; the runner masks that row's logits to the one token (sampler.py), which
overrides every other mask. Under async scheduling a request runs ahead (is scheduled before its
pending tokens are known) only while no forcing is possible in reach (`can_run_ahead`), so the
forced tokens are always computed from known tokens; with speculative decoding every draft row
gets the token forced after the drafts before it, and verification rejects a draft that differs.
"""
from __future__ import annotations

from .sampling_params import SamplingParams


class ThinkingBudget:
    """Reasoning tokens of one request so far, over all its reasoning blocks (a block opened again
    after the budget is spent is closed at once)."""

    def __init__(self, sp: SamplingParams, prompt_token_ids: list[int]):
        self.budget = sp.thinking_token_budget
        self.start = sp.thinking_start_token_id
        self.end = list(sp.thinking_end_token_ids)
        # the prompt opened the reasoning (as the parser decides: a start tag after the last end tag)
        tag = next((t for t in reversed(prompt_token_ids) if t in (self.start, self.end[0])), None)
        self.open = tag is not None and tag == self.start
        self.count = 0  # reasoning tokens so far
        self.closing = 0  # > 0: tokens of the forced end sequence emitted so far (not all yet)
        self.num_seen = 0  # output tokens read

    def state(self) -> tuple[bool, int, int]:
        return self.open, self.count, self.closing

    def _step(self, state: tuple[bool, int, int], tok: int) -> tuple[bool, int, int]:
        is_open, count, closing = state
        if closing:  # the rest of the forced sequence
            closing += 1
            return is_open, count, closing if closing < len(self.end) else 0
        if is_open:
            if tok == self.end[0]:  # closed: by the model, or forced (then the rest follows)
                return False, count, 1 if count >= self.budget and len(self.end) > 1 else 0
            return True, count + 1, 0
        return tok == self.start, count, 0

    def _forced(self, state: tuple[bool, int, int]) -> int:
        is_open, count, closing = state
        if closing:
            return self.end[closing]
        return self.end[0] if is_open and count >= self.budget else -1

    def read(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Advance over the request's output tokens not read yet (`token_ids`: prompt + known
        outputs; only the new ones are copied)."""
        s = self.state()
        for tok in token_ids[num_prompt_tokens + self.num_seen:]:
            s = self._step(s, tok)
        self.open, self.count, self.closing = s
        self.num_seen = len(token_ids) - num_prompt_tokens

    def forced(self, drafts: list[int]) -> list[int] | None:
        """The token each sampled row must take (-1: free): the row after the known tokens, then
        one after each draft; None when every row is free."""
        s, out = self.state(), []
        for tok in [None, *drafts]:
            if tok is not None:
                s = self._step(s, tok)
            out.append(self._forced(s))
        return out if any(t >= 0 for t in out) else None

    def can_run_ahead(self, num_unknown: int) -> bool:
        """No token is forced at the position after `num_unknown` tokens not known yet, whatever
        they are (each may be a reasoning token, the first of them an opening tag)."""
        if self.closing:
            return False
        if self.open:
            return self.count + num_unknown < self.budget
        return self.start is None or self.count + num_unknown - 1 < self.budget
