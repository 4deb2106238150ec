"""Executors run a step plan on every rank of the model and return the sampled tokens.

`UniprocExecutor` drives one ModelRunner in this process. The MPI executor (runtime/mpi_executor.py)
broadcasts the plan to all ranks; the engine core cannot tell them apart.
"""
from __future__ import annotations

import logging

import torch

from rankserve.models.layers import ParallelInfo
from rankserve.runtime.config import EngineConfig
from rankserve.runtime.model_runner import ModelRunner
from rankserve.runtime.scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("rankserve.executor")


def resolve_device(cfg: EngineConfig, local_index: int = 0) -> torch.device:
    kind = cfg.device.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA device is available")
        torch.cuda.set_device(local_index)
        return torch.device("cuda", local_index)
    return torch.device("cpu")


class UniprocExecutor:
    def __init__(self, cfg: EngineConfig, device: torch.device | None = None,
                 pi: ParallelInfo | None = None):
        self.device = device or resolve_device(cfg)
        self.runner = ModelRunner(cfg, pi or ParallelInfo(), self.device)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size

    @property
    def timings(self) -> dict[str, float]:
        return self.runner.timings

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.compile()

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        pass
