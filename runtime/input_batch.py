"""The persistent input batch of one rank: a row per running request in host arrays (token ids,
block table) updated by each plan's deltas, the device buffers a step's inputs are copied into
(CUDA graphs read them), and the pinned arenas those copies go through.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.layers import AttnMeta
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput


@dataclass
class ReqState:
    row: int
    num_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_blocks: int
    generator: torch.Generator | None
    eos_token_id: int | None


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, hidden_size: int | None, dtype: torch.dtype,
                 device: torch.device):
        n = max_num_seqs
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((n, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((n, self.max_blocks_per_req), dtype=np.int32)
        self.free_rows = list(range(n - 1, -1, -1))
        self.reqs: dict[str, ReqState] = {}
        # seeded generators of preempted requests, until they come back (or finish): their
        # tokens continue the same random stream, so they do not depend on being preempted
        self.parked_generators: dict[str, torch.Generator] = {}
        # persistent device inputs: steps copy into prefixes of these, CUDA graphs read them
        max_t = max(max_num_batched_tokens, n)
        # one spare row each: a slice never spans a whole buffer, or torch.compile would guard
        # on "view == base" and recompile for the next size
        def z(rows, *rest, dt=torch.int32):
            return torch.zeros((rows + 1, *rest), dtype=dt, device=device)
        self.ids, self.pos, self.slots = z(max_t, dt=torch.long), z(max_t, dt=torch.long), z(max_t, dt=torch.long)
        self.qsl, self.seq_lens = z(n + 1), z(n)
        self.state_idx = z(n)  # recurrent-state slot (= row) of each scheduled request
        # decode order (RANKSERVE_DECODE_LPT): [:B] must be a permutation of 0..B-1 wherever a
        # decode step of B requests runs (its entries index qsl / seq_lens): the runner writes a
        # step's [:B], pad() the padding after it, warm-ups and graph captures the identity
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.order = self.arange.clone()
        self.lpt = False  # set by the model runner
        self.table = z(n, self.max_blocks_per_req)
        # hidden states received from the previous pipeline stage (None on the first stage)
        self.hidden = None if hidden_size is None else z(max_t, hidden_size, dt=dtype)
        # host→device copies go through pinned arenas (two, used alternately) so they are truly
        # asynchronous: a pageable copy would wait for the GPU to finish the step in flight
        self.pinned = device.type == "cuda"
        arena_bytes = 8 * (6 * max_t + n * (self.max_blocks_per_req + 16)) + 4096
        self.arenas = [torch.empty(arena_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                       for _ in range(2)] if self.pinned else []
        self.arena_step = 0
        self.arena_off = 0

    # ---- per-request rows from the plan -----------------------------------------------------
    def update(self, plan: SchedulerOutput) -> list[ReqState]:
        """Apply the plan's finished/new/cached deltas; returns the new requests' states."""
        preempted = set(plan.preempted_req_ids)
        for rid in plan.finished_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self.free_rows.append(st.row)
            gen = self.parked_generators.pop(rid, None) if st is None else st.generator
            if gen is not None and rid in preempted:
                self.parked_generators[rid] = gen
        new = []
        for r in plan.new_reqs:
            row = self.free_rows.pop()
            n = len(r.token_ids)
            self.token_ids[row, :n] = r.token_ids
            self.block_table[row, :len(r.block_ids)] = r.block_ids
            sp = r.sampling_params
            gen = self.parked_generators.pop(r.req_id, None)
            if gen is None and sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            st = self.reqs[r.req_id] = ReqState(row, n, r.num_prompt_tokens, sp, len(r.block_ids),
                                                gen, r.eos_token_id)
            new.append(st)
        for r in plan.cached_reqs:
            st = self.reqs[r.req_id]
            if r.new_token_ids:
                self.token_ids[st.row, st.num_tokens:st.num_tokens + len(r.new_token_ids)] = r.new_token_ids
                st.num_tokens += len(r.new_token_ids)
            if r.num_blocks >= 0:  # blocks given back (speculative decoding)
                st.num_blocks = r.num_blocks - len(r.new_block_ids)
            if r.new_block_ids:
                self.block_table[st.row, st.num_blocks:st.num_blocks + len(r.new_block_ids)] = r.new_block_ids
                st.num_blocks += len(r.new_block_ids)
        return new

    # ---- device buffers ---------------------------------------------------------------------
    def attn(self, T: int, B: int, is_decode: bool) -> AttnMeta:
        """Attention metadata over the buffers' first T tokens and B requests."""
        return AttnMeta(self.slots[:T], self.qsl[:B + 1], self.seq_lens[:B], self.table[:B],
                        is_decode=is_decode, state_idx=self.state_idx[:B],
                        decode_order=self.order[:B] if is_decode and self.lpt else None)

    def pad(self, T: int, T2: int, B: int, B2: int) -> None:
        """Tokens T..T2 and requests B..B2 become padding: the tokens write no KV (slot -1) and
        belong to no request, the requests have no query and no context. Their ids and
        positions are whatever an earlier step left (valid values; the rows are discarded)."""
        self.slots[T:T2].fill_(-1)
        self.qsl[B + 1:B2 + 1].fill_(T)
        self.seq_lens[B:B2].zero_()
        self.state_idx[B:B2].fill_(-1)  # padding requests touch no recurrent state
        if self.lpt:
            self.order[B:B2].copy_(self.arange[B:B2])  # padding last (no context)

    # ---- staging ----------------------------------------------------------------------------
    def next_arena(self) -> None:
        """Called once per step: the other arena may still feed the step in flight."""
        self.arena_step ^= 1
        self.arena_off = 0

    def stage(self, arr: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a host array to the device (into `out[:len]` if given) without a sync."""
        src = torch.from_numpy(np.ascontiguousarray(arr))
        if self.pinned:
            nbytes = src.numel() * src.element_size()
            arena = self.arenas[self.arena_step]
            pinned = arena[self.arena_off:self.arena_off + nbytes].view(src.dtype).view(src.shape)
            self.arena_off += (nbytes + 15) // 16 * 16
            pinned.copy_(src)
            src = pinned
        if out is None:
            return src.to(self.device, non_blocking=True)
        view = out[:src.shape[0]]
        view.copy_(src, non_blocking=True)
        return view
