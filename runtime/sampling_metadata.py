"""Builds a step's `SamplingMetadata` from per-row sampling parameters, set once when a request
joins the batch, so that a step's metadata is a vectorised gather (plus penalty tensors and
banned tokens only when some request needs them).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .input_batch import InputBatch, ReqState
from .sampler import SamplingMetadata

# columns of the per-row parameter table
P_TEMP, P_TOP_K, P_TOP_P, P_MIN_P, P_MIN_TOKENS, P_PENALTY, P_LOGPROBS, P_SEEDED, P_MASKS = range(9)


class SamplingMetadataBuilder:
    def __init__(self, batch: InputBatch, max_num_seqs: int, vocab_size: int):
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = batch.device
        self.row_params = np.zeros((max_num_seqs, 9), dtype=np.float32)
        # per row (overwritten when a request takes the row): logit_bias (ids, values),
        # allowed_token_ids (device tensor), bad_words_token_ids
        self.bias: dict[int, tuple[list[int], list[float]]] = {}
        self.allowed: dict[int, torch.Tensor] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        # grammar bitmasks go to the device through two pinned buffers used alternately (made
        # on first use); the event says when the copy out of a buffer is done
        self.bits_pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self.bits_step = 0
        self.prefilled: tuple[torch.Tensor, torch.cuda.Event] | None = None  # see bits_buffer
        self.max_num_seqs = max_num_seqs

    def add(self, st: ReqState) -> None:
        sp = st.sampling_params
        self.row_params[st.row] = (0.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p,
                                   sp.min_p, sp.min_tokens, sp.needs_penalties,
                                   -1 if sp.logprobs is None else sp.logprobs,
                                   st.generator is not None,
                                   bool(sp.logit_bias or sp.allowed_token_ids or sp.bad_words_token_ids))
        row = st.row
        self.bias.pop(row, None), self.allowed.pop(row, None), self.bad_words.pop(row, None)
        if sp.logit_bias:
            self.bias[row] = (list(sp.logit_bias), [min(max(v, -100.0), 100.0) for v in sp.logit_bias.values()])
        if sp.allowed_token_ids:
            self.allowed[row] = torch.tensor(sp.allowed_token_ids, device=self.device)
        if sp.bad_words_token_ids:
            self.bad_words[row] = sp.bad_words_token_ids

    def _next_pinned(self, rows: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        if not self.bits_pinned or len(self.bits_pinned[0][0]) < rows:
            # a row per request; with drafts (speculative decoding) one per verified position:
            # made again, larger, once both buffers' copies are done
            for _, done in self.bits_pinned:
                done.synchronize()
            width = (self.vocab_size + 31) // 32
            size = max(self.max_num_seqs, rows)
            self.bits_pinned = [(torch.empty((size, width), dtype=torch.int32,
                                             pin_memory=True), torch.cuda.Event()) for _ in range(2)]
        self.bits_step ^= 1
        buf, done = self.bits_pinned[self.bits_step]
        done.synchronize()  # the copy of two steps ago has left this buffer
        return buf[:rows], done

    def bits_buffer(self, rows: int) -> torch.Tensor | None:
        """Where the next step's grammar fill should write its rows: a pinned buffer the rows
        then go to the device from directly (CUDA; None on CPU)."""
        if self.device.type != "cuda":
            return None
        self.prefilled = self._next_pinned(rows)
        return self.prefilled[0]

    def bits_to_device(self, bits: np.ndarray) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(bits)
        pre, self.prefilled = self.prefilled, None
        if pre is not None and pre[0].data_ptr() == bits.ctypes.data and len(pre[0]) == len(bits):
            host, done = pre  # filled in place: no host copy
        else:
            host, done = self._next_pinned(bits.shape[0])
            host.numpy()[:] = bits
        out = host.to(self.device, non_blocking=True)
        done.record()
        return out

    def build(self, req_ids: list[str], out_counts: np.ndarray,
              grammar: tuple[list[str], Callable[[], np.ndarray]] | None = None,
              extra_tokens: np.ndarray | None = None, defer_bits: bool = False,
              forced: dict[str, list[int]] | None = None) -> SamplingMetadata:
        """Metadata for sampling `req_ids` (in order); `out_counts`: their outputs so far;
        `grammar`: the plan's structured-output bitmask rows and their request ids (`defer_bits`:
        the rows' index only; the caller sets the bits, `bits_to_device`, before sampling).
        `extra_tokens` (speculative decoding: a request has a row per draft): row i samples
        after that many tokens past the request's known ones, which sit in its token ids.
        `forced` (thinking_token_budget): per request, the token each of its rows must take."""
        reqs, stage, dev = self.batch.reqs, self.batch.stage, self.device
        rows = np.array([reqs[r].row for r in req_ids], dtype=np.int64)
        p = self.row_params[rows]
        temp = p[:, P_TEMP]
        md = SamplingMetadata(temperature=stage(temp), all_greedy=not temp.any())
        if not md.all_greedy:
            if (p[:, P_TOP_K] > 0).any():
                md.top_k = stage(p[:, P_TOP_K].astype(np.int64))
            if (p[:, P_TOP_P] < 1).any():
                md.top_p = stage(p[:, P_TOP_P])
            if (p[:, P_MIN_P] > 0).any():
                md.min_p = stage(p[:, P_MIN_P])
            if p[:, P_SEEDED].any():
                md.generators = {i: reqs[req_ids[i]].generator for i in np.flatnonzero(p[:, P_SEEDED])}
        if p[:, P_PENALTY].any():
            self._penalty_tensors(md, [reqs[r] for r in req_ids], extra_tokens)
        banned_rows, banned_toks = [], []
        if p[:, P_MASKS].any():
            self._token_masks(md, req_ids, np.flatnonzero(p[:, P_MASKS]), banned_rows, banned_toks,
                              extra_tokens)
        if grammar is not None and grammar[0]:
            # a request's rows are consecutive (with drafts, one per verified position): the
            # grammar has a row for each, in the same order
            first: dict[str, int] = {}
            count: dict[str, int] = {}
            for i, rid in enumerate(req_ids):
                first.setdefault(rid, i)
                count[rid] = count.get(rid, 0) + 1
            idx = [first[r] + j for r in grammar[0] for j in range(count[r])]
            md.grammar = (stage(np.array(idx, dtype=np.int64)),
                          None if defer_bits else self.bits_to_device(grammar[1]()))
        under_min = np.flatnonzero(out_counts < p[:, P_MIN_TOKENS])
        if len(under_min):  # EOS and stop tokens may not end the output yet
            for i in under_min:
                s = reqs[req_ids[i]]
                eos = [] if s.sampling_params.ignore_eos else [s.eos_token_id]
                for tok in eos + list(s.sampling_params.stop_token_ids):
                    if tok is not None:
                        banned_rows.append(int(i))
                        banned_toks.append(tok)
        if banned_rows:
            md.banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_toks, device=dev))
        if forced:
            pairs = [(i, forced[r][0 if extra_tokens is None else int(extra_tokens[i])])
                     for i, r in enumerate(req_ids) if r in forced]
            pairs = [(i, t) for i, t in pairs if t >= 0]
            if pairs:
                md.forced = tuple(torch.tensor(x, device=dev) for x in zip(*pairs))
        max_lp = p[:, P_LOGPROBS].max()
        md.max_num_logprobs = int(max_lp) if max_lp >= 0 else None
        return md

    def _token_masks(self, md: SamplingMetadata, req_ids: list[str], idx: np.ndarray,
                     banned_rows: list[int], banned_toks: list[int],
                     extra_tokens: np.ndarray | None = None) -> None:
        """logit_bias and allowed_token_ids tensors; bad words into the banned (row, token)s."""
        dev, V = self.device, self.vocab_size
        b_rows, b_toks, b_vals, a_rows, a_masks = [], [], [], [], []
        for i in idx.tolist():
            st = self.batch.reqs[req_ids[i]]
            row = st.row
            if row in self.bias:
                toks, vals = self.bias[row]
                b_rows += [i] * len(toks)
                b_toks += toks
                b_vals += vals
            if row in self.allowed:
                a_rows.append(i)
                a_masks.append(torch.zeros(V, dtype=torch.bool, device=dev).index_fill_(0, self.allowed[row], True))
            for word in self.bad_words.get(row, ()):
                # vLLM: a word's last token is banned when the output ends with the rest of it
                *prefix, last = word
                n_tok = st.num_tokens + (0 if extra_tokens is None else int(extra_tokens[i]))
                n_out = n_tok - st.num_prompt_tokens
                if len(prefix) > n_out:
                    continue
                tail = self.batch.token_ids[row, n_tok - len(prefix):n_tok]
                if not prefix or tail.tolist() == prefix:
                    banned_rows.append(i)
                    banned_toks.append(last)
        if b_rows:
            md.logit_bias = (torch.tensor(b_rows, device=dev), torch.tensor(b_toks, device=dev),
                             torch.tensor(b_vals, dtype=torch.float32, device=dev))
        if a_rows:
            md.allowed = (torch.tensor(a_rows, device=dev), torch.stack(a_masks))

    def _penalty_tensors(self, md: SamplingMetadata, states: list[ReqState],
                         extra_tokens: np.ndarray | None = None) -> None:
        dev, V, token_ids = self.device, self.vocab_size, self.batch.token_ids
        B = len(states)
        sps = [s.sampling_params for s in states]
        f32 = dict(dtype=torch.float32, device=dev)
        md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], **f32)
        md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], **f32)
        md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], **f32)
        extra = np.zeros(B, dtype=np.int64) if extra_tokens is None else extra_tokens
        ends = [s.num_tokens + int(e) for s, e in zip(states, extra)]
        max_out = max(n - s.num_prompt_tokens for s, n in zip(states, ends))
        max_prompt = max(s.num_prompt_tokens for s in states)
        out_ids = np.full((B, max(max_out, 1)), V, dtype=np.int64)  # V: a padding column
        prompt_ids = np.full((B, max_prompt), V, dtype=np.int64)
        for i, (s, n) in enumerate(zip(states, ends)):
            out_ids[i, :n - s.num_prompt_tokens] = token_ids[s.row, s.num_prompt_tokens:n]
            prompt_ids[i, :s.num_prompt_tokens] = token_ids[s.row, :s.num_prompt_tokens]
        counts = torch.zeros(B, V + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(1, torch.from_numpy(out_ids).to(dev),
                            torch.ones(out_ids.shape, dtype=torch.int32, device=dev))
        md.output_counts = counts[:, :V]
        mask = torch.zeros(B, V + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, torch.from_numpy(prompt_ids).to(dev), True)
        md.prompt_mask = mask[:, :V]
