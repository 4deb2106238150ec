"""How a step's forward runs: a replayed CUDA graph (decode batches up to the largest captured
size), the torch.compile'd decoder layers (level 2), or the eager model. Everything reads the
input batch's persistent device buffers, so graphs captured once serve every step.
"""
from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn as nn

from ..models.layers import AttnMeta
from .config import EngineConfig
from .input_batch import InputBatch

log = logging.getLogger(__name__)


class CompiledModel:
    def __init__(self, model: nn.Module, cfg: EngineConfig, batch: InputBatch, max_model_len: int,
                 device: torch.device, show_progress: bool):
        self.model, self.cfg, self.batch = model, cfg, batch
        self.max_model_len = max_model_len
        self.device = device
        self.show_progress = show_progress
        self.forward = model.forward
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # speculative decoding: batches where every request has 1 + k query tokens (verify)
        self.verify_len = 0
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # --cudagraph-mode full: steps with prompt tokens, per token bucket (None: capture failed)
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.mixed = False  # set by compile() for the model runner's target model
        self.pool = None  # the graphs' shared memory pool
        self.capture_stream = None  # the stream every graph is captured on
        self.precompiled = False  # every Triton variant of the graphs' steps was compiled
        self.compiled = False

    def compile(self, mixed: bool = False) -> dict[str, float]:
        """Level 2: torch.compile each decoder layer; level ≥ 1 on CUDA: capture decode CUDA
        graphs. Compilation happens in `warmup`, before the capture. Returns phase timings.
        `mixed`: this is the engine's model, which --cudagraph-mode full applies to."""
        timings = {}
        level = self.cfg.compilation.level(self.device.type)
        self.compiled = level >= 2
        self.mixed = mixed and self.full_mode(log_why=True)
        if level >= 2:
            # --cache-dir wins over the environment: Inductor and Triton take their cache
            # directories only from these variables (Inductor itself writes its own back)
            cache = self.cfg.compilation.cache_dir
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
            os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
            self.forward = self._with_compile_settings(self.model.forward)
            # Regional compilation: every decoder layer runs the same compiled code (parameters
            # are graph inputs, so the guards hold for all layers): one compilation instead of
            # one graph holding every layer cuts cold and warm start-up several times over.
            for layer in self.model.model.layers.values():
                layer.compile(fullgraph=True, dynamic=True)
        if level >= 2 or self.device.type == "cuda":
            t0 = time.perf_counter()
            self.warmup()
            timings["compile" if level >= 2 else "warmup"] = time.perf_counter() - t0
        if level >= 1 and self.device.type == "cuda":
            t0 = time.perf_counter()
            self.capture_cuda_graphs()
            timings["cuda_graphs"] = time.perf_counter() - t0
        return timings

    def full_mode(self, log_why: bool = False) -> bool:
        """Whether --cudagraph-mode gives the engine's model graphs of steps with prompt tokens:
        `full` wherever it is asked (refused where it cannot run); `auto` where it can run,
        except with LoRA or speculative decoding."""
        from .config import ConfigError
        mode = self.cfg.compilation.cudagraph_mode
        if mode == "decode":
            return False
        graphs = self.cfg.compilation.level(self.device.type) >= 1 and self.device.type == "cuda"
        why = None
        if not graphs:
            why = ("--cudagraph-mode full needs CUDA graphs: a CUDA device, --compilation-level 1 "
                   "or 2 and no --enforce-eager")
        elif self.cfg.parallel.world_size > 1:  # (refused for `full` by EngineConfig.validate)
            why = "--cudagraph-mode full runs on single-rank engines only"
        elif list(getattr(self.model, "mamba_layers", lambda: [])()):
            why = ("--cudagraph-mode full does not work with recurrent (Mamba2) layers: their "
                   "prefill is not captured; drop it")
        if why and mode == "full":
            raise ConfigError(why)
        if why is None and mode == "auto" and (self.cfg.lora.enable_lora or self.cfg.spec):
            # runs when asked for, but auto keeps to what the GPU tests compared with eager
            why = "LoRA and speculative decoding: not compared with eager on the GPU yet"
        if why and mode == "auto" and log_why and graphs:  # (no graphs at all: nothing to say)
            log.info("--cudagraph-mode auto: decode graphs only (%s)", why)
        return why is None

    @torch.inference_mode()
    def precompile(self, profile_step) -> float | None:
        """Compile the Triton variants that the memory profile (`profile_step`), the warm-up and
        the graph capture will launch, all at once on a thread pool (kernels/precompile.py),
        before those phases run. CUDA at levels 0-1 only (level 2's warm-up is torch.compile's
        own). Returns the seconds it took, or None where it did not run."""
        from ..kernels import precompile as pre
        from . import envs
        level = self.cfg.compilation.level(self.device.type)
        if self.device.type != "cuda" or level >= 2 or not envs.get("RANKSERVE_PRECOMPILE") \
                or not pre.available():
            return None
        t0 = time.perf_counter()
        sizes = self.capture_sizes() if level >= 1 else []
        steps = [profile_step, self.warmup]
        steps += [lambda bs=bs: self.forward(*self.graph_inputs(bs)) for bs in sizes]
        steps += [lambda bs=bs: self.forward(*self.verify_inputs(bs)) for bs in self.verify_sizes(sizes)]
        if level >= 1 and self.full_mode():  # (the engine's model)
            steps += [lambda t=t: self.forward(*self.mixed_inputs(t)) for t in self.mixed_sizes()]
        failed = None
        with pre.compile_only(self.device) as pool:
            for step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 (what it missed compiles where first run)
                    failed = failed or e
        torch.cuda.synchronize()
        self.precompiled = failed is None
        seconds = time.perf_counter() - t0
        log.info("precompile: %d Triton variants in %.2f s (%d dry steps%s)", pool.submitted,
                 seconds, len(steps), f"; a dry step failed: {failed!r}" if failed else "")
        return seconds

    @staticmethod
    def _with_compile_settings(forward):
        """The engine's torch.compile settings, applied around each compiled call rather than
        changed for the whole process (other models in the process keep the defaults)."""
        def run(*args):
            # one model per process, but tests build many: never fall back to eager silently;
            # equal sizes (tokens == requests in a decode step) must not share one symbol, or
            # the next step breaks the equality and recompiles
            with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)), \
                    torch.fx.experimental._config.patch(use_duck_shape=False):
                return forward(*args)
        return run

    @torch.inference_mode()
    def warmup(self) -> None:
        """One mixed step per attention tile shape (mean query length >= 256, 16..255, < 16:
        kernels/triton_attention.py) and one decode step (the other attention mode: a graph of
        its own at level 2), so that compilation (torch.compile at level 2, Triton variants at
        every level) happens now and not under the first requests. Padding slots write nothing;
        the KV cache is read but left as it is."""
        b = self.batch
        budget = self.cfg.scheduler.max_num_batched_tokens
        for q_len in (300, 20, 3, 1):
            q_len = max(1, min(q_len, budget // 2, self.max_model_len - 1))
            T, B = 2 * q_len, 2
            # the persistent buffers, as in a real step (other tensors would guard differently)
            b.ids[:T].zero_()
            b.pos[:T].zero_()
            b.slots[:T].fill_(-1)
            b.qsl[:B + 1].copy_(torch.tensor([0, q_len, T]))
            b.seq_lens[:B].fill_(q_len)
            b.table[:B].zero_()
            b.state_idx[:B].fill_(-1)  # and no recurrent state
            b.order[:B].copy_(b.arange[:B])  # (a real step's order may name other rows)
            hidden = None if b.hidden is None else b.hidden[:T]
            self.forward(b.ids[:T], b.pos[:T], b.attn(T, B, is_decode=q_len == 1), hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
                 hidden_in: torch.Tensor | None, query_len: int = 0) -> torch.Tensor:
        """One step's forward; the inputs are prefixes of the input batch's buffers.
        `query_len`: every request's query length when they are all equal, else 0."""
        if query_len > 1 and query_len == self.verify_len:
            hidden = self._run_verify_graph(input_ids.shape[0], attn, hidden_in)
            if hidden is not None:
                return hidden
        hidden = self._run_graph(input_ids.shape[0], attn, hidden_in)
        if hidden is not None:
            return hidden
        hidden = self._run_mixed_graph(input_ids.shape[0], attn, hidden_in)
        if hidden is not None:
            return hidden
        if self.compiled:
            return self._run_compiled(input_ids, positions, attn, hidden_in)
        return self.forward(input_ids, positions, attn, hidden_in)

    def _run_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMeta,
                      hidden_in: torch.Tensor | None) -> torch.Tensor:
        """The compiled forward, with the token and request counts padded to at least 2: a size
        of 1 would be specialised by torch.compile and cost a second compilation. The padding
        request has no query, so the step keeps its attention mode (T == B says nothing)."""
        T, B = input_ids.shape[0], attn.seq_lens.shape[0]
        if T >= 2 and B >= 2:
            return self.forward(input_ids, positions, attn, hidden_in)
        b = self.batch
        T2, B2 = max(T, 2), max(B, 2)
        b.pad(T, T2, B, B2)
        if hidden_in is not None:
            b.hidden[:T].copy_(hidden_in)
            hidden_in = b.hidden[:T2]
        attn = b.attn(T2, B2, attn.is_decode)
        return self.forward(b.ids[:T2], b.pos[:T2], attn, hidden_in)[:T]

    # ---- CUDA graphs ------------------------------------------------------------------------
    def capture_sizes(self) -> list[int]:
        c, s = self.cfg.compilation, self.cfg.scheduler
        top = min(c.cuda_graph_max_bs or s.max_num_seqs, s.max_num_seqs, 512)
        # compiled graphs never see a dimension of size 1 (see _run_compiled): start at 2
        sizes = [n for n in [1, 2, 4] + list(range(8, 513, 8))
                 if n <= max(top, 2) and not (self.compiled and n == 1)]
        return sizes if max(top, 2 if self.compiled else 1) in sizes else sizes + [top]

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """One graph per padded decode batch size; padding requests have no query and no
        context, padding tokens write to slot -1 (nowhere)."""
        from tqdm import tqdm
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = self.capture_stream = torch.cuda.Stream()
        sizes = sorted(self.capture_sizes(), reverse=True)
        for bs in tqdm(sizes, desc="Capturing CUDA graphs", disable=not self.show_progress):
            args = self.graph_inputs(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile for this size / warm up outside the capture
                    self.forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(*args)
            self.graphs[bs] = (graph, out)
        for bs in self.verify_sizes(sizes):
            args = self.verify_inputs(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(*args)
            self.verify_graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        if self.mixed:
            self.capture_mixed_graphs()

    def capture_mixed_graphs(self) -> None:
        """--cudagraph-mode full: every token bucket's graph now, largest first (their memory
        comes from the shared pool), over an all-padding step: the first requests replay graphs
        instead of capturing them inside their own steps (0.24 s for 11 buckets on Qwen3-0.6B,
        benchmarks/2026-12-04-h200-s11). Buckets whose capture fails run eagerly; none is
        captured lazily afterwards."""
        from tqdm import tqdm
        t0 = time.perf_counter()
        B2 = self.cfg.scheduler.max_num_seqs
        for T2 in tqdm(sorted(self.mixed_sizes(), reverse=True), desc="Capturing mixed-step CUDA graphs",
                       disable=not self.show_progress):
            self.batch.pad(0, T2, 0, B2)  # no request has a query or a context, no token a slot
            self.mixed_graphs[T2] = self._capture_mixed(T2)
        log.info("captured %d CUDA graphs of steps with prompt tokens (buckets up to %d tokens) in %.2f s",
                 sum(g is not None for g in self.mixed_graphs.values()), max(self.mixed_sizes()),
                 time.perf_counter() - t0)

    def graph_inputs(self, bs: int) -> tuple:
        """The forward's arguments for a decode graph of `bs` requests: views of the persistent
        buffers, which every replay reads. For the capture the requests are fresh one-token
        ones without a KV slot (-1) or a recurrent-state slot (-1): it writes nothing."""
        b = self.batch
        b.slots[:bs].fill_(-1)
        b.qsl[:bs + 1].copy_(torch.arange(bs + 1, device=self.device))
        b.seq_lens[:bs].fill_(1)
        b.state_idx[:bs].fill_(-1)
        b.order[:bs].copy_(b.arange[:bs])  # the warm-up before a capture runs on it
        hidden = None if b.hidden is None else b.hidden[:bs]
        return b.ids[:bs], b.pos[:bs], b.attn(bs, bs, is_decode=True), hidden

    def verify_sizes(self, sizes: list[int]) -> list[int]:
        """The batch sizes of the verify graphs (speculative decoding), largest first."""
        q, max_t = self.verify_len, self.batch.ids.shape[0] - 1
        return sorted((s for s in sizes if s * q <= max_t), reverse=True) if q > 1 else []

    def verify_inputs(self, bs: int) -> tuple:
        """The forward's arguments for a uniform verify batch: 1 + k query tokens per request."""
        b, q = self.batch, self.verify_len
        T = bs * q
        b.slots[:T].fill_(-1)
        b.qsl[:bs + 1].copy_(torch.arange(bs + 1, device=self.device) * q)
        b.seq_lens[:bs].fill_(q)
        return (b.ids[:T], b.pos[:T], b.attn(T, bs, is_decode=False),
                None if b.hidden is None else b.hidden[:T])  # (an EAGLE head's input states)

    def _run_verify_graph(self, T: int, attn: AttnMeta, hidden_in: torch.Tensor | None
                          ) -> torch.Tensor | None:
        """Replay the smallest verify graph that fits (padding requests have no query)."""
        B = attn.seq_lens.shape[0]
        bs = next((s for s in sorted(self.verify_graphs) if s >= B), None)
        if bs is None:
            return None
        self.batch.pad(T, bs * self.verify_len, B, bs)
        if hidden_in is not None:
            self.batch.hidden[:T].copy_(hidden_in)
        graph, out = self.verify_graphs[bs]
        graph.replay()
        return out[:T]

    def _run_graph(self, T: int, attn: AttnMeta, hidden_in: torch.Tensor | None
                   ) -> torch.Tensor | None:
        """Replay the smallest captured graph that fits a decode-only step, else None."""
        B = attn.seq_lens.shape[0]
        if not self.graphs or not attn.is_decode:  # graphs are captured in decode mode only
            return None
        bs = next((s for s in sorted(self.graphs) if s >= B), None)
        if bs is None:
            return None
        b = self.batch
        b.pad(T, bs, B, bs)  # T == B
        if hidden_in is not None:
            b.hidden[:B].copy_(hidden_in)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:B]

    # ---- --cudagraph-mode full: steps with prompt tokens -------------------------------------
    def mixed_sizes(self) -> list[int]:
        """Token buckets of the mixed-step graphs: 64, 128, 256, then multiples of 512 up to
        the step budget (at most 511 padding tokens: their GEMM rows are the waste)."""
        top = self.batch.ids.shape[0] - 1  # max(max_num_batched_tokens, max_num_seqs)
        sizes = [s for s in (64, 128, 256) if s < top] + list(range(512, top, 512))
        return sizes + [top]

    def mixed_inputs(self, T2: int) -> tuple:
        """The forward's arguments for a mixed graph of T2 tokens: every request slot
        (max_num_seqs) present, those past the step's requests padding (no query, no context)."""
        b, B2 = self.batch, self.cfg.scheduler.max_num_seqs
        return (b.ids[:T2], b.pos[:T2], b.attn(T2, B2, is_decode=False),
                None if b.hidden is None else b.hidden[:T2])

    def _run_mixed_graph(self, T: int, attn: AttnMeta, hidden_in: torch.Tensor | None
                         ) -> torch.Tensor | None:
        """Replay the graph of the smallest token bucket that fits a step with prompt tokens
        (captured at start-up); None where no graph serves (eager)."""
        if not self.mixed or attn.is_decode:
            return None
        T2 = next((s for s in self.mixed_sizes() if s >= T), None)
        if self.mixed_graphs.get(T2) is None:  # too large, or its capture failed
            return None
        b = self.batch
        b.pad(T, T2, attn.seq_lens.shape[0], self.cfg.scheduler.max_num_seqs)
        if hidden_in is not None:
            b.hidden[:T].copy_(hidden_in)
        graph, out = self.mixed_graphs[T2]
        graph.replay()
        return out[:T]

    @torch.inference_mode()
    def _capture_mixed(self, T2: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Capture the mixed graph of T2 tokens over the buffers as they are (at start-up: an
        all-padding step, which writes no KV entry; recurrent layers are refused). What the
        kernels decide on the host comes from shapes only (T2 tokens, max_num_seqs requests),
        so the graph serves every step of its bucket. A capture that fails (an op that syncs or
        reads device values on the host) leaves that bucket eager."""
        args = self.mixed_inputs(T2)
        stream = self.capture_stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        # The eager run before a capture compiles what is new for the shape. At level 1 after
        # the precompile every Triton variant exists, and the decode captures ran cuBLAS on this
        # stream: skipping it saves the GPU work of every bucket (~0.5 s on Llama-8B at 4096
        # tokens); a capture that still fails gets the run and a second try.
        for warm in ((True,) if self.compiled or not self.precompiled else (False, True)):
            try:
                if warm:
                    with torch.cuda.stream(stream):
                        self.forward(*args)
                    torch.cuda.current_stream().wait_stream(stream)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                      capture_error_mode="thread_local"):
                    out = self.forward(*args)
                break
            except Exception as e:  # noqa: BLE001  (that bucket stays eager; the step goes on)
                torch.cuda.current_stream().wait_stream(stream)
                if warm:
                    log.warning("--cudagraph-mode full: no graph for steps of %d tokens (%s: %s); "
                                "they run eagerly", T2, type(e).__name__, e)
                    return None
                log.debug("capture of %d tokens without a run before it failed (%r): again", T2, e)
        log.debug("captured the CUDA graph of steps with prompt tokens up to %d tokens in %.2f s",
                  T2, time.perf_counter() - t0)
        return graph, out
