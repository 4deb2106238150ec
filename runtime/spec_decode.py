"""Speculative decoding: proposers (one registry, as models/registry.py) and the per-step data
they get.

Flow: a step samples, then the proposer guesses the next k tokens of each request that sampled
(`propose`); they travel back to the scheduler with the sampled tokens, which schedules them as
extra query tokens of the request's next step (1 + k tokens); the model runner scores all of them
in one forward and the rejection sampler (runtime/rejection_sampler.py) keeps the longest prefix
the target agrees with, plus one token of its own. The scheduler rolls the rejected tokens'
KV slots back.

A proposer sees, after each step (`ProposeContext`): the tokens each request emitted (on the
device), where they sit, the input batch (host token ids, block table) and the target's last-layer
hidden states of the step. An MTP or EAGLE head is a proposer that reads those hidden states.

Backoff (scheduler `_count_miss`): a request whose drafts keep being rejected pauses drafting
for a while. The plan names the paused requests; the proposer does no work for them (no draft
model forward, no MTP / EAGLE pass) and, when one resumes, catches up on the positions it missed
in one batched pass before its step (`Stateful`): a draft model prefills the missed tokens into
its KV cache, an MTP layer / EAGLE head stores the missed pairs from a per-request ring of the
target's states that steps with paused requests write.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..models.config_queries import rope_max_len
from ..models.registry import Registry
from .config import SpecDecodeParams

if TYPE_CHECKING:
    from .model_runner import ModelRunner, StepInputs

log = logging.getLogger("rankserve.spec_decode")

PROPOSERS: Registry[type] = Registry("speculative decoding method")


def lookahead_slots(spec: SpecDecodeParams | None) -> int:
    """KV slots past a step's tokens that its proposer writes (the KV of the tokens it feeds
    itself: a draft model k, an MTP layer or EAGLE head k - 1, as it starts one position
    earlier); the scheduler reserves them."""
    if spec is None:
        return 0
    k = spec.num_speculative_tokens
    return {"draft_model": k, "mtp": k - 1, "eagle": k - 1, "eagle3": k - 1}.get(spec.method, 0)


@dataclass
class ProposeContext:
    """The requests that sampled this step, in sampling order."""
    req_ids: list[str]
    rows: np.ndarray  # [B] input-batch rows
    base_pos: np.ndarray  # [B] position of each request's first emitted token
    tokens: torch.Tensor  # [B, K + 1] emitted tokens (device): the first num_accepted + 1 count
    num_accepted: torch.Tensor  # [B] (device)
    hidden: torch.Tensor  # [T, H] the target's last-layer hidden states of the step
    logits_indices: torch.Tensor  # rows of `hidden` that were scored, request by request
    num_drafts: np.ndarray | None = None  # [B] drafts each request verified (None: none did)
    _host: tuple[list[list[int]], list[int]] | None = None
    _parent: tuple[ProposeContext, list[int]] | None = None  # (context selected from, its rows)

    def select(self, idx: np.ndarray, stage) -> ProposeContext:
        """The requests `idx` (host) only; `stage` copies a host array to the device."""
        ns = np.zeros(len(self.req_ids), dtype=np.int64) if self.num_drafts is None else self.num_drafts
        first = np.concatenate([[0], np.cumsum(ns + 1)[:-1]])
        scored = np.concatenate([np.arange(first[i], first[i] + ns[i] + 1) for i in idx])
        d = stage(idx)
        sub = ProposeContext([self.req_ids[i] for i in idx], self.rows[idx], self.base_pos[idx],
                             self.tokens[d], self.num_accepted[d], self.hidden,
                             self.logits_indices[stage(scored)],
                             None if self.num_drafts is None else self.num_drafts[idx])
        root, at = self._parent or (self, None)
        sub._parent = (root, idx.tolist() if at is None else [at[i] for i in idx])
        return sub

    @classmethod
    def of(cls, tokens: torch.Tensor, num_accepted: torch.Tensor) -> ProposeContext:
        """Only the step's results (for `host`)."""
        return cls([], np.zeros(0, np.int64), np.zeros(0, np.int64), tokens, num_accepted, None, None)

    def host(self, extra: torch.Tensor | None = None):
        """(emitted tokens, num accepted) on the host, with the rows of `extra` ([B, n] on the
        device) if given: one device-to-host copy a step, shared with the context this one was
        selected from (every copy is a sync, and the device idles while the host launches
        what follows one)."""
        root, idx = self._parent or (self, None)
        got = None
        if root._host is None:
            B, K = root.tokens.shape
            parts = [root.tokens.flatten(), root.num_accepted.to(root.tokens.dtype)]
            flat = torch.cat(parts + ([extra.flatten().to(root.tokens.dtype)] if extra is not None else [])).tolist()
            root._host = ([flat[i * K:(i + 1) * K] for i in range(B)], flat[B * K:B * K + B])
            if extra is not None:
                n = extra.shape[1]
                got = [flat[B * K + B + i * n:B * K + B + (i + 1) * n] for i in range(extra.shape[0])]
        elif extra is not None:
            got = extra.tolist()
        toks, acc = root._host
        host = (toks, acc) if idx is None else ([toks[i] for i in idx], [acc[i] for i in idx])
        return host if extra is None else (host, got)


