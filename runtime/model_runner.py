"""ModelRunner: owns the model, its paged KV cache and per-request state on one rank; turns a
step plan (`SchedulerOutput`) into model inputs, runs the forward and samples.

Its helpers: the persistent input batch (runtime/input_batch.py), so building a step's inputs
is a handful of vectorised gathers rather than Python loops over tokens; how the forward runs,
compiled and CUDA-graphed (runtime/compilation.py); the sampling metadata
(runtime/sampling_metadata.py).
"""
from __future__ import annotations

import gc
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import gemv, pdl, quant, quant_tc, triton_attention
from ..models.config_queries import rope_max_len, without_mtp
from ..models.layers import AttnMeta
from ..models.parallel import ParallelInfo
from ..models.loader import (
    build_model, init_dummy_weights, load_hf_config, load_weights, quant_summary, resolve_dtype)
from . import envs, startup_clock
from .compilation import CompiledModel
from .config import ConfigError, EngineConfig
from .input_batch import InputBatch, ReqState
from .sampler import SamplingMetadata, gather_logprobs, sample, target_probs
from .sampling_metadata import SamplingMetadataBuilder
from .messages import LogprobsEntry
from .scheduler import SchedulerOutput
from .spec_decode import ProposeContext

log = logging.getLogger("rankserve.runner")

# checkpoint names of KV-cache scales (their last parts); which layer buffer each goes to is the
# model's map_weight
KV_SCALE_NAME = re.compile(r"(^|\.)(k_scale|v_scale|kv_scale|[kv]_proj\.output_scale)$")
KV_SCALE_TARGET = re.compile(r"\.(self_attn|mixer)\.[kv]_scale$")  # the attention layers' buffers


def load_kv_scales(model, model_dir: str) -> tuple[int, int]:
    """Set the attention layers' k_scale / v_scale buffers (in place: CUDA graphs read them)
    from the checkpoint's tensors, 1.0 where it has none; (layers with scales, layers). A scale
    that is not one finite positive number, or one that no layer takes, is an error (before any
    buffer changes): using 1.0 instead would silently corrupt the cache."""
    from ..models.loader import checkpoint_files, open_weights, read_slice
    scales = {}
    for path in checkpoint_files(model_dir):  # the weight files: *.safetensors, else *.bin
        with open_weights(path) as (names, get):
            for name in names:
                if not KV_SCALE_NAME.search(name):
                    continue
                targets = [t for t, _ in model.map_weight(name)]
                if any(not KV_SCALE_TARGET.search(t) for t in targets):
                    raise ValueError(f"{name}: not a KV-cache scale rankserve can use (names: "
                                     "self_attn.k_scale / v_scale, k_proj / v_proj.output_scale, "
                                     "k_proj.k_scale / v_proj.v_scale, kv_scale)")
                t = read_slice(get(name)).float()
                if t.numel() != 1:
                    raise ValueError(f"{name}: only per-tensor KV-cache scales are supported "
                                     f"(shape {tuple(t.shape)})")
                if not (torch.isfinite(t).all() and t.item() > 0):
                    raise ValueError(f"{name}: a KV-cache scale must be finite and > 0, got {t.item()}")
                scales.update((target, t.reshape(())) for target in targets)
    found = set()
    for n, b in model.named_buffers():
        if KV_SCALE_TARGET.search(n):  # (another pipeline stage's layers are not here)
            b.copy_(scales.get(n, torch.ones(())))
            if n in scales:
                found.add(n.rsplit(".", 1)[0])
    return len(found), len(model.attention_layers())


