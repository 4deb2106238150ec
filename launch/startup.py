"""Process startup: turn the launcher's world into an engine (rank 0) and workers (others)."""
from __future__ import annotations

from typing import Callable

from rankserve.runtime.config import EngineConfig


def make_llm(cfg: EngineConfig, executor=None):
    from rankserve.runtime.llm import LLM
    return LLM(config=cfg, executor=executor)


def run_on_ranks(cfg: EngineConfig, body: Callable) -> int:
    """Single process: build the engine here and run `body(llm)`. Returns the exit code."""
    llm = make_llm(cfg)
    body(llm)
    return 0
