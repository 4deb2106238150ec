"""EngineCore: the loop that drains inputs, schedules, executes and updates.

The same object serves the offline `LLM` (in-process) and the server (driven by
`runtime/serve/engine_proc.py` over ZMQ).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from .config import EngineConfig
from .messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from .request import Request
from .scheduler import Scheduler, SchedulerOutput
from .structured_output import StructuredOutputManager

log = logging.getLogger("rankserve.engine")


class EngineCore:
    def __init__(self, cfg: EngineConfig, executor):
        self.cfg = cfg
        self.executor = executor
        log.info("%s", cfg.summary())
        num_blocks = executor.determine_num_blocks()
        cfg.check_kv_capacity(num_blocks, executor.max_model_len)
        executor.initialize(num_blocks)
        self.timings = dict(executor.timings)  # startup phases in seconds
        self.max_model_len = executor.max_model_len
        self.vocab_size = executor.vocab_size
        self.num_blocks = num_blocks
        use_async = cfg.scheduler.async_scheduling
        if use_async is None:
            use_async = (getattr(executor, "device", None) is not None
                         and executor.device.type == "cuda" and cfg.parallel.pipeline_parallel_size == 1)
        # grammars compile in its threads; the tokenizer is loaded on first use
        self.structured = StructuredOutputManager(cfg.model.tokenizer or cfg.model.model,
                                                  cfg.model.model, self.vocab_size)
        self.scheduler = Scheduler(cfg.scheduler, cfg.cache, num_blocks, self.max_model_len,
                                   async_scheduling=use_async, structured=self.structured)
        self.scheduler.results_in_flight = lambda: [h for _, h in self.in_flight]
        # steps kept in flight: one per pipeline stage, or two to overlap host and device work
        self.depth = max(executor.max_in_flight, 2 if use_async else 1)
        self.in_flight: collections.deque = collections.deque()  # (plan, executor handle)
        # observers of every plan that runs a forward, called before it is submitted (benchmarks)
        self.step_hooks: list[Callable[[SchedulerOutput], None]] = []
        bs = cfg.cache.block_size
        log.info("KV cache: %d blocks of %d tokens = %d tokens; max concurrency %.1f requests "
                 "of max_model_len %d", num_blocks, bs, num_blocks * bs,
                 num_blocks * bs / self.max_model_len, self.max_model_len)
        log.info("startup: %s (total %.1f s)", ", ".join(
            f"{k} {v:.1f} s" for k, v in self.timings.items()), sum(self.timings.values()))

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
        sp = req.sampling_params
        sp.validate(self.vocab_size)  # ids out of range would crash the sampler
        if sp.structured_outputs is not None:
            self.structured.validate(sp.structured_outputs)  # parse only: compiling comes later
        capacity = self.num_blocks * self.cfg.cache.block_size
        if n + 1 > capacity:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({capacity})")
        if not self.cfg.scheduler.enable_chunked_prefill and n > self.cfg.scheduler.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than --max-num-batched-tokens "
                             f"({self.cfg.scheduler.max_num_batched_tokens}) with chunked prefill off")

    def add_request(self, req: EngineCoreRequest) -> None:
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
        if len(self.in_flight) < self.depth:
            plan = self.scheduler.schedule()
            if not plan.is_empty:
                for hook in self.step_hooks:
                    hook(plan)
                self.in_flight.append((plan, self.executor.submit(plan)))
                if len(self.in_flight) < self.depth:
                    return EngineCoreOutputs(timestamp=time.time())
        if not self.in_flight:
            return EngineCoreOutputs(outputs=self.scheduler.take_error_outputs(),
                                     stats=self.scheduler.stats(), timestamp=time.time())
        plan, handle = self.in_flight.popleft()
        return self.scheduler.update(plan, self.executor.collect(handle))

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
