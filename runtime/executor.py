"""Executors run a step plan on every rank of the model and return the sampled tokens.

`UniprocExecutor` drives one ModelRunner in this process. `MultiRankExecutor` (rank 0 of an
mpirun/srun job) broadcasts each plan over the control channel to the workers of every rank and
runs its own share; the engine core cannot tell them apart. With data parallelism each replica's
first rank has a `MultiRankExecutor` over its replica's ranks (runtime/dp.py), carried in `dp`.
"""
from __future__ import annotations

import logging
import time

import torch

from ..models.parallel import ParallelInfo
from .config import ConfigError, EngineConfig
from .kv_offload import num_host_blocks
from .model_runner import ModelRunner
from .model_runner import ModelRunnerOutput
from .rpc import RunnerRPC, raise_errors
from .scheduler import SchedulerOutput

log = logging.getLogger("rankserve.executor")


class UniprocExecutor:
    def __init__(self, cfg: EngineConfig, device: torch.device | None = None,
                 pi: ParallelInfo | None = None):
        if cfg.parallel.data_parallel_size > 1:
            raise ConfigError(
                f"--data-parallel-size {cfg.parallel.data_parallel_size} (data_parallel_size) runs "
                "one engine per replica on ranks of their own: serve it with `mpirun -np N rankserve "
                "serve --data-parallel-size ...` (N = TP × PP × DP); the offline LLM, generate and "
                "the benches run one engine")
        n = cfg.parallel.world_size
        if pi is None and n > 1:  # never a silent TP 1: the other ranks come from the launcher
            raise ConfigError(
                f"tensor_parallel_size {cfg.parallel.tensor_parallel_size} × pipeline_parallel_size "
                f"{cfg.parallel.pipeline_parallel_size} needs {n} ranks, but the offline LLM runs in "
                f"one process: launch `mpirun -np {n} rankserve generate|serve|bench ... --tp/--pp` "
                "(or srun -n / torchrun), where rank 0 drives the engine and the others are its workers")
        if device is None:
            device = torch.device(cfg.device.resolve(0))
            if device.type == "cuda":
                torch.cuda.set_device(device)
        self.device = device
        self.cfg = cfg
        self.runner = ModelRunner(cfg, pi or ParallelInfo(), self.device)
        self.rpc = RunnerRPC(self.runner, 0)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.num_host_blocks = 0
        self.host_block_bytes = 0  # KV bytes of one block (the preemption cost model)
        self.world_size = 1

    @property
    def timings(self) -> dict[str, float]:
        return self.runner.timings

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        gib = self.cfg.offload.kv_offload_size
        if gib > 0:  # the host tier (runtime/kv_offload.py)
            self.host_block_bytes = self.rpc.rpc_host_kv_bytes_per_block()
            self.num_host_blocks = num_host_blocks(gib, self.host_block_bytes)
            self.rpc.rpc_init_host_kv(self.num_host_blocks)
        self.runner.compile()

    def check_lora(self, path: str) -> None:
        """ValueError if the LoRA adapter at `path` does not fit this model."""
        self.runner.lora.check(path)

    def collective_rpc(self, method: str, *args) -> list:
        """An admin call (runtime/rpc.py) on the runner; [its result]."""
        return raise_errors([self.rpc.call(method, args)])

    def profile(self, action: str, tag: str, in_flight: int = 0) -> list[str | None]:
        """Start or stop the profiler (runtime/profiler.py); [the trace path] on stop."""
        return raise_errors([self.rpc.call("profile", (action, tag))])

    max_in_flight = 1

    def submit(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def collect(self, handle: ModelRunnerOutput) -> ModelRunnerOutput:
        return handle.resolve()

    def shutdown(self) -> None:
        pass


class MultiRankExecutor:
    """Rank 0's executor; `control` is the launcher's control channel (MPI or gloo)."""

    def __init__(self, cfg: EngineConfig, control, pi: ParallelInfo, device: torch.device,
                 dp=None):
        from .worker import Worker
        self.control = control
        self.dp = dp  # runtime.dp.DataParallelContext when this engine is one of several replicas
        self.device = device
        self.worker = Worker(cfg, control, pi, device)
        self.max_model_len = self.worker.runner.max_model_len
        self.vocab_size = self.worker.runner.vocab_size
        self.world_size = control.world_size
        self._num_blocks: int | None = None
        self._closed = False

    @property
    def timings(self) -> dict[str, float]:
        return self.worker.runner.timings

    def determine_num_blocks(self) -> int:
        self._num_blocks = self.worker.init_cache(None)
        return self._num_blocks

    def initialize(self, num_blocks: int) -> None:
        assert num_blocks == self._num_blocks  # agreed collectively in determine_num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.worker.num_host_blocks

    @property
    def host_block_bytes(self) -> int:
        return self.worker.host_block_bytes

    def check_lora(self, path: str) -> None:
        """ValueError if the LoRA adapter at `path` does not fit this model (checked against
        rank 0's layers: every rank holds the same full shapes)."""
        self.worker.runner.lora.check(path)

    def collective_rpc(self, method: str, *args) -> list:
        """An admin call (runtime/rpc.py) on every rank, broadcast like a step plan; the
        results in rank order, or the first rank's error raised here."""
        self.control.bcast_idle(("rpc", (method, args)))
        return raise_errors(self.worker.collective_rpc(method, args))

    def profile(self, action: str, tag: str, in_flight: int = 0) -> list[str | None]:
        """Start or stop the profiler on every rank (runtime/profiler.py), between the same two
        steps while `in_flight` steps are still running; on stop, every rank's trace path once
        all are written."""
        self.control.bcast_idle(("profile", (action, tag, in_flight)))
        return raise_errors(self.worker.profile(action, tag, in_flight))

    @property
    def max_in_flight(self) -> int:
        return self.worker.pi.pp_size  # one step per pipeline stage

    def submit(self, plan: SchedulerOutput):
        t0 = time.perf_counter()
        self.control.bcast_idle(("step", plan))  # the channel logs the plan's size at debug level
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step plan (%d requests) broadcast in %.3f ms", len(plan.num_scheduled_tokens),
                      (time.perf_counter() - t0) * 1e3)
        return self.worker.step(plan)  # rank 0's share; the result itself may come later

    def collect(self, handle) -> ModelRunnerOutput:
        return self.worker.collect(handle).resolve()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.control.bcast_idle(("shutdown", None))
