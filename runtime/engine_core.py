"""EngineCore: the loop that drains inputs, schedules, executes and updates.

The same object serves the offline `LLM` (in-process) and the server (driven by
`runtime/serve/engine_proc.py` over ZMQ).
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import logging
import os
import time
from typing import Callable

from .config import EngineConfig
from .messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from .request import Request
from ..models.llama import kv_sliding_window
from ..models.config_queries import has_recurrent_state
from ..models.loader import load_hf_config
from .scheduler import Scheduler, SchedulerOutput
from .preemption import build_cost_model
from .spec_decode import lookahead_slots
from .startup_clock import account, format_account
from .structured_output import StructuredOutputManager
from .weight_update import quant_layout

log = logging.getLogger("rankserve.engine")


class EngineSleepingError(RuntimeError):
    """A request arrived while the engine sleeps: refused, not queued (the server answers 503)."""


class EngineBusyError(RuntimeError):
    """An admin call (sleep, weight update) while requests run or wait (the server answers 409)."""


def freeze_gc_heap() -> None:
    """For a process that serves one engine for its whole life (the server's engine, a worker
    rank): what start-up left (torch, the model, compiled graphs: hundreds of thousands of
    objects) leaves the collector's sight, so that no full collection walks it again in the
    middle of a step (a pause of ~0.1-0.3 s: an ITL spike for every stream). vLLM's engine does
    the same. Not for the LLM class: an engine dropped in a frozen heap would keep its cycles.
    Unfrozen at exit: objects still frozen at interpreter teardown are never freed, which
    extension modules report (Triton's: "nanobind: leaked N instances" and a page of types)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # (once, however often it is called)
    atexit.register(gc.unfreeze)


class EngineCore:
    def __init__(self, cfg: EngineConfig, executor):
        self.cfg = cfg
        self.executor = executor
        log.info("%s", cfg.summary())
        hf_config = load_hf_config(cfg.model.model, cfg.compilation.cache_dir)
        # the quant_method of a checkpoint that stores quantized weights (not one quantized at
        # load time): weight updates from a trainer cannot replace them
        self._quantized_in_checkpoint = quant_layout(hf_config).get("quant_method")
        self._ckpt_shapes: dict | None = None  # (_checkpoint_shapes)
        recurrent = has_recurrent_state(hf_config)
        if recurrent:  # refused before the KV cache, host tier and CUDA graphs are made
            if cfg.offload.kv_offload_size:
                raise ValueError("--kv-offload-size keeps evicted prefix-cache blocks in host memory, "
                                 "and prefix caching is off for models with recurrent (Mamba2) "
                                 "layers: drop it")
            if cfg.spec is not None:
                raise ValueError("--speculative-config does not work with recurrent (Mamba2) layers: "
                                 "their state cannot be rolled back past rejected drafts")
        if cfg.lora.lora_modules:  # adapters that do not fit the model stop the start
            from .config import ConfigError
            from .lora import parse_lora_modules
            for _name, path, _base in parse_lora_modules(cfg.lora.lora_modules):
                try:
                    self.check_lora(path)
                except ValueError as e:
                    raise ConfigError(f"--lora-modules: {e}") from None
        num_blocks = executor.determine_num_blocks()
        window = getattr(executor, "kv_sliding_window", None)  # (test executors set it)
        if window is None:  # every layer windowed alike: out-of-window blocks are released
            window = kv_sliding_window(hf_config)
        if window >= executor.max_model_len:  # nothing ever leaves the window
            window = 0
        cfg.check_kv_capacity(num_blocks, executor.max_model_len, window, lookahead_slots(cfg.spec))
        self.sliding_window = window
        executor.initialize(num_blocks)
        self.timings = dict(executor.timings)  # startup phases in seconds
        self.max_model_len = executor.max_model_len
        self.vocab_size = executor.vocab_size
        self.num_blocks = num_blocks
        use_async = cfg.scheduler.async_scheduling
        if use_async is None:
            use_async = (getattr(executor, "device", None) is not None
                         and executor.device.type == "cuda" and cfg.parallel.pipeline_parallel_size == 1)
        if cfg.spec is not None:  # the next step depends on how many drafts this one accepted
            log.info("speculative decoding (%s, %d tokens)%s", cfg.spec.method,
                     cfg.spec.num_speculative_tokens, ": only requests that pause drafting run "
                     "ahead (async scheduling)" if use_async else "")
        # grammars compile in its threads; the tokenizer is loaded on first use
        self.structured = StructuredOutputManager(cfg.model.tokenizer or cfg.model.model,
                                                  cfg.model.model, self.vocab_size,
                                                  trust_remote_code=cfg.model.trust_remote_code)
        self.num_host_blocks = getattr(executor, "num_host_blocks", 0)
        swap_cost = None  # preemption with the host tier: swap or recompute (runtime/preemption.py)
        block_bytes = getattr(executor, "host_block_bytes", 0)  # (test executors: none)
        if self.num_host_blocks and block_bytes and cfg.scheduler.preemption_mode is None:
            swap_cost = build_cost_model(hf_config, cfg.cache.block_size, block_bytes, executor.device)
            log.info("%s", swap_cost.describe())
        cache_cfg = cfg.cache
        if recurrent and cfg.cache.enable_prefix_caching:
            # a prefix hit would skip tokens whose recurrent state was never computed; states
            # checkpointed at block boundaries would allow it (not done yet)
            log.info("prefix caching off: the model has recurrent (Mamba2) layers")
            cache_cfg = dataclasses.replace(cache_cfg, enable_prefix_caching=False)
        self.scheduler = Scheduler(cfg.scheduler, cache_cfg, num_blocks, self.max_model_len,
                                   async_scheduling=use_async, structured=self.structured,
                                   num_host_blocks=self.num_host_blocks,
                                   max_loras=cfg.lora.max_loras if cfg.lora.enable_lora else 0,
                                   sliding_window=window, spec_lookahead=lookahead_slots(cfg.spec),
                                   spec_enabled=cfg.spec is not None, swap_cost=swap_cost,
                                   spec_long_pause=cfg.spec is not None and cfg.spec.method != "ngram")
        self.scheduler.results_in_flight = lambda: [h for _, h in self.in_flight]
        self._lora_ranks: dict[tuple[int, str], int] = {}  # adapters seen: (id, path) → rank
        self._lora_ids: dict[int, tuple[str, str]] = {}  # adapters seen: id → (name, path)
        self.asleep: set[str] = set()  # sleep mode: the tags (weights, kv_cache) now asleep
        self.sleep_level = 0
        # steps kept in flight: one per pipeline stage, or two to overlap host and device work
        self.depth = max(executor.max_in_flight, 2 if use_async else 1)
        self.in_flight: collections.deque = collections.deque()  # (plan, executor handle)
        self.profile_tag: str | None = None  # while profiling: the traces' name
        # observers of every plan that runs a forward, called before it is submitted (benchmarks)
        self.step_hooks: list[Callable[[SchedulerOutput], None]] = []
        self.last_phases = (0.0, 0.0, 0.0, 0.0)  # step(): schedule, submit, collect, update (s)
        bs = cfg.cache.block_size
        # blocks one decoding request of max_model_len holds (a window: its live blocks only)
        per_req = -(-self.max_model_len // bs)
        if window:
            per_req = min(per_req, -(-(window - 1) // bs) + 1)
        concurrency = self.scheduler.kv.num_blocks / per_req
        log.info("KV cache: %d blocks of %d tokens = %d tokens; max concurrency %.1f requests "
                 "of max_model_len %d%s%s", num_blocks, bs, num_blocks * bs,
                 min(concurrency, cfg.scheduler.max_num_seqs) if recurrent else concurrency,
                 self.max_model_len,
                 f" (sliding window {window}: at most {per_req} blocks per decoding request)"
                 if window else "",
                 f" (KV blocks for {concurrency:.1f}; recurrent-state slots for max_num_seqs "
                 f"{cfg.scheduler.max_num_seqs})" if recurrent else "")
        if self.num_host_blocks:
            log.info("host KV tier: %d blocks = %d tokens", self.num_host_blocks, self.num_host_blocks * bs)
        log.info("startup: %s (total %.1f s)", ", ".join(
            f"{k} {v:.1f} s" for k, v in self.timings.items()), sum(self.timings.values()))
        self.startup = account(self.timings)  # process start → ready, phase by phase
        if self.startup is not None:
            log.info("startup account: %s", format_account(self.startup))

    # ---- input ------------------------------------------------------------------------------
    def validate(self, req: EngineCoreRequest) -> None:
        """Raise ValueError with a client-facing message for requests the engine cannot serve."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but the context length (max_model_len) "
                             f"is {self.max_model_len}; it must leave room for at least one new token")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if req.lora_request is not None:
            self._validate_lora(req.lora_request)
        sp = req.sampling_params
        sp.validate(self.vocab_size, self.cfg.model.max_logprobs)  # (bad ids crash the sampler)
        if sp.structured_outputs is not None:
            self.structured.check(sp.structured_outputs)  # parsed with the compilation, later
        capacity = self.num_blocks * self.cfg.cache.block_size
        if n + 1 > capacity and not self.sliding_window:  # (a window holds only its last tokens)
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({capacity})")
        if not self.cfg.scheduler.enable_chunked_prefill and n > self.cfg.scheduler.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than --max-num-batched-tokens "
                             f"({self.cfg.scheduler.max_num_batched_tokens}) with chunked prefill off")

    def _validate_lora(self, lr) -> None:
        from ..models.lora_config import adapter_rank, read_adapter_config, weights_file
        if not self.cfg.lora.enable_lora:
            raise ValueError("this engine serves no LoRA adapters; start it with --enable-lora")
        if lr.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {lr.lora_name!r}: lora_int_id must be >= 1")
        first = self._lora_ids.get(lr.lora_int_id)
        if first is not None and os.path.normpath(first[1]) != os.path.normpath(lr.lora_path):
            # the host cache, the device slots and the prefix blocks all go by the id
            raise ValueError(f"lora_int_id {lr.lora_int_id} is already adapter {first[0]!r} "
                             f"({first[1]}); give {lr.lora_path} an id of its own")
        key = (lr.lora_int_id, lr.lora_path)  # read each adapter's config once, not per request
        if key not in self._lora_ranks:
            r = adapter_rank(read_adapter_config(lr.lora_path))
            if r > self.cfg.lora.max_lora_rank:
                raise ValueError(f"LoRA adapter {lr.lora_name!r} has rank {r} > --max-lora-rank "
                                 f"{self.cfg.lora.max_lora_rank}")
            self.check_lora(lr.lora_path)  # its tensors fit the model's layers
            self._lora_ranks[key] = r
            self._lora_ids.setdefault(lr.lora_int_id, (lr.lora_name, lr.lora_path))
        else:  # its files may be gone since (a step that reads them again would fail)
            read_adapter_config(lr.lora_path)
            weights_file(lr.lora_path)

    def check_lora(self, path: str) -> None:
        """ValueError if the adapter at `path` cannot run on this model (its tensor shapes)."""
        check = getattr(self.executor, "check_lora", None)  # (test executors: none)
        if self.cfg.lora.enable_lora and check is not None:
            check(path)

    def add_request(self, req: EngineCoreRequest) -> None:
        if self.asleep:
            raise EngineSleepingError(
                f"the engine is sleeping (level {self.sleep_level}): wake it up first (POST "
                "/wake_up, LLM.wake_up()); the request was not queued")
        self.validate(req)
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add_request(Request(req, self.max_model_len))

    def abort_requests(self, request_ids) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.in_flight)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule and submit a step; with pipeline parallelism keep up to `pp` steps in
        flight (so no stage idles) and return the outputs of the oldest once the queue is full
        or nothing more can be scheduled."""
        t0 = t1 = t2 = time.perf_counter()
        if len(self.in_flight) < self.depth:
            plan = self.scheduler.schedule()
            t1 = t2 = time.perf_counter()
            if not plan.is_empty:
                for hook in self.step_hooks:
                    hook(plan)
                self.in_flight.append((plan, self.executor.submit(plan)))
                t2 = time.perf_counter()
                if len(self.in_flight) < self.depth:
                    return EngineCoreOutputs(timestamp=time.monotonic())
        if not self.in_flight:
            self.last_phases = (t1 - t0, t2 - t1, 0.0, 0.0)  # (not the last step's: nothing ran)
            return EngineCoreOutputs(outputs=self.scheduler.take_error_outputs(),
                                     stats=self.scheduler.stats(), timestamp=time.monotonic())
        plan, handle = self.in_flight.popleft()
        result = self.executor.collect(handle)
        t3 = time.perf_counter()
        outs = self.scheduler.update(plan, result)
        # host seconds of this call: schedule, submit (inputs + launch), wait for the oldest
        # step's results, update (RANKSERVE_STEP_LOG writes them)
        self.last_phases = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return outs

    # ---- profiling (runtime/profiler.py) -------------------------------------------------------
    def _check_profiler(self) -> None:
        from .profiler import FLAG
        if self.cfg.profiler.params is None:
            raise ValueError(f"profiling is not enabled: start the engine with {FLAG} "
                             "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"DIR\"}'")

    def start_profile(self) -> dict:
        """Start profiling every rank (needs --profiler-config); requests may be running."""
        from .profiler import new_tag
        self._check_profiler()
        if self.profile_tag is not None:
            raise ValueError("the profiler is running already: stop it first (POST /stop_profile)")
        tag = new_tag()
        self.executor.profile("start", tag, len(self.in_flight))
        self.profile_tag = tag
        return {"profiling": True}

    def stop_profile(self) -> dict:
        """Stop it; every rank's trace is written before this returns (their paths)."""
        self._check_profiler()
        if self.profile_tag is None:
            raise ValueError("the profiler is not running: start it first (POST /start_profile)")
        tag, self.profile_tag = self.profile_tag, None
        traces = [t for t in self.executor.profile("stop", tag, len(self.in_flight)) if t]
        return {"profiling": False, "traces": traces}

    # ---- sleep mode and weight updates (runtime/sleep.py, runtime/weight_update.py) ----------
    def _check_idle(self, what: str) -> None:
        """Admin calls need an idle engine: they are refused while requests run or wait (vLLM
        leaves it to the caller to make sure; here it is checked) rather than waiting or
        aborting them."""
        n = len(self.scheduler.requests)
        if self.scheduler.has_work or n:
            raise EngineBusyError(f"cannot {what} while {n} request(s) are running or waiting; "
                                  "let them finish (or abort them) first")
        while self.in_flight:  # steps run ahead (async scheduling) for requests finished since
            self.step()

    def _check_sleep_mode(self) -> None:
        if not self.cfg.offload.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled: start the engine with --enable-sleep-mode "
                             "(LLM(..., enable_sleep_mode=True))")

    def sleep(self, level: int = 1) -> dict:
        """Level 1: weights to pinned host memory, KV cache discarded; level 2: both discarded.
        The device tier of the prefix cache goes with the KV cache; the host tier stays at
        level 1 (its contents are still valid) and goes at level 2. Asleep already: a no-op."""
        self._check_sleep_mode()
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        level = int(level)
        self._check_idle("sleep")
        if self.asleep:
            return {"is_sleeping": True, "level": self.sleep_level}
        offload = self.scheduler.kv.offload
        if level == 1 and offload is not None:  # blocks freed since the last step: copied out
            offload.begin_step()  # now (no later step will), so the host tier keeps them too
            to_host, _, _ = offload.take_copies()
            if to_host:
                self.executor.collective_rpc("copy_kv_to_host", to_host)
        self.scheduler.kv.reset_prefix_cache(host=level == 2)
        ranks = self.executor.collective_rpc("sleep", level)
        self.asleep, self.sleep_level = {"weights", "kv_cache"}, level
        return {"is_sleeping": True, "level": level, "ranks": ranks}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Take the device memory back: `tags` "weights" and/or "kv_cache" (None: both), so
        that new weights can be loaded before the KV cache is allocated. CUDA graphs are
        captured again once both are back."""
        self._check_sleep_mode()
        from .sleep import TAGS
        tags = list(TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
        bad = [t for t in tags if t not in TAGS]
        if bad or not tags:
            raise ValueError(f"tags must be some of {', '.join(TAGS)}, got {tags!r}")
        todo = [t for t in TAGS if t in tags and t in self.asleep]
        ranks = self.executor.collective_rpc("wake_up", todo) if todo else []
        self.asleep -= set(todo)
        if not self.asleep:
            self.sleep_level = 0
        return {"is_sleeping": self.is_sleeping(), "level": self.sleep_level,
                "asleep": sorted(self.asleep), "ranks": ranks}

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, on the device and in the host tier (only while no
        request holds blocks)."""
        return self.scheduler.kv.reset_prefix_cache()

    def _check_weights(self, what: str) -> None:
        self._check_idle(what)
        if "weights" in self.asleep:
            raise ValueError(f"cannot {what}: the weights are asleep; wake them up first "
                             "(POST /wake_up?tags=weights)")

    def update_weights_from_disk(self, model_path: str) -> dict:
        """Load a checkpoint of the same architecture on every rank, in place; the prefix
        cache is reset (both tiers)."""
        from .weight_update import check_checkpoint
        self._check_weights("update the weights")
        check_checkpoint(self.cfg.model.model, model_path, self._checkpoint_shapes())
        try:
            self.executor.collective_rpc("load_weights_from_disk", model_path)
        finally:  # also after a failure part way: some weights may have changed
            self.reset_prefix_cache()
        return {"model_path": model_path}

    def reload_weights(self) -> list:
        """The weights the engine started with, again (its checkpoint, or the same dummy
        weights): after sleep level 2, when no new weights are coming. One None per rank."""
        self._check_weights("reload the weights")
        try:
            results = self.executor.collective_rpc("reload_weights")
        finally:
            self.reset_prefix_cache()
        return results

    COLLECTIVE_RPC = ("reload_weights",)

    def collective_rpc(self, method: str, args=(), kwargs=None) -> list:
        """vLLM's `collective_rpc` for the worker methods its sleep-mode flow calls (level 2,
        then `reload_weights`); rankserve runs no arbitrary worker methods."""
        if method not in self.COLLECTIVE_RPC:
            raise ValueError(f"collective_rpc: method {method!r} is not supported (rankserve "
                             f"runs {', '.join(self.COLLECTIVE_RPC)} only)")
        if args or kwargs:
            raise ValueError(f"collective_rpc: {method} takes no arguments")
        return getattr(self, method)()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> dict:
        """Join a trainer's process group (the trainer is rank 0, engine rank r is
        rank_offset + r): collective with the trainer, which must join meanwhile."""
        ws = getattr(self.executor, "world_size", 1)
        if not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {master_port!r}")
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {rank_offset!r}")
        if not isinstance(world_size, int) or rank_offset + ws > world_size:
            raise ValueError(f"world_size {world_size!r} is too small for rank_offset "
                             f"{rank_offset} + the engine's {ws} rank(s)")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.executor.collective_rpc("init_weights_update_group", master_address, master_port,
                                     rank_offset, world_size, group_name, backend)
        return {"group_name": group_name}

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weight_update_group") -> dict:
        """Receive the named tensors from the trainer (broadcast from its rank 0, in this
        order) and load them on every rank; the prefix cache is reset (both tiers)."""
        from .weight_update import parse_dtype
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, "
                             f"{len(dtypes)}, {len(shapes)})")
        for d in dtypes:
            parse_dtype(d)
        for s in shapes:
            if not isinstance(s, (list, tuple)) or not all(isinstance(x, int) and x >= 0 for x in s):
                raise ValueError(f"a shape must be a list of sizes >= 0, got {s!r}")
        names, dtypes, shapes = list(names), list(dtypes), [list(s) for s in shapes]
        try:  # refused before any tensor is loaded (not a half-updated model)
            self._check_weights("update the weights")
            self._check_trainer_tensors(names, shapes, group_name)
        except (ValueError, EngineBusyError):
            # the announced tensors are received all the same (and dropped), so that the
            # trainer's broadcasts complete instead of waiting out the group's timeout (not
            # while pipeline stages hold steps: those ranks are not free for a call)
            if not self.in_flight or self.executor.max_in_flight == 1:
                try:
                    self.executor.collective_rpc("update_weights_from_distributed", names, dtypes,
                                                 shapes, group_name, False)
                except (ValueError, RuntimeError):  # no such group: nothing is sent to this one
                    pass
            raise
        try:
            unused = self.executor.collective_rpc("update_weights_from_distributed", names, dtypes,
                                                  shapes, group_name)
        finally:  # also after a failure part way: some weights may have changed
            self.reset_prefix_cache()
        nowhere = sorted(set.intersection(*(set(u) for u in unused))) if unused else []
        if nowhere:  # received, but no rank has such a parameter
            raise ValueError(f"no parameter takes these weights: {nowhere[:5]}"
                             f"{' ...' if len(nowhere) > 5 else ''}")
        return {"num_tensors": len(names)}

    def _check_trainer_tensors(self, names: list[str], shapes: list, group_name: str) -> None:
        """ValueError unless every rank's model can take these tensors."""
        if self._quantized_in_checkpoint:
            # a trainer sends 16-bit tensors: the checkpoint's fp8 / 4-bit layers cannot take them
            raise ValueError(f"update_weights_from_distributed: the running model's weights are "
                             f"quantized in its checkpoint ({self._quantized_in_checkpoint}), which a "
                             "trainer's 16-bit tensors cannot replace; start from the 16-bit "
                             "checkpoint with --quantization fp8 (updates are quantized as they "
                             "arrive), or use update_weights_from_disk with a checkpoint in the "
                             "running format")
        from .weight_update import same_shape
        untaken = self.executor.collective_rpc("untaken_weight_names", names, group_name)
        nowhere = sorted(set.intersection(*(set(u) for u in untaken))) if untaken else []
        expected = self._checkpoint_shapes()
        wrong = [f"{n}: shape {s}, the model's checkpoint has {list(expected[n])}"
                 for n, s in zip(names, shapes) if n in expected and not same_shape(s, expected[n])]
        if nowhere or wrong:
            raise ValueError("update_weights_from_distributed: nothing was loaded: " + "; ".join(
                wrong[:5] + ([f"no parameter takes these weights: {nowhere[:5]}"
                              f"{' ...' if len(nowhere) > 5 else ''}"] if nowhere else [])))

    def _checkpoint_shapes(self) -> dict:
        """The shapes of the tensors of the checkpoint the engine started from ({} with dummy
        weights): what a trainer's tensors of those names must have."""
        if self._ckpt_shapes is None:
            from ..models.loader import checkpoint_shapes
            self._ckpt_shapes = {}
            if self.cfg.load.load_format != "dummy":
                try:
                    self._ckpt_shapes = checkpoint_shapes(self.cfg.model.model)
                except Exception:  # noqa: BLE001 - no reference then; the loaders still check
                    pass
        return self._ckpt_shapes

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        self.executor.collective_rpc("destroy_weights_update_group", group_name)
        return {"group_name": group_name}

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
