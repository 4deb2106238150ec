"""Vectorised sampling over the batch: penalties, temperature, top-k, top-p, min-p, greedy,
per-request seeds, logprobs. Python loops only run over seeded requests (one generator each),
never over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .messages import LogprobsEntry


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int, 0 = off
    top_p: torch.Tensor | None = None  # [B] float, 1 = off
    min_p: torch.Tensor | None = None  # [B] float, 0 = off
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] counts of generated tokens
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token occurs in the prompt
    # rows still under min_tokens: (row index tensor, token id tensor) pairs to mask
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    generators: dict[int, torch.Generator] | None = None  # row → per-request generator
    max_num_logprobs: int | None = None  # None: nobody asked
    # (row, token id, bias) tensors: added to the logits (logit_bias)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, [len(rows), V] bool) only these tokens may be sampled (allowed_token_ids)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, [len(rows), ceil(V / 32)] int32 bits) structured outputs' allowed tokens
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids): each of these rows must take its token (thinking_token_budget)
    forced: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def masks_logits(self) -> bool:
        return (self.banned is not None or self.logit_bias is not None or self.allowed is not None
                or self.grammar is not None or self.forced is not None)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's token bitmask (bit j of word i: token 32 i + j) → [rows, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def restrict(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Tokens outside `allowed` get -inf in the given rows."""
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_token_masks(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Grammar, allowed_token_ids, logit_bias, banned tokens (min_tokens, bad_words): before
    penalties and temperature, as vLLM does."""
    if md.grammar is not None:
        rows, bits = md.grammar
        if logits.is_cuda:  # xgrammar's kernel, in place: no [rows, V] temporaries
            import xgrammar as xgr
            full = torch.full((logits.shape[0], bits.shape[1]), -1, dtype=torch.int32,
                              device=logits.device)  # -1: every token allowed
            full[rows] = bits
            xgr.apply_token_bitmask_inplace(logits, full)
        else:  # the torch reference (faster than xgrammar's CPU op on small hosts)
            logits = restrict(logits, rows, unpack_bitmask(bits, logits.shape[-1]))
    if md.allowed is not None:
        logits = restrict(logits, *md.allowed)
    if md.logit_bias is not None:
        rows, toks, vals = md.logit_bias
        logits = logits.index_put((rows, toks), vals, accumulate=True)
    if md.banned is not None:
        logits = logits.index_put(md.banned, torch.tensor(float("-inf"), device=logits.device))
    return logits


def force_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row of `rows` keeps only its token (logit 0, the rest -inf): whatever the other
    masks, penalties, temperature and top-k / top-p, it is sampled (and greedily chosen)."""
    one = torch.full((len(rows), logits.shape[-1]), float("-inf"), dtype=logits.dtype,
                     device=logits.device).scatter_(1, tokens[:, None], 0.0)
    return logits.index_put((rows,), one)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.repetition_penalty is not None:
        seen = (md.output_counts > 0) | md.prompt_mask
        rp = md.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        # a tiny (huge) penalty may overflow finite logits to inf (-inf): keep them finite
        big = torch.finfo(logits.dtype).max
        penalised = torch.where(logits.isfinite(), penalised.clamp(-big, big), logits)
        logits = torch.where(seen, penalised, logits)
    if md.frequency_penalty is not None:
        counts = md.output_counts.to(logits.dtype)
        logits = logits - md.frequency_penalty[:, None] * counts
        logits = logits - md.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.min_p is not None:
        probs = logits.softmax(-1)
        thresh = probs.amax(-1, keepdim=True) * md.min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, idx = logits.sort(-1, descending=True)
    V = logits.shape[-1]
    if md.top_k is not None:
        k = torch.where(md.top_k > 0, md.top_k, V).clamp(max=V)
        ranks = torch.arange(V, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if md.top_p is not None:
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches p (the top token always stays)
        before = probs.cumsum(-1) - probs
        drop = before >= md.top_p[:, None]
        drop[:, 0] = False  # (also when top_p is 0 in float32, e.g. 1e-320)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


def argmax_rows(x: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """x.argmax(-1) of a [B, V] tensor, the first maximum on ties as torch's. One argmax over a
    long row runs as a single reduction (36 us for Llama's 128k vocabulary on an H200, 1 % of a
    W2 step): a few rows go in two passes instead, over `chunks` slices of each row, then over
    the slices' maxima. Rows of lengths `chunks` does not divide keep the plain argmax."""
    B, V = x.shape
    while chunks > 1 and V % chunks:
        chunks //= 2
    if chunks == 1 or V // chunks < 1024:
        return x.argmax(-1)
    parts = x.reshape(B, chunks, V // chunks)
    inner = parts.argmax(-1)  # [B, chunks]: the first maximum of each slice
    best = parts.gather(-1, inner[..., None]).squeeze(-1).argmax(-1)  # the first slice holding it
    return best * (V // chunks) + inner.gather(-1, best[:, None]).squeeze(-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return argmax_rows(logits) if logits.is_cuda and logits.shape[0] <= 8 else logits.argmax(-1)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (sampled token ids [B], raw logprobs [B, V] or None)."""
    if md.all_greedy and md.max_num_logprobs is None and not md.masks_logits and md.output_counts is None:
        return _argmax(logits), None  # exact in any dtype: skips a [B, V] float copy
    logits = logits.float()
    raw_logprobs = logits.log_softmax(-1) if md.max_num_logprobs is not None else None
    probs, greedy = target_probs(logits, md)
    if probs is None:
        return greedy, raw_logprobs
    # exponential race (Gumbel-max): argmax(p / q) with q ~ Exp(1) samples from p
    gens = md.generators or {}
    q = torch.empty_like(probs)
    if len(gens) < probs.shape[0]:  # rows without a seed: the shared generator (every row's
        q.exponential_()            # drawn, as before, so their stream does not change)
    for row, gen in gens.items():
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(-1)
    return torch.where(md.temperature > 0, sampled, greedy), raw_logprobs


def target_probs(logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The distribution every row samples from (masks, penalties, temperature, top-k / top-p /
    min-p applied; None when all rows are greedy) and the argmax of the processed logits.
    Plain sampling draws from it; speculative decoding verifies drafts against it."""
    logits = logits.float()
    if md.masks_logits:
        logits = apply_token_masks(logits, md)
    if md.output_counts is not None:
        logits = apply_penalties(logits, md)
    if md.forced is not None:  # last: it overrides the masks and penalties
        logits = force_tokens(logits, *md.forced)
    greedy = _argmax(logits)
    if md.all_greedy:
        return None, greedy
    temp = torch.where(md.temperature > 0, md.temperature, 1.0)
    logits = apply_top_k_top_p_min_p(logits / temp[:, None], md)
    return logits.softmax(-1), greedy


def gather_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num: list[int]) -> list[LogprobsEntry]:
    """Sampled/target token logprob + rank, then the top-`num[i]` alternatives, per row."""
    k = max(num)
    chosen = raw_logprobs.gather(-1, token_ids[:, None])
    ranks = (raw_logprobs > chosen).sum(-1) + 1
    top_lp, top_ids = raw_logprobs.topk(k, -1) if k > 0 else (None, None)
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    ids = token_ids.tolist()
    top_lp = top_lp.tolist() if k > 0 else None
    top_ids = top_ids.tolist() if k > 0 else None
    out = []
    for i, n in enumerate(num):
        e = LogprobsEntry([ids[i]], [chosen[i]], [ranks[i]])
        if n:
            e.token_ids += top_ids[i][:n]
            e.logprobs += top_lp[i][:n]
            e.ranks += list(range(1, n + 1))
        out.append(e)
    return out