class Proposer:
    """Base: no KV cache of its own, nothing to do per forward."""

    def __init__(self, runner: ModelRunner, params: SpecDecodeParams):
        self.runner, self.params, self.k = runner, params, params.num_speculative_tokens
        self.lookahead = lookahead_slots(params)  # KV slots it writes past a step's tokens

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def compile(self) -> dict[str, float]:
        return {}

    def logits_gemms(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
        """(function, input width) of each logits GEMM of its own that the proposer runs on
        one state a request (at most max_num_seqs rows), through `draft_logits`."""
        return []

    def draft_logits(self, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """fn(h) at the target's padded row counts: the proposing requests change from step to
        step, and each new GEMM shape would make cuBLAS load kernels, blocking the host
        (model_runner.logits_rows)."""
        from . import model_runner  # (model_runner imports this module)
        return model_runner.padded_logits(fn, h)

    def warm_logits(self) -> None:
        """Each of `logits_gemms` at every row count `draft_logits` can run it at (start-up, CUDA)."""
        from . import model_runner
        r = self.runner
        for fn, width in self.logits_gemms():
            model_runner.warm_logits_rows(fn, r.cfg.scheduler.max_num_seqs, width, r.dtype, r.device)

    def on_forward(self, inp: StepInputs, hidden: torch.Tensor) -> None:
        """Called on every rank right after the target's forward of each step (hidden: its
        last-layer hidden states, [T, H]). Sets `step_active`: the step's requests `propose`
        sees (the others get no proposals, None)."""
        self.step_active = ~inp.paused

    def propose(self, ctx: ProposeContext) -> list[list[int]]:
        """Drafts of the active requests that sampled (`ctx` holds only those)."""
        raise NotImplementedError

    def finish(self, ctx: ProposeContext) -> None:
        """Instead of `propose` for requests that pause from now on (their proposals would be
        dropped): only what keeps the proposer's state right up to the emitted tokens."""

    def room(self, ctx: ProposeContext, num_tokens: np.ndarray) -> np.ndarray:
        """Drafts each request may get: k, fewer near max_model_len. (Every request drafts: a
        structured output's drafts are verified with a grammar mask per draft position,
        `StructuredOutputManager.fill_bitmask`.)"""
        return np.clip(self.runner.max_model_len - 1 - num_tokens, 0, self.k)

    # ---- for proposers that decode ahead one token a request at a time (draft model, MTP) ----
    def ahead_table(self, ctx: ProposeContext, out: torch.Tensor | None = None) -> torch.Tensor:
        """The requests' block tables on the device (into `out` if given), wide enough for the
        slots the passes write: up to base + accepted + k - 1 (the lookahead the scheduler
        reserved past the step's tokens)."""
        r, B = self.runner, len(ctx.req_ids)
        width = min(int(-(-(ctx.base_pos.max() + 2 * self.k) // r.block_size)), r.batch.max_blocks_per_req)
        return r.batch.stage(r.batch.block_table[ctx.rows, :width], None if out is None else out[:B, :width])

    def ahead_slots(self, table: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position clamped below max_model_len, KV slot: -1 past it) of one token a request."""
        limit, bs = self.runner.max_model_len, self.runner.block_size
        p = pos.clamp(max=limit - 1)
        blk = table.gather(1, (p // bs)[:, None])[:, 0].long()
        return p, torch.where(pos < limit, blk * bs + p % bs, -1)

    def ahead_result(self, ctx: ProposeContext, drafts: torch.Tensor) -> list[list[int]]:
        """[B, k] greedy drafts → the lists the scheduler takes (the result rank's, cut to room)."""
        if self.runner.pi.tp_rank != 0:
            return [[] for _ in ctx.req_ids]
        (_, acc), rows = ctx.host(drafts)  # (with the step's tokens, unless those came back)
        room = self.room(ctx, ctx.base_pos + np.asarray(acc) + 1)
        return [row[:n] for row, n in zip(rows, room.tolist())]


@PROPOSERS.register("ngram")
class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the k tokens that followed it
    (continued periodically when the context ends first).
    Vectorised over the batch: for each n, a [B, L] comparison per n-gram position."""

    def propose(self, ctx: ProposeContext) -> list[list[int]]:
        if self.runner.pi.tp_rank != 0:  # only the result rank's proposals are read
            return [[] for _ in ctx.req_ids]
        toks, acc = ctx.host()
        b = self.runner.batch
        toks, acc = np.asarray(toks, dtype=np.int64), np.asarray(acc, dtype=np.int64)
        lens = ctx.base_pos + acc + 1
        # the emitted tokens, so the lookup sees them (the next plan writes the same values)
        j = np.arange(toks.shape[1])
        emitted = j[None, :] <= acc[:, None]
        cols = np.minimum(ctx.base_pos[:, None] + j[None, :], b.token_ids.shape[1] - 1)
        b.token_ids[np.broadcast_to(ctx.rows[:, None], toks.shape)[emitted], cols[emitted]] = toks[emitted]
        return propose_ngram(b.token_ids[ctx.rows], lens, self.params.prompt_lookup_min,
                             self.params.prompt_lookup_max, self.room(ctx, lens))


def propose_ngram(tokens: np.ndarray, lens: np.ndarray, n_min: int, n_max: int,
                  room: np.ndarray) -> list[list[int]]:
    """tokens: [B, >= max(lens)] (row i valid up to lens[i]); room: most drafts per row."""
    B = tokens.shape[0]
    if B == 0:
        return []
    L = int(lens.max())
    tokens = tokens[:, :L]
    cols = np.arange(L)
    found = np.full(B, -1, dtype=np.int64)  # start of the continuation, per row
    for n in range(n_max, n_min - 1, -1):
        todo = (found < 0) & (lens > n) & (room > 0)
        if not todo.any():
            break
        idx = np.flatnonzero(todo)
        t, ln = tokens[idx], lens[idx]
        # match[i, p]: tokens[p : p + n] == the last n tokens, for p + n < len (an earlier copy)
        suffix = t[np.arange(len(idx))[:, None], ln[:, None] - n + np.arange(n)[None, :]]
        P = L - n
        match = np.ones((len(idx), P), dtype=bool)
        for j in range(n):
            match &= t[:, j:j + P] == suffix[:, j:j + 1]
        match &= cols[None, :P] + n < ln[:, None]
        has = match.any(1)
        last = P - 1 - np.argmax(match[:, ::-1], axis=1)  # the latest occurrence
        found[idx[has]] = last[has] + n
    # the continuation runs up to the end of the context; past it the text repeats with the
    # period of the match (the tokens from the continuation's start on), so every hit gives
    # `room` drafts: uniform verify batches replay a CUDA graph
    hit = found >= 0
    period = np.maximum(lens - found, 1)
    k = int(room.max())
    cols = found[:, None] + np.arange(k)[None, :] % period[:, None]
    drafts = np.take_along_axis(tokens, np.clip(cols, 0, L - 1), 1)
    return [drafts[i, :room[i]].tolist() if hit[i] else [] for i in range(B)]


class Stateful:
    """Mixin of the proposers with per-request state in step with the target (a draft model's
    KV cache, an MTP layer's / EAGLE head's pairs). `valid[row]`: the state is right for the
    positions below it. A paused request's state stays behind; when the request is active
    again, `catch_up` brings it up to the step's first position before the step's own work,
    at most `catch_up_budget` tokens a step (the rest the next steps: until then the request
    stays inactive, as if paused)."""

    def init_state(self) -> None:
        r = self.runner
        self.valid = np.zeros(r.cfg.scheduler.max_num_seqs, dtype=np.int64)
        self.catch_up_budget = max(1, r.cfg.scheduler.max_num_batched_tokens // 2)

    def track(self, inp: StepInputs) -> None:
        """Set `step_active` (catching up first where needed) and, for `after_step`, `_valid`."""
        # a (re)started request: its prefix computed before (prefix-cache hit) counts as done;
        # positions from the step's first on are recomputed, so they count only if active
        valid = np.minimum(np.where(inp.new, inp.starts, self.valid[inp.rows]), inp.starts)
        active = ~inp.paused
        lag = np.flatnonzero(active & (valid < inp.starts))
        if len(lag):
            # the missed positions: up to the step's first (the tokens before it are on the host)
            p0, p1 = self.catch_up_range(inp, lag, valid[lag], inp.starts[lag])
            keep = p1 > p0
            n = np.minimum(p1 - p0, self.catch_up_budget)  # the first requests first
            n = np.minimum(n, np.maximum(self.catch_up_budget - np.concatenate([[0], np.cumsum(n)[:-1]]), 0))
            keep &= n > 0
            if keep.any():
                self.catch_up(inp, lag[keep], p0[keep], p0[keep] + n[keep])
            valid[lag] = np.where(keep, p0 + n, valid[lag])
            active &= valid >= inp.starts  # still behind: inactive this step
        self.step_active, self._valid = active, valid

    def after_step(self, inp: StepInputs) -> None:
        self.valid[inp.rows] = np.where(self.step_active, inp.seq_lens, self._valid)

    def catch_up_range(self, inp, lag, p0, p1) -> tuple[np.ndarray, np.ndarray]:
        return p0, p1

    def catch_up(self, inp: StepInputs, idx: np.ndarray, p0: np.ndarray, p1: np.ndarray) -> None:
        """Bring the state of the step's requests `idx` from position p0 to p1 (host arrays),
        in one pass, before the step's own work."""
        raise NotImplementedError

    def ranges(self, rows: np.ndarray, p0: np.ndarray, p1: np.ndarray):
        """Token layout of the position ranges [p0, p1) of requests `rows` (host): (query
        start locations, row of each token, position of each token, KV slot of each token)."""
        r, bs = self.runner, self.runner.block_size
        n = p1 - p0
        cu = np.concatenate([[0], np.cumsum(n)])
        req = np.repeat(np.arange(len(rows)), n)
        pos = np.arange(int(cu[-1])) - cu[:-1][req] + p0[req]
        slots = r.batch.block_table[rows[req], pos // bs].astype(np.int64) * bs + pos % bs
        return cu, rows[req], pos, slots


class OwnForward:
    """Mixin of the proposers that run a forward of their own on the target's ranks (draft
    model, EAGLE head, MTP layer): their own device input buffers and, over them, their own
    compiled forward and decode (and verify) CUDA graphs (runtime/compilation.py)."""

    def own_forward(self, model, hidden_size: int | None) -> None:
        from .input_batch import InputBatch
        r, cfg = self.runner, self.runner.cfg
        # device buffers of its own (the target's hold the target's step), CUDA graphs over them
        self.batch = InputBatch(cfg.scheduler.max_num_seqs, r.max_model_len, r.block_size,
                                cfg.scheduler.max_num_batched_tokens, hidden_size, r.dtype, r.device)
        self.batch.token_ids = None  # host token ids live in the target's batch
        self.compiled = self.compiled_over(model)

    def compiled_over(self, model):
        """A CompiledModel of `model` over this proposer's buffers."""
        from .compilation import CompiledModel
        r = self.runner
        return CompiledModel(model, r.cfg, self.batch, r.max_model_len, r.device, show_progress=False)

    def compile(self) -> dict[str, float]:
        return {f"draft_{k}": v for k, v in self.compiled.compile().items()}

    def run_step(self, inp: StepInputs, ids: torch.Tensor, hidden: torch.Tensor | None,
                 compiled=None) -> torch.Tensor:
        """The own model (or `compiled`, over the same buffers) over one target step's tokens
        (their positions, slots and block table), `ids` as its input ids, through its own
        buffers (and graphs)."""
        d, T, B = self.batch, inp.input_ids.shape[0], inp.attn.seq_lens.shape[0]
        d.ids[:T].copy_(ids)
        d.pos[:T].copy_(inp.positions)
        d.slots[:T].copy_(inp.attn.slot_mapping)
        d.qsl[:B + 1].copy_(inp.attn.query_start_loc)
        d.seq_lens[:B].copy_(inp.attn.seq_lens)
        w = inp.attn.block_table.shape[1]
        d.table[:B, :w].copy_(inp.attn.block_table)
        d.state_idx[:B].copy_(inp.attn.state_idx)
        return (compiled or self.compiled)(d.ids[:T], d.pos[:T], d.attn(T, B, inp.attn.is_decode), hidden,
                                           query_len=inp.query_len)

    def run_ranges(self, rows: np.ndarray, p0: np.ndarray, p1: np.ndarray, ids: torch.Tensor | None,
                   hidden: torch.Tensor | None, id_index: np.ndarray | None = None,
                   host_ids: np.ndarray | None = None) -> torch.Tensor:
        """The own model over the positions [p0, p1) of requests `rows` (a chunked prefill in
        the target's slots): input ids `ids` (device), or `ids[id_index]`, or `host_ids`."""
        d, r = self.batch, self.runner
        cu, tok_rows, pos, slots = self.ranges(rows, p0, p1)
        T, B = int(cu[-1]), len(rows)
        put = d.stage
        if host_ids is not None:
            put(host_ids, d.ids)
        elif id_index is not None:
            d.ids[:T].copy_(ids[put(id_index)])
        else:
            d.ids[:T].copy_(ids)
        put(pos, d.pos)
        put(slots, d.slots)
        put(cu.astype(np.int32), d.qsl)
        put(p1.astype(np.int32), d.seq_lens)
        width = min(int(-(-(p1.max() + self.lookahead) // r.block_size)), r.batch.max_blocks_per_req)
        put(r.batch.block_table[rows, :width], d.table[:B, :width])
        d.state_idx[:B].fill_(-1)
        n = p1 - p0
        q = int(n[0]) if (n == n[0]).all() else 0
        return self.compiled(d.ids[:T], d.pos[:T], d.attn(T, B, bool((n == 1).all())), hidden, query_len=q)

    def begin_passes(self, B: int) -> None:
        """Before `run_one` passes: B requests of one query token, no recurrent state."""
        self.batch.qsl[:B + 1].copy_(torch.arange(B + 1, device=self.runner.device))
        self.batch.state_idx[:B].fill_(-1)

    def run_one(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                hidden: torch.Tensor | None, compiled=None) -> torch.Tensor:
        """One token a request (the block table staged in the batch's `table` by
        `ahead_table`): a decode step of the own model (or of `compiled`), a CUDA graph when
        captured."""
        d, B = self.batch, x.shape[0]
        d.ids[:B].copy_(x)
        d.pos[:B].copy_(pos)
        d.slots[:B].copy_(slots)
        d.seq_lens[:B].copy_((pos + 1).to(torch.int32))
        return (compiled or self.compiled)(d.ids[:B], d.pos[:B], d.attn(B, B, True), hidden)


class OwnModel(OwnForward):
    """Mixin of the proposers that run a model of their own (draft model, EAGLE head): besides
    its own forward, its KV cache in the target's block layout (same blocks and slots, so
    prefix caching, chunked prefill and preemption hold for it too)."""

    def own_model(self, model, hidden_size: int | None) -> None:
        self.model, self.kv_dtype = model, self.runner.kv_dtype
        self.own_forward(model, hidden_size)

    def kv_bytes_per_block(self) -> int:
        return sum(2 * self.runner.block_size * a.qkv_proj.num_kv_heads * a.head_dim
                   * self.kv_dtype.itemsize for a in self.model.attention_layers())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        from .model_runner import cache_zeros  # (model_runner imports this module)
        for a in self.model.attention_layers():
            shape = (num_blocks, self.runner.block_size, a.qkv_proj.num_kv_heads, a.head_dim)
            a.k_cache = cache_zeros(shape, self.kv_dtype, self.runner.device)
            a.v_cache = cache_zeros(shape, self.kv_dtype, self.runner.device)


@contextlib.contextmanager
def _draft_errors(path: str):
    """A draft checkpoint that does not load: say whose it is (else it reads as the target's)."""
    try:
        yield
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--speculative-config: the draft model {path}: {e}") from e


@PROPOSERS.register("draft_model")
class DraftModelProposer(Stateful, OwnModel, Proposer):
    """A separate small checkpoint with the target's vocabulary, on the same ranks and with the
    same tensor parallelism (its own KV cache and buffers: `OwnModel`). It runs every step on
    exactly the target's tokens, slots and block table, then feeds itself k - 1 greedy tokens
    per request (one-hot drafts) at the positions after the step's emitted tokens (slots the
    scheduler reserves ahead: `lookahead_slots`). Paused requests' tokens are left out of its
    step; on resuming, their missed tokens are prefilled into its KV cache (`catch_up`)."""

    def __init__(self, runner: ModelRunner, params: SpecDecodeParams):
        super().__init__(runner, params)
        from ..models.loader import build_model, init_dummy_weights, load_hf_config, load_weights
        cfg = runner.cfg
        with _draft_errors(params.model):
            self.hf_config = load_hf_config(params.model)
        if self.hf_config.vocab_size != runner.hf_config.vocab_size:
            raise ValueError(f"--speculative-config: the draft model's vocabulary "
                             f"({self.hf_config.vocab_size}) differs from the target's "
                             f"({runner.hf_config.vocab_size}); it needs the same tokenizer")
        if (getattr(self.hf_config, "max_position_embeddings", None) is not None
                and rope_max_len(self.hf_config) < runner.max_model_len):  # (or its scaled length)
            raise ValueError(f"--speculative-config: the draft model's max_position_embeddings "
                             f"({self.hf_config.max_position_embeddings}) is below --max-model-len "
                             f"{runner.max_model_len}")
        with _draft_errors(params.model):
            model = build_model(self.hf_config, runner.pi, runner.dtype, runner.device)
            if cfg.load.load_format == "dummy":
                init_dummy_weights(model, cfg.model.seed + 1, self.hf_config)
            else:
                load_weights(model, params.model, progress=False)
                if cfg.cache.fp8_kv:  # its fp8 cache: the draft checkpoint's own scales
                    from .model_runner import load_kv_scales
                    load_kv_scales(model, params.model)
        self.own_model(model, None)
        self.compiled.verify_len = 1 + self.k  # the draft scores the target's verify batches too
        self.init_state()

    def logits_gemms(self):
        return [(self.model.compute_logits, self.hf_config.hidden_size)]

    @torch.inference_mode()
    def on_forward(self, inp: StepInputs, hidden: torch.Tensor) -> None:
        """The draft's KV of this step's tokens (of its active requests)."""
        if inp.input_ids.shape[0] == 0:
            self.step_active = ~inp.paused
            return
        self.batch.next_arena()
        self.track(inp)
        act = self.step_active
        if act.all():  # the steady state: exactly the target's step (its CUDA graphs)
            self.run_step(inp, inp.input_ids, None)
        elif act.any():
            idx = np.flatnonzero(act)
            cu = np.concatenate([[0], np.cumsum(inp.seq_lens - inp.starts)])
            tok = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in idx])
            self.run_ranges(inp.rows[idx], inp.starts[idx], inp.seq_lens[idx], inp.input_ids, None, tok)
        self.after_step(inp)

    def catch_up(self, inp: StepInputs, idx: np.ndarray, p0: np.ndarray, p1: np.ndarray) -> None:
        """The missed tokens (on the host) prefilled into the draft's KV cache."""
        rows = inp.rows[idx]
        _, tok_rows, pos, _ = self.ranges(rows, p0, p1)
        self.run_ranges(rows, p0, p1, None, None, host_ids=self.runner.batch.token_ids[tok_rows, pos])

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[list[int]]:
        r, d = self.runner, self.batch
        B = len(ctx.req_ids)
        if B == 0:
            return []
        table = self.ahead_table(ctx, d.table)
        pos = r.batch.stage(ctx.base_pos) + ctx.num_accepted  # position of the last emitted token
        x = ctx.tokens.gather(1, ctx.num_accepted[:, None])[:, 0]
        self.begin_passes(B)
        drafts = []
        for _ in range(self.k):
            p, slots = self.ahead_slots(table, pos)
            h = self.run_one(x, p, slots, None)
            x = self.draft_logits(self.model.compute_logits, h).argmax(-1)
            drafts.append(x)
            pos = pos + 1
        return self.ahead_result(ctx, torch.stack(drafts, 1))


class PairProposer(Stateful, Proposer):
    """Drafting from the target's hidden states (DeepSeek MTP, EAGLE heads). The drafter's KV
    cache holds, at token t's position, the pair (the target's hidden state of t, token t + 1).

    Every step it writes the pairs of each of the target's tokens (`store_pairs`), where t + 1
    is the step's next input token, the prompt token after a prefill chunk, or, for the last
    token of a request that samples, a placeholder. After sampling, pass 0 redoes that last
    pair with the token just emitted (at the last verified position: rejected drafts' pairs
    past it are overwritten later, as the target's KV is) and gives the first draft; pass i
    feeds back its own hidden state and draft one position further (the k - 1 lookahead slots
    the scheduler reserves). A plain decode step has only last pairs: pass 0 writes them.

    Paused requests get no pass. A step with requests that are not active writes the target's
    states of its tokens (`raw_states`: the hidden state, or EAGLE-3's three layers before the
    head's fc) into a ring of `ring_len` positions per input-batch row, one index_copy; a
    request that resumes stores its missed pairs from it (`catch_up`) in one pass.

    A subclass says how the target's states become pair states (`raw_states`, `states_of`),
    how the pairs of a step are stored, and what one pass is (`one_pass`)."""

    def init_pairs(self, width: int) -> None:
        from .scheduler import SPEC_MAX_PAUSE
        r = self.runner
        self.init_state()
        # a pause's steps and the few synchronous ones around it (older positions: see below)
        self.ring_len = SPEC_MAX_PAUSE + 2 * self.k + 8
        self.ring = torch.zeros(r.cfg.scheduler.max_num_seqs * self.ring_len, width, dtype=r.dtype,
                                device=r.device)

    def raw_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the ring keeps per token (default: the target's last hidden states)."""
        return hidden

    def states_of(self, raw: torch.Tensor) -> torch.Tensor:
        """The states the pairs take, from `raw_states` rows."""
        return raw

    def begin_step(self) -> None:
        pass

    def store_range(self, rows, p0, p1, h, nxt, pos, slots) -> None:
        """Store the pairs (h, nxt) of the position ranges [p0, p1) (`catch_up`)."""
        raise NotImplementedError

    def catch_up_range(self, inp, lag, p0, p1) -> tuple[np.ndarray, np.ndarray]:
        # the ring holds the last ring_len positions before the step; older missed pairs
        # (a request that lagged longer) stay stale: worse drafts, never a different output
        return np.maximum(p0, inp.starts[lag] - self.ring_len), p1

    def catch_up(self, inp: StepInputs, idx: np.ndarray, p0: np.ndarray, p1: np.ndarray) -> None:
        # (host arrays go up through the pinned arenas: a pageable copy would wait for the
        # step in flight, the overlap async scheduling buys)
        R, put, rows = self.ring_len, self.batch.stage, inp.rows[idx]
        _, tok_rows, pos, slots = self.ranges(rows, p0, p1)
        h = self.states_of(self.ring[put(tok_rows * R + pos % R)])
        # token t + 1: on the host, but for t + 1 = the step's first position when the step
        # ran ahead (its input is the last step's sampled token, on the device only)
        req = np.repeat(np.arange(len(idx)), p1 - p0)
        host = self.runner.batch.token_ids[tok_rows, pos + 1]
        cu = np.concatenate([[0], np.cumsum(inp.seq_lens - inp.starts)])
        src = np.where(pos + 1 < inp.known[idx][req], inp.input_ids.shape[0] + np.arange(len(pos)),
                       cu[idx][req])  # an index into [the step's input ids, host]
        nxt = torch.cat([inp.input_ids, put(host)])[put(src)]
        self.store_range(rows, p0, p1, h, nxt, put(pos), put(slots))

    def store_pairs(self, inp: StepInputs, h: torch.Tensor, nxt: torch.Tensor) -> None:
        raise NotImplementedError

    def store_last(self, h, x, pos, slots, table) -> None:
        raise NotImplementedError

    def one_pass(self, h, x, pos, slots, table, qsl) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden state fed back, greedy draft) of one pair a request."""
        raise NotImplementedError

    def table_buffer(self) -> torch.Tensor | None:
        return None

    def begin_passes(self, B: int) -> None:
        pass

    @torch.inference_mode()
    def on_forward(self, inp: StepInputs, hidden: torch.Tensor) -> None:
        T = inp.input_ids.shape[0]
        self._states = None
        if T == 0:
            self.step_active = ~inp.paused
            return
        self.begin_step()
        raw = self.raw_states(hidden[:T])
        self.track(inp)
        act = self.step_active
        if not act.all():  # the states of the requests left behind, for their catch-up
            # (the ring rows from the host's positions: one staged copy, not a kernel apiece)
            n = inp.seq_lens - inp.starts
            req = np.repeat(np.arange(len(n)), n)
            pos = np.arange(T) - (np.cumsum(n) - n)[req] + inp.starts[req]
            self.ring.index_copy_(0, self.batch.stage(inp.rows[req] * self.ring_len + pos % self.ring_len), raw)
        self.after_step(inp)
        if not act.any():
            return
        self._states = self.states_of(raw)
        if inp.attn.is_decode and len(inp.sample_index) == T:
            return  # (a plain decode step: every pair is a last one, which pass 0 writes)
        b = self.runner.batch
        # the token after each request's last one: known unless the request samples now
        tail = b.token_ids[inp.rows, np.minimum(inp.seq_lens, b.token_ids.shape[1] - 1)].astype(np.int64)
        tail[inp.sample_index] = 0
        nxt = torch.roll(inp.input_ids, -1)
        nxt[inp.attn.query_start_loc[1:].long() - 1] = b.stage(tail).to(nxt.dtype)
        self.store_pairs(inp, self._states, nxt)

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[list[int]]:
        if not ctx.req_ids:
            return []
        return self.ahead_result(ctx, self._passes(ctx, self.k))

    @torch.inference_mode()
    def finish(self, ctx: ProposeContext) -> None:
        h, x, pos, table = self._last_pair(ctx)  # the last pair only, with the emitted token
        self.begin_passes(len(ctx.req_ids))
        self.store_last(h, x, *self.ahead_slots(table, pos), table)

    def _last_pair(self, ctx: ProposeContext):
        """(pair state, emitted token, position, block table) of each request's last pair: the
        last verified token's state and the token emitted after it."""
        r, B = self.runner, len(ctx.req_ids)
        ns = np.zeros(B, dtype=np.int64) if ctx.num_drafts is None else ctx.num_drafts
        first = np.concatenate([[0], np.cumsum(ns + 1)[:-1]])  # each request's first scored row
        h = self._states[ctx.logits_indices[r.batch.stage(first) + ctx.num_accepted]]
        x = ctx.tokens.gather(1, ctx.num_accepted[:, None])[:, 0]  # the last emitted token
        pos = r.batch.stage(ctx.base_pos) + ctx.num_accepted - 1  # the token before it
        return h, x, pos, self.ahead_table(ctx, self.table_buffer())

    def _passes(self, ctx: ProposeContext, n: int) -> torch.Tensor:
        """n single-token passes a request from the last pair on → [B, n] drafts."""
        h, x, pos, table = self._last_pair(ctx)
        qsl = torch.arange(len(ctx.req_ids) + 1, dtype=torch.int32, device=self.runner.device)
        self.begin_passes(len(ctx.req_ids))
        drafts = []
        for _ in range(n):
            p, slots = self.ahead_slots(table, pos)
            h, x = self.one_pass(h, x, p, slots, table, qsl)
            drafts.append(x)
            pos = pos + 1
        return torch.stack(drafts, 1)


@PROPOSERS.register("mtp")
class MTPProposer(OwnForward, PairProposer):
    """DeepSeek-V3's multi-token-prediction layer as the drafter (models/deepseek.py
    `mtp_forward`), the pairs of `PairProposer`. Its latent cache is one of the target's
    attention layers: same blocks and slots, allocated, offloaded and given back with them.
    Storing a step's pairs writes the latents alone (`mtp_store_kv`: no attention, no MoE).
    One MTP layer is reused for every draft, as vLLM does (DeepSeek-V3 ships one).

    It runs as a model of its own (`OwnForward`: its own input buffers and CompiledModels over
    the target's MTP modules, models/deepseek.py `MTPDrafter`): the k single-token passes are
    decode steps replayed as CUDA graphs on the GPU (torch.compile'd at --compilation-level 2
    as the target), and so are the stores of a uniform verify step's pairs (a verify graph)
    and of the last pairs of requests that pause (a decode graph); mixed steps and catch-ups
    run the stores eagerly."""

    def __init__(self, runner: ModelRunner, params: SpecDecodeParams):
        super().__init__(runner, params)
        from ..models.deepseek import MTPDrafter
        self.model, cfg = runner.model, runner.hf_config
        if not hasattr(self.model, "mtp"):
            n = getattr(cfg, "num_nextn_predict_layers", 0) or 0
            why = (f"the checkpoint has no weights for its {n} MTP layer(s) (model.layers."
                   f"{cfg.num_hidden_layers}.*; transformers' save_pretrained drops them)" if n else
                   f"{cfg.architectures[0]} has no multi-token-prediction layers "
                   "(num_nextn_predict_layers: DeepSeek-V3 and its kind)")
            raise ValueError(f"--speculative-config: method mtp needs the target's MTP layers; {why}")
        self.own_forward(MTPDrafter(self.model, 0), cfg.hidden_size)  # the passes: `compiled`
        self.stores = self.compiled_over(MTPDrafter(self.model, 0, store_only=True))
        self.stores.verify_len = 1 + self.k  # a uniform verify step's pairs replay a graph
        self.init_pairs(cfg.hidden_size)

    def compile(self) -> dict[str, float]:
        t = {f"mtp_{k}": v for k, v in self.compiled.compile().items()}
        t.update({f"mtp_store_{k}": v for k, v in self.stores.compile().items()})
        return t

    def begin_step(self) -> None:
        self.batch.next_arena()

    def table_buffer(self) -> torch.Tensor:
        return self.batch.table

    def store_pairs(self, inp: StepInputs, h: torch.Tensor, nxt: torch.Tensor) -> None:
        self.run_step(inp, nxt, h, self.stores)

    def store_last(self, h, x, pos, slots, table) -> None:
        self.run_one(x, pos, slots, h, self.stores)

    def store_range(self, rows, p0, p1, h, nxt, pos, slots) -> None:
        self.model.mtp_store_kv(h, nxt, pos, slots, 0)  # (any number of tokens: eager)

    def mtp_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_logits(h, 0)

    def logits_gemms(self):
        return [(self.mtp_logits, self.runner.hf_config.hidden_size)]

    def one_pass(self, h, x, pos, slots, table, qsl):
        h = self.run_one(x, pos, slots, h)
        return h, self.draft_logits(self.mtp_logits, h).argmax(-1)


@PROPOSERS.register("eagle", "eagle3")
class EagleProposer(OwnModel, PairProposer):
    """An EAGLE-1 or EAGLE-3 head from a checkpoint (models/eagle.py), the pairs of
    `PairProposer` in a KV cache of its own (`OwnModel`). EAGLE-1's pairs take the target's
    last hidden state; EAGLE-3's the concatenated residual streams of three target layers
    (captured into a persistent buffer by the target's forward, CUDA graphs included),
    reduced by the head's fc. A step's pairs run through the head's compiled forward (a uniform
    verify step's replay a CUDA graph on the GPU, as the target's); the k single-token passes
    are decode steps of it, replayed as CUDA graphs."""

    def __init__(self, runner: ModelRunner, params: SpecDecodeParams):
        super().__init__(runner, params)
        from ..models.eagle import build_head
        cfg, target = runner.cfg, runner.model
        aux_ok = hasattr(getattr(target, "model", None), "capture_aux")
        if params.method == "eagle3" and not aux_ok:
            raise ValueError(f"--speculative-config: method eagle3 reads intermediate hidden states "
                             f"of the target, which {runner.hf_config.architectures[0]} does not "
                             "expose (Llama / Qwen / Mistral / MoE / DeepSeek families do)")
        head, aux = build_head(params.model, params.method, target, runner.hf_config, runner.pi,
                               runner.dtype, runner.device, runner.max_model_len,
                               cfg.model.seed + 1 if cfg.load.load_format == "dummy" else None)
        self.own_model(head, head.cfg.hidden_size)
        self.compiled.verify_len = 1 + self.k  # a verify step's pairs replay a graph too
        self.aux = None
        if aux is not None:
            rows = max(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs) + 1
            self.aux = torch.zeros(rows, len(aux) * runner.hf_config.hidden_size, dtype=runner.dtype,
                                   device=runner.device)
            target.model.capture_aux(aux, self.aux)
            log.info("EAGLE-3 head reads the target's layers %s", aux)
        self.init_pairs(runner.hf_config.hidden_size if self.aux is None else self.aux.shape[1])

    def raw_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.aux is None else self.aux[:hidden.shape[0]]

    def states_of(self, raw: torch.Tensor) -> torch.Tensor:
        return raw if self.aux is None else self.model.combine(raw)

    def begin_step(self) -> None:
        self.batch.next_arena()

    def store_range(self, rows, p0, p1, h, nxt, pos, slots) -> None:
        self.run_ranges(rows, p0, p1, nxt, h)

    def table_buffer(self) -> torch.Tensor:
        return self.batch.table

    def store_pairs(self, inp: StepInputs, h: torch.Tensor, nxt: torch.Tensor) -> None:
        self.run_step(inp, nxt, h)

    def store_last(self, h, x, pos, slots, table) -> None:
        self.run_one(x, pos, slots, h)

    def logits_gemms(self):
        return [(self.model.compute_logits, self.model.cfg.hidden_size)]

    def one_pass(self, h, x, pos, slots, table, qsl):
        h = self.run_one(x, pos, slots, h)
        return h, self.model.tokens_of(self.draft_logits(self.model.compute_logits, h))


def make_proposer(runner: ModelRunner, params: SpecDecodeParams) -> Proposer:
    return PROPOSERS.get(params.method)(runner, params)
