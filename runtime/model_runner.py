"""ModelRunner: owns the model, its paged KV cache and per-request state on one rank; turns a
step plan (`SchedulerOutput`) into model inputs, runs the forward and samples.

Per-request token ids and block tables live in persistent numpy arrays (one row per running
request) updated by the plan's deltas, so building a step's inputs is a handful of vectorised
gathers rather than Python loops over tokens.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..models.layers import AttnMeta, ParallelInfo
from ..models.loader import build_model, init_dummy_weights, load_hf_config, load_weights, resolve_dtype
from .config import EngineConfig
from .sampler import SamplingMetadata, gather_logprobs, sample
from .sampling_params import SamplingParams
from .scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("rankserve.runner")


@dataclass
class ReqState:
    row: int
    num_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_blocks: int
    generator: torch.Generator | None
    eos_token_id: int | None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttnMeta
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sample_req_ids: list[str]
    sample_out_counts: np.ndarray  # outputs before this step's sample, per sampled request
    prompt_lp: list[tuple[str, int, int, int]]  # (req id, first hidden row, count, first target pos)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, pi: ParallelInfo, device: torch.device):
        self.cfg = cfg
        self.pi = pi
        self.device = device
        t0 = time.perf_counter()
        self.hf_config = load_hf_config(cfg.model.model)
        self.dtype = resolve_dtype(cfg.model.dtype, self.hf_config, device.type)
        self.max_model_len = min(cfg.model.max_model_len or self.hf_config.max_position_embeddings,
                                 self.hf_config.max_position_embeddings)
        if cfg.model.max_model_len and cfg.model.max_model_len > self.hf_config.max_position_embeddings:
            raise ValueError(f"--max-model-len {cfg.model.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({self.hf_config.max_position_embeddings})")
        torch.manual_seed(cfg.model.seed)
        self.model = build_model(self.hf_config, pi, self.dtype, device)
        if cfg.load.load_format == "dummy":
            init_dummy_weights(self.model, cfg.model.seed)
        else:
            load_weights(self.model, cfg.model.model, progress=pi.tp_rank == 0 and pi.is_first_stage)
        self.timings = {"load": time.perf_counter() - t0}
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = cfg.cache.block_size
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        n = cfg.scheduler.max_num_seqs
        self.token_ids = np.zeros((n, self.max_model_len), dtype=np.int64)
        self.block_table = np.zeros((n, self.max_blocks_per_req), dtype=np.int32)
        self.free_rows = list(range(n - 1, -1, -1))
        self.row_params = np.zeros((n, 8), dtype=np.float32)
        self.reqs: dict[str, ReqState] = {}
        self.num_blocks = 0
        self.forward = self.model.forward
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.compiled = False
        # persistent device inputs: steps copy into prefixes of these, CUDA graphs read them
        max_t = max(cfg.scheduler.max_num_batched_tokens, n)
        # one spare row each: a slice never spans a whole buffer, or torch.compile would guard
        # on "view == base" and recompile for the next size
        z = lambda rows, *rest, dt=torch.int32: torch.zeros((rows + 1, *rest), dtype=dt, device=device)
        self.buf_ids, self.buf_pos, self.buf_slots = z(max_t, dt=torch.long), z(max_t, dt=torch.long), z(max_t, dt=torch.long)
        self.buf_qsl, self.buf_seq_lens = z(n + 1), z(n)
        self.buf_table = z(n, self.max_blocks_per_req)
        self.buf_hidden = None if pi.is_first_stage else z(max_t, self.hf_config.hidden_size, dt=self.dtype)
        # host→device copies go through pinned arenas (two, used alternately) so they are truly
        # asynchronous: a pageable copy would wait for the GPU to finish the step in flight
        self.pinned = device.type == "cuda"
        arena_bytes = 8 * (6 * max_t + n * (self.max_blocks_per_req + 16)) + 4096
        self.arenas = [torch.empty(arena_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                       for _ in range(2)] if self.pinned else []
        self.arena_step = 0
        self.arena_off = 0
        # async scheduling: the last step's sampled ids stay on the device and feed the next
        # step's placeholder inputs
        self.prev_sampled: torch.Tensor | None = None
        self.prev_index: dict[str, int] = {}

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        a = layers[0]
        per_layer = 2 * self.block_size * a.qkv_proj.num_kv_heads * a.head_dim * self.dtype.itemsize
        return per_layer * len(layers)

    def determine_num_blocks(self) -> int:
        c = self.cfg.cache
        if c.num_gpu_blocks_override:
            return c.num_gpu_blocks_override
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            num = self._profile_num_blocks()
            self.timings["memory_profile"] = time.perf_counter() - t0
            return num
        return max(1, int(c.kv_cache_memory_gb * 2**30) // self.kv_bytes_per_block())

    def _profile_num_blocks(self) -> int:
        """Run the largest step once; give `utilization × total − peak` to the KV cache."""
        gc.collect()  # an engine dropped earlier in this process may still hold its KV cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.allocate_kv_cache(1)
        n = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len * self.cfg.scheduler.max_num_seqs)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        attn = AttnMeta(torch.full((n,), -1, dtype=torch.long, device=self.device),
                        torch.tensor([0, n], dtype=torch.int32, device=self.device),
                        torch.tensor([n], dtype=torch.int32, device=self.device),
                        torch.zeros((1, -(-n // self.block_size)), dtype=torch.int32, device=self.device))
        with torch.inference_mode():
            h = self.model(ids, torch.zeros(n, dtype=torch.long, device=self.device), attn,
                           None if self.pi.is_first_stage else
                           torch.zeros(n, self.hf_config.hidden_size, dtype=self.dtype, device=self.device))
            if self.pi.is_last_stage:  # sampling's peak: logits, softmax and sort of a full batch
                b = min(n, self.cfg.scheduler.max_num_seqs)
                logits = self.model.compute_logits(h[-b:])
                md = SamplingMetadata(temperature=torch.ones(b, device=self.device), all_greedy=False,
                                      top_p=torch.full((b,), 0.9, device=self.device))
                sample(logits, md)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = self.cfg.cache.gpu_memory_utilization * total - peak - used_by_others
        num = int(budget // self.kv_bytes_per_block())
        if num <= 0:
            raise RuntimeError(f"no memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB); raise --gpu-memory-utilization")
        return num

    def allocate_kv_cache(self, num_blocks: int) -> None:
        t0 = time.perf_counter()
        self.num_blocks = num_blocks
        for a in self.model.attention_layers():
            shape = (num_blocks, self.block_size, a.qkv_proj.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if num_blocks > 1:  # not the memory profile's placeholder
            self.timings["kv_alloc"] = time.perf_counter() - t0

    def compile(self) -> None:
        """Level 2: torch.compile each decoder layer; level ≥ 1 on CUDA: capture decode CUDA
        graphs. Compilation happens in `warmup`, before the capture."""
        level = self.cfg.compilation.level(self.device.type)
        self.compiled = level >= 2
        if level >= 2:
            cache = self.cfg.compilation.cache_dir
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))
            os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
            # one model per process, but tests build many: do not fall back to eager silently
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # equal sizes (e.g. tokens == requests in a decode step) must not be merged into one
            # symbol: the next step breaks the equality and would recompile
            torch.fx.experimental._config.use_duck_shape = False
            # Regional compilation: every decoder layer runs the same compiled code (parameters
            # are graph inputs, so the guards hold for all layers): one compilation instead of
            # one graph holding every layer cuts cold and warm start-up several times over.
            for layer in self.model.model.layers.values():
                layer.compile(fullgraph=True, dynamic=True)
        if level >= 2 or self.device.type == "cuda":
            t0 = time.perf_counter()
            self.warmup()
            self.timings["compile" if level >= 2 else "warmup"] = time.perf_counter() - t0
        if level >= 1 and self.device.type == "cuda":
            t0 = time.perf_counter()
            self.capture_cuda_graphs()
            self.timings["cuda_graphs"] = time.perf_counter() - t0

    @torch.inference_mode()
    def warmup(self) -> None:
        """One mixed step per attention tile shape (mean query length >= 256, 16..255, < 16:
        kernels/triton_attention.py) and one decode step (the other attention mode: a graph of
        its own at level 2), so that compilation (torch.compile at level 2, Triton variants at
        every level) happens now and not under the first requests. Padding slots write nothing;
        the KV cache is read but left as it is."""
        budget = self.cfg.scheduler.max_num_batched_tokens
        for q_len in (300, 20, 3, 1):
            q_len = max(1, min(q_len, budget // 2, self.max_model_len - 1))
            T, B = 2 * q_len, 2
            # the persistent buffers, as in a real step (other tensors would guard differently)
            self.buf_ids[:T].zero_()
            self.buf_pos[:T].zero_()
            self.buf_slots[:T].fill_(-1)
            self.buf_qsl[:B + 1].copy_(torch.tensor([0, q_len, T]))
            self.buf_seq_lens[:B].fill_(q_len)
            self.buf_table[:B].zero_()
            attn = AttnMeta(self.buf_slots[:T], self.buf_qsl[:B + 1], self.buf_seq_lens[:B],
                            self.buf_table[:B], is_decode=q_len == 1)
            hidden = None if self.buf_hidden is None else self.buf_hidden[:T]
            self.forward(self.buf_ids[:T], self.buf_pos[:T], attn, hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def capture_sizes(self) -> list[int]:
        top = min(self.cfg.compilation.cuda_graph_max_bs or self.cfg.scheduler.max_num_seqs,
                  self.cfg.scheduler.max_num_seqs, 512)
        # compiled graphs never see a dimension of size 1 (see _run_compiled): start at 2
        sizes = [s for s in [1, 2, 4] + list(range(8, 513, 8))
                 if s <= max(top, 2) and not (self.compiled and s == 1)]
        return sizes if max(top, 2 if self.compiled else 1) in sizes else sizes + [top]

    def _run_compiled(self, inp: StepInputs, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """The compiled forward, with the token and request counts padded to at least 2: a size
        of 1 would be specialised by torch.compile and cost a second compilation. The padding
        request has no query, so the step keeps its attention mode (T == B says nothing)."""
        T, B = inp.input_ids.shape[0], inp.attn.seq_lens.shape[0]
        if T >= 2 and B >= 2:
            return self.forward(inp.input_ids, inp.positions, inp.attn, hidden_in)
        T2, B2 = max(T, 2), max(B, 2)
        self.buf_ids[T:T2].zero_()
        self.buf_pos[T:T2].zero_()
        self.buf_slots[T:T2].fill_(-1)  # padding tokens write nowhere...
        self.buf_qsl[B + 1:B2 + 1].fill_(T)  # ...and belong to no request
        self.buf_seq_lens[B:B2].zero_()
        if hidden_in is not None:
            self.buf_hidden[:T].copy_(hidden_in)
            hidden_in = self.buf_hidden[:T2]
        attn = AttnMeta(self.buf_slots[:T2], self.buf_qsl[:B2 + 1], self.buf_seq_lens[:B2],
                        self.buf_table[:B2], is_decode=inp.attn.is_decode)
        return self.forward(self.buf_ids[:T2], self.buf_pos[:T2], attn, hidden_in)[:T]

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """One graph per padded decode batch size; padding requests have no query and no
        context, padding tokens write to slot -1 (nowhere)."""
        from tqdm import tqdm
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        sizes = sorted(self.capture_sizes(), reverse=True)
        for bs in tqdm(sizes, desc="Capturing CUDA graphs", disable=self.pi.tp_rank != 0):
            self.buf_slots[:bs].fill_(-1)
            self.buf_qsl[:bs + 1].copy_(torch.arange(bs + 1, device=self.device))
            self.buf_seq_lens[:bs].fill_(1)
            args = self._graph_args(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile for this size / warm up outside the capture
                    self.forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(*args)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def _graph_args(self, bs: int):
        attn = AttnMeta(self.buf_slots[:bs], self.buf_qsl[:bs + 1], self.buf_seq_lens[:bs],
                        self.buf_table[:bs], is_decode=True)
        hidden = None if self.buf_hidden is None else self.buf_hidden[:bs]
        return self.buf_ids[:bs], self.buf_pos[:bs], attn, hidden

    def _run_graph(self, inp: StepInputs, hidden_in: torch.Tensor | None) -> torch.Tensor | None:
        """Replay the smallest captured graph that fits a decode-only step, else None."""
        B, T = inp.attn.seq_lens.shape[0], inp.input_ids.shape[0]
        if not self.graphs or not inp.attn.is_decode:  # graphs are captured in decode mode only
            return None
        bs = next((s for s in sorted(self.graphs) if s >= B), None)
        if bs is None:
            return None
        self.buf_slots[B:bs].fill_(-1)
        self.buf_qsl[B + 1:bs + 1].fill_(T)
        self.buf_seq_lens[B:bs].fill_(0)
        if hidden_in is not None:
            self.buf_hidden[:B].copy_(hidden_in)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:B]

    # ---- per-request state from the plan ----------------------------------------------------
    def _update_states(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self.free_rows.append(st.row)
        for r in plan.new_reqs:
            row = self.free_rows.pop()
            n = len(r.token_ids)
            self.token_ids[row, :n] = r.token_ids
            self.block_table[row, :len(r.block_ids)] = r.block_ids
            sp = r.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            self._set_row_params(row, sp, gen is not None)
            self.reqs[r.req_id] = ReqState(row, n, r.num_prompt_tokens, sp, len(r.block_ids), gen,
                                          r.eos_token_id)
        for r in plan.cached_reqs:
            st = self.reqs[r.req_id]
            if r.new_token_ids:
                self.token_ids[st.row, st.num_tokens:st.num_tokens + len(r.new_token_ids)] = r.new_token_ids
                st.num_tokens += len(r.new_token_ids)
            if r.new_block_ids:
                self.block_table[st.row, st.num_blocks:st.num_blocks + len(r.new_block_ids)] = r.new_block_ids
                st.num_blocks += len(r.new_block_ids)

    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        self._update_states(plan)
        req_ids = list(plan.num_scheduled_tokens)
        states = [self.reqs[rid] for rid in req_ids]
        counts = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        # tokens computed before this step
        done = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
        done.update({r.req_id: r.num_computed_tokens for r in plan.cached_reqs})
        start = np.array([done[rid] for rid in req_ids], dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(counts)])
        T = int(cu[-1])
        req_of_tok = np.repeat(np.arange(len(req_ids)), counts)
        positions = np.arange(T) - cu[:-1][req_of_tok] + start[req_of_tok]
        tok_rows = rows[req_of_tok]
        input_ids = self.token_ids[tok_rows, positions]
        slots = (self.block_table[tok_rows, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)
        seq_lens = start + counts

        # tokens the runner does not know yet (async scheduling) come from the last step's
        # sampled ids on the device; a step samples when it reaches the end of what is known
        num_real = np.array([s.num_tokens for s in states], dtype=np.int64)
        placeholder = np.flatnonzero(positions >= num_real[req_of_tok])
        sample_mask = seq_lens >= num_real
        logits_indices = (cu[1:] - 1)[sample_mask]
        sample_ids = [rid for rid, m in zip(req_ids, sample_mask) if m]
        prompt_lp = []
        for i, (rid, st) in enumerate(zip(req_ids, states)):
            if st.sampling_params.prompt_logprobs is None:
                continue
            # positions p in this chunk with p + 1 < num_prompt predict prompt token p + 1
            first, last = start[i], min(seq_lens[i], st.num_prompt_tokens - 1)
            if last > first:
                prompt_lp.append((rid, int(cu[i]), int(last - first), int(first + 1)))

        self._next_arena()
        put = self.stage
        B = len(req_ids)
        # only the columns this step reads: kernels never look past a request's seq_len
        width = int(-(-seq_lens.max() // self.block_size)) if B else 0
        self.stage(self.block_table[rows, :width], self.buf_table[:B, :width])
        attn = AttnMeta(put(slots, self.buf_slots), put(cu.astype(np.int32), self.buf_qsl),
                        put(seq_lens.astype(np.int32), self.buf_seq_lens), self.buf_table[:B],
                        is_decode=B > 0 and int(counts.max()) == 1)  # the plan decides the mode
        ids = put(input_ids, self.buf_ids)
        if len(placeholder):
            src = np.array([self.prev_index[req_ids[i]] for i in req_of_tok[placeholder]])
            ids[put(placeholder)] = self.prev_sampled[put(src)]
        # exact even when the last token is still a placeholder
        out_counts = (seq_lens - np.array([s.num_prompt_tokens for s in states]))[sample_mask]
        return StepInputs(ids, put(positions, self.buf_pos), attn, put(logits_indices),
                          sample_ids, out_counts, prompt_lp)

    def _next_arena(self) -> None:
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

    # ---- sampling ---------------------------------------------------------------------------
    # per-row sampling parameters, so a step's metadata is a vectorised gather
    P_TEMP, P_TOP_K, P_TOP_P, P_MIN_P, P_MIN_TOKENS, P_PENALTY, P_LOGPROBS, P_SEEDED = range(8)

    def _set_row_params(self, row: int, sp: SamplingParams, seeded: bool) -> None:
        self.row_params[row] = (0.0 if sp.greedy else sp.temperature, sp.top_k, sp.top_p,
                                sp.min_p, sp.min_tokens, sp.needs_penalties,
                                -1 if sp.logprobs is None else sp.logprobs, seeded)

    def sampling_metadata(self, req_ids: list[str], out_counts: np.ndarray) -> SamplingMetadata:
        dev = self.device
        rows = np.array([self.reqs[r].row for r in req_ids], dtype=np.int64)
        p = self.row_params[rows]
        temp = p[:, self.P_TEMP]
        md = SamplingMetadata(temperature=self.stage(temp), all_greedy=not temp.any())
        col = lambda c, dt=torch.float32: self.stage(p[:, c].astype(
            np.int64 if dt == torch.long else np.float32))
        if not md.all_greedy:
            if (p[:, self.P_TOP_K] > 0).any():
                md.top_k = col(self.P_TOP_K, torch.long)
            if (p[:, self.P_TOP_P] < 1).any():
                md.top_p = col(self.P_TOP_P)
            if (p[:, self.P_MIN_P] > 0).any():
                md.min_p = col(self.P_MIN_P)
            if p[:, self.P_SEEDED].any():
                md.generators = {i: self.reqs[req_ids[i]].generator
                                 for i in np.flatnonzero(p[:, self.P_SEEDED])}
        if p[:, self.P_PENALTY].any():
            self._penalty_tensors(md, [self.reqs[r] for r in req_ids])
        under_min = np.flatnonzero(out_counts < p[:, self.P_MIN_TOKENS])
        if len(under_min):  # EOS and stop tokens may not end the output yet
            banned_rows, banned_toks = [], []
            for i in under_min:
                s = self.reqs[req_ids[i]]
                eos = [] if s.sampling_params.ignore_eos else [s.eos_token_id]
                for tok in eos + list(s.sampling_params.stop_token_ids):
                    if tok is not None:
                        banned_rows.append(int(i))
                        banned_toks.append(tok)
            if banned_rows:
                md.banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_toks, device=dev))
        max_lp = p[:, self.P_LOGPROBS].max()
        md.max_num_logprobs = int(max_lp) if max_lp >= 0 else None
        return md

    def _penalty_tensors(self, md: SamplingMetadata, states: list[ReqState]) -> None:
        dev, V = self.device, self.vocab_size
        B = len(states)
        sps = [s.sampling_params for s in states]
        md.presence_penalty = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)
        md.frequency_penalty = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)
        md.repetition_penalty = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)
        max_out = max(s.num_tokens - s.num_prompt_tokens for s in states)
        max_prompt = max(s.num_prompt_tokens for s in states)
        out_ids = np.full((B, max(max_out, 1)), V, dtype=np.int64)  # V: a padding column
        prompt_ids = np.full((B, max_prompt), V, dtype=np.int64)
        for i, s in enumerate(states):
            out_ids[i, :s.num_tokens - s.num_prompt_tokens] = self.token_ids[s.row, s.num_prompt_tokens:s.num_tokens]
            prompt_ids[i, :s.num_prompt_tokens] = self.token_ids[s.row, :s.num_prompt_tokens]
        counts = torch.zeros(B, V + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(1, torch.from_numpy(out_ids).to(dev), torch.ones(out_ids.shape, dtype=torch.int32, device=dev))
        md.output_counts = counts[:, :V]
        mask = torch.zeros(B, V + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, torch.from_numpy(prompt_ids).to(dev), True)
        md.prompt_mask = mask[:, :V]

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput,
                hidden_in: torch.Tensor | None = None) -> ModelRunnerOutput | torch.Tensor:
        """Run one step. Non-last pipeline stages return the hidden states to send on."""
        inp = self.prepare_inputs(plan)
        hidden = self._run_graph(inp, hidden_in)
        if hidden is None and self.compiled:
            hidden = self._run_compiled(inp, hidden_in)
        elif hidden is None:
            hidden = self.forward(inp.input_ids, inp.positions, inp.attn, hidden_in)
        if not self.pi.is_last_stage:
            return hidden
        return self.sample(inp, hidden)

    def sample(self, inp: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        out = ModelRunnerOutput(inp.sample_req_ids, [])
        if inp.sample_req_ids:
            logits = self.model.compute_logits(hidden[inp.logits_indices])
            md = self.sampling_metadata(inp.sample_req_ids, inp.sample_out_counts)
            ids, raw_lp = sample(logits, md)
            self.prev_sampled = ids
            self.prev_index = {rid: i for i, rid in enumerate(inp.sample_req_ids)}
            out.defer(ids)
            if raw_lp is not None:
                nums = [self.reqs[r].sampling_params.logprobs for r in inp.sample_req_ids]
                entries = gather_logprobs(raw_lp, ids, [n or 0 for n in nums])
                out.logprobs = [e if n is not None else None for e, n in zip(entries, nums)]
        for rid, first_row, count, first_pos in inp.prompt_lp:
            st = self.reqs[rid]
            logits = self.model.compute_logits(hidden[first_row:first_row + count]).float()
            targets = torch.from_numpy(self.token_ids[st.row, first_pos:first_pos + count]).to(self.device)
            out.prompt_logprobs[rid] = gather_logprobs(
                logits.log_softmax(-1), targets, [st.sampling_params.prompt_logprobs] * count)
        return out