def logits_rows(m: int) -> int:
    """The rows a logits GEMM of m rows runs at: a power of 2 up to 16, a multiple of 16 up to
    512, then of 64 (fewer shapes to warm where verify steps make many rows).
    A GEMM shape cuBLAS has not run in this process costs its host milliseconds the first
    time (its kernels load lazily, the call blocks until the device is idle): with m itself,
    a server's first burst met ~5 ms of it in most steps (H200, W1 through the server, host
    profile in benchmarks/2026-12-04-h200-s12), and the device waited for the host.
    The target's logits (`ModelRunner.logits`) and the speculative proposers' own (draft
    model, EAGLE head, MTP layer: runtime/spec_decode.py) both run at these rows."""
    if m <= 16:
        return 1 << max(m - 1, 0).bit_length()
    step = 16 if m <= 512 else 64
    return -(-m // step) * step


def padded_logits(fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                  pad: bool | None = None) -> torch.Tensor:
    """fn(h), a logits GEMM of h's rows, run at logits_rows(len(h)) rows (zero rows pad it) on
    CUDA, or where `pad` says; the rows of h come back."""
    m = h.shape[0]
    extra = logits_rows(m) - m if (h.is_cuda if pad is None else pad) else 0
    if extra:
        return fn(F.pad(h, (0, 0, 0, extra)))[:m]
    return fn(h)


@torch.inference_mode()
def warm_logits_rows(fn: Callable[[torch.Tensor], torch.Tensor], rows: int, width: int,
                     dtype: torch.dtype, device: torch.device) -> None:
    """fn once at every row count `padded_logits` runs it at for 1 .. rows rows (of `width`
    columns), at start-up."""
    h = torch.zeros(logits_rows(rows), width, dtype=dtype, device=device)
    for m in sorted({logits_rows(m) for m in range(1, rows + 1)}):
        fn(h[:m])
    if h.is_cuda:
        torch.cuda.synchronize()


def cache_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its pages stay untouched until used: numpy's zeros
    come from calloc, i.e. fresh zero pages from the OS for a large block, where torch.zeros
    writes every byte (about 0.5 s per GiB of the default 1 GiB cache at start-up, and as long
    again to hand the pages back at exit)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if device.type != "cpu" or nbytes < 2**20:  # (also: a byte view of an empty array fails)
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass
class ModelRunnerOutput:
    """What the last pipeline stage returns for one step."""
    req_ids: list[str]  # requests that produced a token (their prefill is complete)
    sampled_token_ids: list[int]
    # aligned with req_ids, for requests that asked: an entry per token emitted (drafts accepted)
    logprobs: list[list[LogprobsEntry] | None] | None = None
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # speculative decoding: per request, the drafts this step accepted (emitted before the
    # sampled token) and the proposals for its next step
    accepted: list[list[int]] | None = None
    draft_token_ids: list[list[int] | None] | None = None  # None: no proposal work for it
    _pending: tuple | None = None  # (pinned host copy, CUDA event) until resolve()
    _sample: Callable[[], None] | None = None  # a sampling deferred until its grammar masks are ready

    def defer(self, ids) -> None:
        """Start the device→host copy of the sampled ids; `resolve` waits for it."""
        if not ids.is_cuda:
            self.sampled_token_ids = ids.tolist()
            return
        import torch
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def finish(self) -> None:
        """Run a deferred sampling (on the engine's thread: the runner's next step or collect)."""
        fn, self._sample = self._sample, None
        if fn is not None:
            fn()

    def resolve(self) -> "ModelRunnerOutput":
        self.finish()
        if self._pending is not None:
            host, event = self._pending
            event.synchronize()
            self.sampled_token_ids = host.tolist()
            self._pending = None
        return self

    def __getstate__(self):  # sent between ranks: resolved first
        self.resolve()
        return self.__dict__


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttnMeta
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sample_req_ids: list[str]
    sample_out_counts: np.ndarray  # outputs before this step's sample, per sampled request
    prompt_lp: list[tuple[str, int, int, int]]  # (req id, first hidden row, count, first target pos)
    # the plan's constrained requests and its bitmask filler (called at sampling time)
    grammar: tuple[list[str], Callable[[], np.ndarray]] | None = None
    query_len: int = 0  # every request's query length when they are all equal (CUDA graphs)
    # speculative decoding, per sampled request: drafts verified, position of the first token
    # it emits, index among the step's requests
    num_drafts: np.ndarray | None = None
    base_pos: np.ndarray | None = None
    sample_index: np.ndarray | None = None
    rows: np.ndarray | None = None  # every request's input-batch row (host)
    seq_lens: np.ndarray | None = None  # every request's tokens after the step (host)
    starts: np.ndarray | None = None  # every request's tokens before the step (host)
    paused: np.ndarray | None = None  # [B] bool: drafting paused (backoff), no proposer work
    new: np.ndarray | None = None  # [B] bool: the request (re)starts on this rank
    known: np.ndarray | None = None  # [B] tokens the host knows (the rest are placeholders)
    pause_on_miss: np.ndarray | None = None  # [B] bool: pauses drafting if it accepts nothing
    forced: dict[str, list[int]] | None = None  # thinking_token_budget: the plan's forced tokens


class ModelRunner:
    host_kv = None  # this rank's host KV tier (runtime/kv_offload.py), set up by the executor

    def __init__(self, cfg: EngineConfig, pi: ParallelInfo, device: torch.device):
        startup_clock.mark("before_engine")  # since the last mark (all of it under `serve`)
        gemv.MAX_M = envs.get("RANKSERVE_SKINNY_MAX_M")  # a process-wide kernel choice
        gemv.SWIGLU_EPILOGUE = envs.get("RANKSERVE_SWIGLU_EPILOGUE")
        pdl.ENABLED = envs.get("RANKSERVE_PDL")
        triton_attention.FUSED_DECODE_MAX_B = envs.get("RANKSERVE_FUSED_DECODE_MAX_B")
        triton_attention.DECODE_LPT = envs.get("RANKSERVE_DECODE_LPT")
        tc = envs.get("RANKSERVE_QUANT_TC_MAX_M")  # measured: block FP8 layers 1.9x faster at M = 1
        quant.TC_MAX_M = tc if tc is not None else 16 if device.type == "cuda" else 0
        if quant.TC_MAX_M and device.type == "cuda":
            quant_tc.reserve(device)  # split-K counters, before any CUDA graph is captured
        self.cfg = cfg
        self.pi = pi
        self.device = device
        if device.type == "cuda":  # what other engines of this process hold is not ours
            gc.collect()
            torch.cuda.empty_cache()
            self._mem_base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        self.hf_config = load_hf_config(cfg.model.model, cfg.compilation.cache_dir)
        if cfg.spec is None or cfg.spec.method != "mtp":
            self.hf_config = without_mtp(self.hf_config)
        self.dtype = resolve_dtype(cfg.model.dtype, self.hf_config, device.type)
        longest = rope_max_len(self.hf_config)  # max_position_embeddings, or RoPE scaling's
        self.max_model_len = min(cfg.model.max_model_len or longest, longest)
        if cfg.model.max_model_len and cfg.model.max_model_len > longest:
            n = self.hf_config.max_position_embeddings
            scaled = f", {longest} with its rope_scaling" if longest != n else ""
            raise ValueError(f"--max-model-len {cfg.model.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({n}{scaled})")
        sched = cfg.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            # (as vLLM) every prompt must fit one step: a smaller budget would cap the context
            # below --max-model-len and refuse the longer prompts one by one after start-up
            raise ValueError(f"--max-num-batched-tokens ({sched.max_num_batched_tokens}) is smaller than "
                             f"--max-model-len ({self.max_model_len}) with --no-enable-chunked-prefill: "
                             "raise --max-num-batched-tokens, lower --max-model-len or enable chunked prefill")
        torch.manual_seed(cfg.model.seed)
        if cfg.parallel.enable_expert_parallel and not any(
                getattr(self.hf_config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            # the flag would change nothing (a draft model may be dense: only the target is checked)
            raise ValueError(f"--enable-expert-parallel: {self.hf_config.architectures[0]} has no MoE "
                             "experts to shard (a dense model: drop the flag)")
        self.model = build_model(self.hf_config, pi, self.dtype, device, cfg.model.quantization)
        if cfg.load.load_format == "dummy":
            init_dummy_weights(self.model, cfg.model.seed, self.hf_config)
        else:
            load_weights(self.model, cfg.model.model, progress=pi.tp_rank == 0 and pi.is_first_stage)
        if self.model.quant_config is not None and pi.tp_rank == 0:
            log.info("quantization %s: %s", self.model.quant_config.name, quant_summary(self.model))
        self.lora = None  # LoRA adapter slots (runtime/lora.py)
        if cfg.lora.enable_lora:
            from .lora import LoRASlots
            self.lora = LoRASlots(self.model, cfg.lora, max(cfg.scheduler.max_num_batched_tokens,
                                  cfg.scheduler.max_num_seqs), cfg.scheduler.max_num_seqs,
                                  self.dtype, device)
        self.kv_dtype = self._kv_cache_dtype()
        if self.kv_dtype == torch.float8_e4m3fn and cfg.load.load_format != "dummy":
            self.load_kv_scales(cfg.model.model)
        self.timings = {"load": time.perf_counter() - t0}
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = cfg.cache.block_size
        self.num_blocks = 0
        n = cfg.scheduler.max_num_seqs
        self.batch = InputBatch(n, self.max_model_len, self.block_size,
                                cfg.scheduler.max_num_batched_tokens,
                                None if pi.is_first_stage else self.hf_config.hidden_size,
                                self.dtype, device)
        self.batch.lpt = triton_attention.DECODE_LPT
        self.sampling = SamplingMetadataBuilder(self.batch, n, self.vocab_size)
        self.compiled_model = CompiledModel(self.model, cfg, self.batch, self.max_model_len, device,
                                            show_progress=pi.tp_rank == 0)
        self.proposer = None  # speculative decoding (runtime/spec_decode.py)
        if cfg.spec is not None:
            from .spec_decode import make_proposer
            self.proposer = make_proposer(self, cfg.spec)
            self.compiled_model.verify_len = 1 + cfg.spec.num_speculative_tokens
        # async scheduling: the last step's sampled ids stay on the device and feed the next
        # step's placeholder inputs
        self.prev_sampled: torch.Tensor | None = None
        self.prev_index: dict[str, int] = {}
        self._deferred: ModelRunnerOutput | None = None  # a step whose sampling waits for masks
        self._deferred_after_prepare = False  # ... which may finish after the next step's prepare

    @property
    def reqs(self) -> dict[str, ReqState]:
        return self.batch.reqs

    # ---- KV cache ---------------------------------------------------------------------------
    def _kv_cache_dtype(self) -> torch.dtype:
        if not self.cfg.cache.fp8_kv:
            return self.dtype
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"--kv-cache-dtype {self.cfg.cache.kv_cache_dtype} needs a GPU with fp8 "
                             "support (compute capability 8.9 or newer: Ada, Hopper, Blackwell)")
        return torch.float8_e4m3fn

    def load_kv_scales(self, model_dir: str) -> None:
        """The fp8 cache's per-layer k/v scales from checkpoint `model_dir` (at start and with
        new weights from disk); layers it has none for use 1.0."""
        found, total = load_kv_scales(self.model, model_dir)
        if found:
            log.info("fp8 KV cache: k/v scales of %d of %d layers from the checkpoint (others 1.0)",
                     found, total)
        else:
            log.info("fp8 KV cache: the checkpoint has no k/v scales; using 1.0 (e4m3 holds +-448)")

    def kv_bytes_per_block(self) -> int:
        own = sum(self._kv_token_bytes(a) for a in self.model.attention_layers()) * self.block_size
        return own + (self.proposer.kv_bytes_per_block() if self.proposer else 0)  # a draft's cache

    def _kv_shapes(self, a, num_blocks: int) -> tuple[tuple, tuple]:
        """K and V cache shapes of one attention layer; an MLA layer keeps one latent cache (its
        V has width 0)."""
        if hasattr(a, "kv_cache_shapes"):
            return a.kv_cache_shapes(num_blocks, self.block_size)
        shape = (num_blocks, self.block_size, a.qkv_proj.num_kv_heads, a.head_dim)
        return shape, shape

    def _kv_token_bytes(self, a) -> int:
        k, v = self._kv_shapes(a, 1)
        return int(np.prod(k[2:]) + np.prod(v[2:])) * self.kv_dtype.itemsize

    def determine_num_blocks(self) -> int:
        c = self.cfg.cache
        if self.device.type == "cuda":
            self.allocate_kv_cache(1)  # a placeholder cache for the dry steps to read
            seconds = self.compiled_model.precompile(self._profile_step)
            if seconds is not None:
                self.timings["precompile"] = seconds
        if c.num_gpu_blocks_override:
            return c.num_gpu_blocks_override
        if not self.kv_bytes_per_block():  # no KV here: as many blocks as requests could use
            return self.cfg.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        if self.device.type == "cuda":
            return self._profile_num_blocks()
        return max(1, int(c.kv_cache_memory_gb * 2**30) // self.kv_bytes_per_block())

    def _profile_num_blocks(self) -> int:
        """Run the largest step once; give `utilization × total − peak` to the KV cache."""
        gc.collect()  # an engine dropped earlier in this process may still hold its KV cache
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.allocate_kv_cache(1)
        t0 = time.perf_counter()
        self._profile_step()
        torch.cuda.synchronize()
        self.timings["memory_profile"] = time.perf_counter() - t0
        # --gpu-memory-utilization is this engine's share (as in vLLM): its weights and largest
        # step, not what another engine in the process allocated before it started
        peak = torch.cuda.max_memory_allocated() - self._mem_base
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()  # other processes, contexts
        budget = self.cfg.cache.gpu_memory_utilization * total - peak - used_by_others
        # ... and never more than is left on the device
        budget = min(budget, free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        num = int(budget // self.kv_bytes_per_block())
        if num <= 0:
            raise RuntimeError(f"no memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB); raise --gpu-memory-utilization")
        return num

    def _profile_step(self) -> None:
        """The largest step: a prefill of the whole token budget, then a full batch's sampling."""
        n = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len * self.cfg.scheduler.max_num_seqs)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        attn = AttnMeta(torch.full((n,), -1, dtype=torch.long, device=self.device),
                        torch.tensor([0, n], dtype=torch.int32, device=self.device),
                        torch.tensor([n], dtype=torch.int32, device=self.device),
                        torch.zeros((1, -(-n // self.block_size)), dtype=torch.int32, device=self.device),
                        state_idx=torch.full((1,), -1, dtype=torch.int32, device=self.device))
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

    @property
    def ssm_dtype(self) -> torch.dtype:
        return torch.float32 if self.cfg.cache.mamba_ssm_cache_dtype == "float32" else self.dtype

    def state_bytes(self) -> int:
        """Bytes of the per-request recurrent states (Mamba2 conv + SSM), one slot per row."""
        n = self.cfg.scheduler.max_num_seqs
        total = 0
        for m in getattr(self.model, "mamba_layers", list)():
            conv, ssm = m.state_shapes(n)
            total += np.prod(conv) * self.dtype.itemsize + np.prod(ssm) * self.ssm_dtype.itemsize
        return int(total)

    def allocate_states(self) -> None:
        """Recurrent-state slots: one per input-batch row (a request's slot is its row)."""
        n = self.cfg.scheduler.max_num_seqs
        for m in getattr(self.model, "mamba_layers", list)():
            conv, ssm = m.state_shapes(n)
            m.conv_state = torch.zeros(conv, dtype=self.dtype, device=self.device)
            m.ssm_state = torch.zeros(ssm, dtype=self.ssm_dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        t0 = time.perf_counter()
        self.num_blocks = num_blocks
        self.allocate_states()
        try:
            for a in self.model.attention_layers():
                k_shape, v_shape = self._kv_shapes(a, num_blocks)
                a.k_cache = cache_zeros(k_shape, self.kv_dtype, self.device)
                a.v_cache = cache_zeros(v_shape, self.kv_dtype, self.device)
        except (MemoryError, RuntimeError) as e:  # (torch's OutOfMemoryError is a RuntimeError)
            flags = ("--kv-cache-memory-gb" if self.device.type == "cpu"
                     else "--num-gpu-blocks-override or --gpu-memory-utilization")
            raise ConfigError(f"cannot allocate the KV cache ({num_blocks} blocks, "
                              f"{num_blocks * self.kv_bytes_per_block() / 2**30:.1f} GiB on "
                              f"{self.device.type}): lower {flags} ({str(e).splitlines()[0]})") from None
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        if num_blocks > 1:  # not the memory profile's placeholder
            self.timings["kv_alloc"] = time.perf_counter() - t0
            per_block = self.kv_bytes_per_block()
            log.info("KV cache: %s, %d bytes per block of %d tokens, %.2f GiB",
                     str(self.kv_dtype).replace("torch.", ""), per_block, self.block_size,
                     num_blocks * per_block / 2**30)
            kinds: dict[str, int] = {}  # bytes per token of each kind of layer state
            for a in self.model.attention_layers():
                kind = getattr(a, "kv_kind", None) or (
                    f"sliding-window {a.window}" if a.window else "full attention")
                kinds[kind] = kinds.get(kind, 0) + self._kv_token_bytes(a)
            log.info("KV bytes per token: %s", ", ".join(f"{k} {v}" for k, v in kinds.items()))
            if self.state_bytes():
                n = self.cfg.scheduler.max_num_seqs
                conv = ssm = 0  # bytes per request, whatever its length (0 per token)
                for m in self.model.mamba_layers():
                    c, s = m.state_shapes(1)
                    conv += np.prod(c) * self.dtype.itemsize
                    ssm += np.prod(s) * self.ssm_dtype.itemsize
                log.info("recurrent (Mamba2) state per request (0 per token): conv %d bytes, SSM %d "
                         "bytes (%s); %d slots (max_num_seqs), %.3f GiB", conv, ssm,
                         str(self.ssm_dtype).replace("torch.", ""), n, self.state_bytes() / 2**30)

    def compile(self) -> None:
        """torch.compile and CUDA-graph capture as the config says (runtime/compilation.py)."""
        self.timings.update(self.compiled_model.compile(mixed=True))
        if self.proposer is not None:
            self.timings.update(self.proposer.compile())
        if self.device.type == "cuda" and self.pi.is_last_stage:
            t0 = time.perf_counter()
            self.warm_logits()
            if self.proposer is not None:  # its own logits GEMMs, one draft a request per pass
                self.proposer.warm_logits()
            self.timings["logits_warmup"] = time.perf_counter() - t0

    # ---- logits -------------------------------------------------------------------------------
    logits_rows = staticmethod(logits_rows)

    def logits(self, h: torch.Tensor, pad: bool | None = None) -> torch.Tensor:
        """compute_logits of h's rows, run at logits_rows(len(h)) rows (zero rows pad it) on
        CUDA, or where `pad` says."""
        return padded_logits(self.model.compute_logits, h, pad)

    def warm_logits(self) -> None:
        """Every logits GEMM shape a step can run (up to max_num_seqs rows, times 1 + the
        drafts when verifying), once, at start-up."""
        drafts = self.cfg.spec.num_speculative_tokens if self.cfg.spec is not None else 0
        warm_logits_rows(self.model.compute_logits, self.cfg.scheduler.max_num_seqs * (1 + drafts),
                         self.hf_config.hidden_size, self.dtype, self.device)

    # ---- the step ---------------------------------------------------------------------------
    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        for st in self.batch.update(plan):
            self.sampling.add(st)
        req_ids = list(plan.num_scheduled_tokens)
        states = [self.reqs[rid] for rid in req_ids]
        counts = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        # tokens computed before this step
        done = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
        done_new = set(done)
        done.update({r.req_id: r.num_computed_tokens for r in plan.cached_reqs})
        start = np.array([done[rid] for rid in req_ids], dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        # speculative decoding: the drafts are input tokens after the known ones
        nspec = np.zeros(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            drafts = plan.spec_token_ids.get(rid) if plan.spec_token_ids else None
            if drafts:
                nspec[i] = len(drafts)
                self.batch.token_ids[rows[i], states[i].num_tokens:states[i].num_tokens + len(drafts)] = drafts
        cu = np.concatenate([[0], np.cumsum(counts)])
        T = int(cu[-1])
        req_of_tok = np.repeat(np.arange(len(req_ids)), counts)
        positions = np.arange(T) - cu[:-1][req_of_tok] + start[req_of_tok]
        tok_rows = rows[req_of_tok]
        b = self.batch
        input_ids = b.token_ids[tok_rows, positions]
        slots = (b.block_table[tok_rows, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)
        seq_lens = start + counts

        # tokens the runner does not know yet (async scheduling) come from the last step's
        # sampled ids on the device; a step samples when it reaches the end of what is known
        num_real = np.array([s.num_tokens for s in states], dtype=np.int64) + nspec
        placeholder = np.flatnonzero(positions >= num_real[req_of_tok])
        sample_mask = seq_lens >= num_real
        # a request scores its last 1 + (number of drafts) tokens
        ns = nspec[sample_mask]
        ends = (cu[1:] - 1)[sample_mask]
        if ns.any():
            first = np.concatenate([[0], np.cumsum(ns + 1)[:-1]])
            logits_indices = np.repeat(ends - ns, ns + 1) + np.arange(int((ns + 1).sum())) - np.repeat(first, ns + 1)
        else:
            logits_indices = ends
        sample_ids = [rid for rid, m in zip(req_ids, sample_mask) if m]
        prompt_lp = []
        for i, (rid, st) in enumerate(zip(req_ids, states)):
            if st.sampling_params.prompt_logprobs is None:
                continue
            # positions p in this chunk with p + 1 < num_prompt predict prompt token p + 1
            first, last = start[i], min(seq_lens[i], st.num_prompt_tokens - 1)
            if last > first:
                prompt_lp.append((rid, int(cu[i]), int(last - first), int(first + 1)))

        b.next_arena()
        put = b.stage
        B = len(req_ids)
        # only the columns this step reads: kernels never look past a request's seq_len
        ahead = self.proposer.lookahead if self.proposer is not None else 0
        width = min(int(-(-(seq_lens.max() + ahead) // self.block_size)), b.max_blocks_per_req) if B else 0
        put(b.block_table[rows, :width], b.table[:B, :width])
        is_decode = B > 0 and int(counts.max()) == 1  # the plan decides the mode
        attn = AttnMeta(put(slots, b.slots), put(cu.astype(np.int32), b.qsl),
                        put(seq_lens.astype(np.int32), b.seq_lens), b.table[:B],
                        is_decode=is_decode, state_idx=put(rows.astype(np.int32), b.state_idx),
                        decode_order=put(np.argsort(-seq_lens, kind="stable").astype(np.int32),
                                         b.order) if is_decode and b.lpt else None)
        ids = put(input_ids, b.ids)
        if self.lora is not None:
            self.lora.prepare(plan, req_ids, counts, attn.is_decode, put)
        self.finish_sampling()  # (a deferred sampling gives the placeholders their ids)
        if len(placeholder):
            src = np.array([self.prev_index[req_ids[i]] for i in req_of_tok[placeholder]])
            ids[put(placeholder)] = self.prev_sampled[put(src)]
        # exact even when the last token is still a placeholder
        out_counts = (seq_lens - nspec - np.array([s.num_prompt_tokens for s in states]))[sample_mask]
        grammar = (plan.grammar_req_ids, plan.bitmask) if plan.grammar_req_ids else None
        q = int(counts[0]) if B and counts.min() == counts.max() else 0
        paused = np.array([rid in plan.spec_paused for rid in req_ids], dtype=bool)
        new = np.array([rid in done_new for rid in req_ids], dtype=bool)
        return StepInputs(ids, put(positions, b.pos), attn, put(logits_indices),
                          sample_ids, out_counts, prompt_lp, grammar, q,
                          ns if ns.any() else None, (seq_lens - nspec)[sample_mask],
                          np.flatnonzero(sample_mask), rows, seq_lens, start, paused, new,
                          np.array([s.num_tokens for s in states], dtype=np.int64),
                          np.array([rid in plan.spec_pause_on_miss for rid in req_ids], dtype=bool),
                          plan.forced_token_ids or None)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput,
                hidden_in: torch.Tensor | None = None) -> ModelRunnerOutput | torch.Tensor:
        """Run one step. Non-last pipeline stages return the hidden states to send on."""
        if self.host_kv is not None:  # the plan's block copies to / from the host tier
            self.host_kv.run(plan)
        if not self._deferred_after_prepare:  # it reads request states this plan may drop
            self.finish_sampling()
        inp = self.prepare_inputs(plan)
        hidden = self.compiled_model(inp.input_ids, inp.positions, inp.attn, hidden_in,
                                     query_len=inp.query_len)
        if self.proposer is not None:
            self.proposer.on_forward(inp, hidden)
        if not self.pi.is_last_stage:
            return hidden
        if plan.grammar_fill is not None and inp.grammar is not None:
            # the masks fill on the grammar thread while the device runs the forward and the
            # engine does its own host work (the previous step's outputs, the next plan);
            # sampling waits for them: at the next step, once its inputs are prepared (or at
            # collect). Without drafts everything else of the sampling is done now (the logits
            # GEMM queues behind the forward), so only the masks' copy and the sampling kernels
            # wait, and the next step's host work does not depend on this one's request states.
            plan.fill_async(self.sampling.bits_buffer(plan.grammar_num_rows or len(plan.grammar_req_ids)))
            out = self._deferred = ModelRunnerOutput(inp.sample_req_ids, [])
            self._deferred_after_prepare = inp.num_drafts is None and self.proposer is None
            out._sample = (self._begin_sample(inp, hidden, out) if self._deferred_after_prepare
                           else lambda: self.sample(inp, hidden, out))
            return out
        return self.sample(inp, hidden)

    def finish_sampling(self) -> None:
        out, self._deferred = self._deferred, None
        if out is not None:
            out.finish()

    def sample(self, inp: StepInputs, hidden: torch.Tensor,
               out: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        out = out or ModelRunnerOutput(inp.sample_req_ids, [])
        if inp.sample_req_ids and inp.num_drafts is not None:
            self._verify(inp, hidden, out)
        elif inp.sample_req_ids:
            logits = self.logits(hidden[inp.logits_indices])
            md = self.sampling.build(inp.sample_req_ids, inp.sample_out_counts, inp.grammar,
                                     forced=inp.forced)
            ids = self._sampled(inp, logits, md, self._logprob_nums(inp, md), out)
            if self.proposer is not None:
                self._propose(inp, hidden, out, ids[:, None], None)
        self._prompt_logprobs(inp, hidden, out)
        return out

    def _begin_sample(self, inp: StepInputs, hidden: torch.Tensor,
                      out: ModelRunnerOutput) -> Callable[[], None]:
        """A plain sampling (no drafts, no proposer) up to its grammar masks: logits, metadata
        (everything read from the request states), prompt logprobs; the rest, returned, needs
        only the masks."""
        logits = self.logits(hidden[inp.logits_indices])
        md = self.sampling.build(inp.sample_req_ids, inp.sample_out_counts, inp.grammar,
                                 defer_bits=True, forced=inp.forced)
        nums = self._logprob_nums(inp, md)
        self._prompt_logprobs(inp, hidden, out)

        def finish() -> None:
            md.grammar = (md.grammar[0], self.sampling.bits_to_device(inp.grammar[1]()))
            self._sampled(inp, logits, md, nums, out)
        return finish

    def _logprob_nums(self, inp: StepInputs, md) -> list | None:
        if md.max_num_logprobs is None:
            return None
        return [self.reqs[r].sampling_params.logprobs for r in inp.sample_req_ids]

    def _sampled(self, inp: StepInputs, logits: torch.Tensor, md, nums: list | None,
                 out: ModelRunnerOutput) -> torch.Tensor:
        ids, raw_lp = sample(logits, md)
        self.prev_sampled = ids
        self.prev_index = {rid: i for i, rid in enumerate(inp.sample_req_ids)}
        out.defer(ids)
        if raw_lp is not None:
            entries = gather_logprobs(raw_lp, ids, [n or 0 for n in nums])
            out.logprobs = [[e] if n is not None else None for e, n in zip(entries, nums)]
        return ids

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        for rid, first_row, count, first_pos in inp.prompt_lp:
            st = self.reqs[rid]
            logits = self.model.compute_logits(hidden[first_row:first_row + count]).float()
            targets = torch.from_numpy(self.batch.token_ids[st.row, first_pos:first_pos + count]).to(self.device)
            out.prompt_logprobs[rid] = gather_logprobs(
                logits.log_softmax(-1), targets, [st.sampling_params.prompt_logprobs] * count)

    # ---- speculative decoding (runtime/spec_decode.py, runtime/rejection_sampler.py) ---------
    def _verify(self, inp: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Score every draft in one pass of sampling: a row per draft and one more per request,
        each with the sampling state (outputs so far) it would have had without speculation."""
        from .rejection_sampler import SpecBatch, rejection_sample
        ns = inp.num_drafts
        logits = self.logits(hidden[inp.logits_indices])
        rids = np.repeat(np.array(inp.sample_req_ids, dtype=object), ns + 1).tolist()
        first = np.concatenate([[0], np.cumsum(ns + 1)[:-1]])
        offset = np.arange(len(rids)) - np.repeat(first, ns + 1)  # draft index of each row
        md = self.sampling.build(rids, np.repeat(inp.sample_out_counts, ns + 1) + offset,
                                 inp.grammar, extra_tokens=offset, forced=inp.forced)
        probs, greedy = target_probs(logits, md)
        K = int(ns.max())
        rows = np.array([self.reqs[r].row for r in inp.sample_req_ids], dtype=np.int64)
        j = np.arange(K)
        cols = np.minimum(inp.base_pos[:, None] + j[None, :], self.batch.token_ids.shape[1] - 1)
        draft_ids = np.where(j[None, :] < ns[:, None], self.batch.token_ids[rows[:, None], cols], 0)
        dev, put = self.device, self.batch.stage  # (pinned: a pageable copy waits for the forward)
        spec = SpecBatch(put(draft_ids), put(ns.astype(np.int64)), put(first.astype(np.int64)))
        gens = None
        if md.generators:
            gens = {int(np.searchsorted(first, r, side="right") - 1): g for r, g in md.generators.items()}
        tokens, num_acc = rejection_sample(probs, greedy, md.temperature[spec.row_start], spec, gens)
        # the last emitted token feeds the placeholders of requests that ran ahead (they had
        # no drafts: it is their only token)
        self.prev_sampled = tokens.gather(1, num_acc[:, None])[:, 0]
        self.prev_index = {rid: i for i, rid in enumerate(inp.sample_req_ids)}
        ctx = self._propose(inp, hidden, out, tokens, num_acc) if self.proposer is not None else None
        # one device-to-host copy a verify step (the proposer's, if it made one)
        toks, acc = (ctx or ProposeContext.of(tokens, num_acc)).host()
        out.sampled_token_ids = [t[a] for t, a in zip(toks, acc)]
        out.accepted = [t[:a] for t, a in zip(toks, acc)]
        if md.max_num_logprobs is not None:  # an entry per emitted token, from its own row
            nums = [self.reqs[r].sampling_params.logprobs for r in inp.sample_req_ids]
            want = [i for i, n in enumerate(nums) if n is not None]
            emitted = [(int(first[i]) + j, toks[i][j], nums[i]) for i in want for j in range(acc[i] + 1)]
            r, t, n = zip(*emitted)
            raw_lp = logits[torch.tensor(r, device=dev)].float().log_softmax(-1)
            entries = iter(gather_logprobs(raw_lp, torch.tensor(t, device=dev), list(n)))
            out.logprobs = [[next(entries) for _ in range(a + 1)] if n is not None else None
                            for n, a in zip(nums, acc)]

    def _propose(self, inp: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput,
                 tokens: torch.Tensor, num_acc: torch.Tensor | None) -> ProposeContext | None:
        """num_acc None: a plain sampling step (nothing accepted, one token each). Returns the
        context (its `host()` copy, if one was made, serves the caller too), None if idle."""
        # requests paused by the backoff (or whose proposer state still lags) get no work: None
        active = self.proposer.step_active[inp.sample_index]
        if not active.any():  # (most steps of drafts that miss: nothing to do on the host)
            return None
        if num_acc is None:
            num_acc = torch.zeros_like(tokens[:, 0])
        rows = np.array([self.reqs[r].row for r in inp.sample_req_ids], dtype=np.int64)
        ctx = ProposeContext(inp.sample_req_ids, rows, inp.base_pos, tokens, num_acc, hidden,
                             inp.logits_indices, inp.num_drafts)
        last_try = active & inp.pause_on_miss[inp.sample_index]
        if last_try.any():  # (the host needs the accepted counts for the drafts anyway)
            done = last_try & (np.asarray(ctx.host()[1]) == 0)  # pauses now: no proposals
            if done.any():
                self.proposer.finish(ctx.select(np.flatnonzero(done), self.batch.stage))
                active = active & ~done
        if active.all():
            out.draft_token_ids = self.proposer.propose(ctx)
        elif active.any():
            idx = np.flatnonzero(active)
            drafts = iter(self.proposer.propose(ctx.select(idx, self.batch.stage)))
            out.draft_token_ids = [next(drafts) if a else None for a in active]
        return ctx
