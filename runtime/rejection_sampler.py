"""Rejection sampling for speculative decoding: keeps the output distribution exactly the
target's, whatever the drafts were.

A request that verifies k draft tokens has k + 1 rows of target probabilities p_0 .. p_k (row j
scores the token after draft j; all sampling transforms already applied: masks, penalties,
temperature, top-k / top-p / min-p). Draft j + 1 is accepted with probability
min(1, p_j(d) / q_j(d)); at the first rejection the token comes from the residual
max(p_j - q_j, 0) (renormalised), and if all k are accepted a bonus token comes from p_k. Each
emitted token is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).
Drafts without probabilities (n-gram lookup, greedy draft models) are one-hot: q_j(d) = 1, so a
draft is accepted with probability p_j(d) and the residual is p_j with d removed. Greedy rows
accept a draft iff it is the argmax and otherwise emit the argmax: exactly the tokens of plain
greedy decoding.

Vectorised over the batch; Python only runs per seeded request (its generator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecBatch:
    """The drafts of one verify step. Row layout: request i owns rows
    `row_start[i] .. row_start[i] + num_drafts[i]` (its drafts' rows, then the bonus row)."""
    draft_ids: torch.Tensor  # [B, K] int64, padded with 0 past num_drafts
    num_drafts: torch.Tensor  # [B] int64
    row_start: torch.Tensor  # [B] int64
    draft_probs: torch.Tensor | None = None  # [R, V] q of each draft row (bonus rows ignored); None: one-hot


def _random(shape_like: torch.Tensor, kind: str, row_of: torch.Tensor,
            generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """Uniform or Exp(1) noise per row; rows of seeded requests from their generator (rows
    with row_of -1 draw nothing from it)."""
    x = torch.empty_like(shape_like, dtype=torch.float32)
    x.uniform_() if kind == "uniform" else x.exponential_()
    for req, gen in (generators or {}).items():
        for r in torch.nonzero(row_of == req).flatten().tolist():
            x[r].uniform_(generator=gen) if kind == "uniform" else x[r].exponential_(generator=gen)
    return x


def rejection_sample(probs: torch.Tensor | None, greedy_ids: torch.Tensor, temperature: torch.Tensor,
                     spec: SpecBatch, generators: dict[int, torch.Generator] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K + 1], num_accepted [B]): request i emits
    `tokens[i, :num_accepted[i] + 1]` (its accepted drafts, then the recovered or bonus token).

    probs: [R, V] target probabilities (None when every request is greedy); greedy_ids: [R]
    argmax of the processed target logits; temperature: [B] (0: greedy);
    generators: request index → its generator (seeded requests)."""
    dev = greedy_ids.device
    B, K = spec.draft_ids.shape
    R = greedy_ids.shape[0]
    j = torch.arange(K, device=dev)
    valid = j[None, :] < spec.num_drafts[:, None]  # [B, K]
    rows = (spec.row_start[:, None] + j[None, :]).clamp(max=R - 1)  # draft row of (i, j)
    drafts = spec.draft_ids
    greedy_req = temperature <= 0
    accept = greedy_ids[rows] == drafts  # greedy rule
    row_req = torch.repeat_interleave(torch.arange(B, device=dev), spec.num_drafts + 1, output_size=R)  # (no sync)
    if probs is not None:
        p_d = probs[rows, drafts]  # [B, K]
        q_d = 1.0 if spec.draft_probs is None else spec.draft_probs[rows, drafts]
        # a seeded request draws one uniform per draft, none for its bonus row: one without
        # drafts then draws what plain sampling would (its tokens do not depend on whether
        # others in the batch verify drafts)
        is_draft = torch.arange(R, device=dev) - spec.row_start[row_req] < spec.num_drafts[row_req]
        u = _random(greedy_ids, "uniform", torch.where(is_draft, row_req, -1), generators)[rows]
        # u < p / q, written without a division (q may be 0 where p is too)
        stochastic = u * q_d < p_d
        accept = torch.where(greedy_req[:, None], accept, stochastic)
    accept &= valid
    num_acc = accept.to(torch.int64).cumprod(1).sum(1)  # leading accepted drafts
    final_row = spec.row_start + num_acc  # the row whose distribution the last token comes from
    final = greedy_ids[final_row]
    if probs is not None:
        resid = probs[final_row]
        rejected = num_acc < spec.num_drafts  # else the bonus row: sample p itself
        d = drafts.gather(1, num_acc.clamp(max=max(K - 1, 0))[:, None])[:, 0]
        if spec.draft_probs is None:
            resid = resid.scatter(1, d[:, None], torch.where(rejected[:, None], 0.0, resid.gather(1, d[:, None])))
        else:
            q = spec.draft_probs[final_row]
            resid = torch.where(rejected[:, None], (resid - q).clamp(min=0), resid)
        # a rejection leaves mass elsewhere (p(d) < q(d) somewhere), but guard round-off
        empty = resid.sum(-1, keepdim=True) <= 0
        resid = torch.where(empty, probs[final_row], resid)
        e = _random(resid, "exp", torch.arange(B, device=dev), generators)
        sampled = (resid / e).argmax(-1)  # exponential race: samples resid / sum(resid)
        final = torch.where(greedy_req, final, sampled)
    out = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
    out = out.scatter(1, num_acc[:, None], final[:, None])
    return out, num_acc
