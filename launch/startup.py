"""Process startup: turn the launcher's world into an engine (rank 0) and workers (the rest).

Single process: the engine and its model runner live here (`UniprocExecutor`). Under mpirun,
srun or torchrun: every rank discovers itself, pins its device, joins torch.distributed, builds
its TP/PP context and its model shard; rank 0 then runs `body` (generate, serve, bench) on a
`MultiRankExecutor`, the others loop in `run_worker` until rank 0 says shutdown.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Callable

import torch

from ..runtime.config import EngineConfig

log = logging.getLogger("rankserve.startup")


def make_llm(cfg: EngineConfig, executor=None):
    from ..runtime.llm import LLM
    return LLM(config=cfg, executor=executor)


def start_ranks(cfg: EngineConfig):
    """Discover, check, pin, bootstrap. Returns (info, control, parallel info, device) or None for
    a single process without parallelism. Raises `preflight.LaunchError` before any rendezvous
    when the job cannot work (wrong rank count, missing device, mismatched MPI)."""
    from .discovery import discover, mpi_library
    from .preflight import agree, check_mpi_world, check_world_size, resolve_device
    info = discover()
    check_mpi_world(info, os.environ, mpi_library())
    agree(info, None)  # every rank got this far (one that failed before says so here)
    if info.world_size == 1 and cfg.parallel.total_ranks == 1:
        return None
    check_world_size(info, cfg, os.environ)
    device = resolve_device(info, cfg)
    pc = cfg.parallel
    from .bootstrap import init_distributed
    from .failure import install_failure_handlers
    from ..runtime.parallel import build_parallel_info
    from .threads import set_rank_threads
    threads = set_rank_threads(info)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    control = init_distributed(info, device)
    install_failure_handlers(info, control)
    pi = build_parallel_info(info.rank, info.world_size, pc)
    line = (f"rankserve rank {info.rank}/{info.world_size} host={socket.gethostname()} pid={os.getpid()} "
          f"local_rank={info.local_rank} device={device} threads={threads} "
          f"{f'dp={pi.dp_rank}/{pi.dp_size} ' if pi.dp_size > 1 else ''}tp={pi.tp_rank}/{pi.tp_size} "
          f"pp={pi.pp_rank}/{pi.pp_size} ep={'on' if pi.enable_expert_parallel else 'off'}")
    sys.stdout.write(line + "\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()
    return info, control, pi, torch.device(device)


def run_on_ranks(cfg: EngineConfig, body: Callable[[object], None]) -> int:
    """Run `body(llm)` on rank 0 with an engine spanning every rank. Returns the exit code."""
    if cfg.parallel.data_parallel_size > 1:  # before any rank joins anything: one line, one rank
        from .discovery import discover
        from .preflight import LaunchError
        raise LaunchError("--data-parallel-size > 1 is served by `rankserve serve` only (one engine "
                          "per replica behind its API); generate and the benches run one engine: "
                          "use --tp / --pp, or run one job per replica", report=discover().rank == 0)
    started = start_ranks(cfg)
    if started is None:
        body(make_llm(cfg))
        return 0
    return run_multi_rank(cfg, started, lambda executor: body(make_llm(cfg, executor)))


def run_multi_rank(cfg: EngineConfig, started, driver: Callable[[object], object],
                   replica_driver: Callable[[object], object] | None = None) -> int:
    """Rank 0 runs `driver(executor)`; the others serve as workers until it shuts them down.

    With --data-parallel-size N (runtime/dp.py) every replica's first rank has an executor over
    its replica's ranks: rank 0 runs `driver`, the other replicas' first ranks
    `replica_driver`, and the rest are workers of their replica."""
    from ..runtime.executor import MultiRankExecutor
    from ..runtime.worker import run_worker
    info, control, pi, device = started
    dp = None
    if pi.dp_size > 1:
        assert replica_driver is not None, "run_on_ranks refuses --data-parallel-size > 1"
        from ..runtime.dp import setup_replicas
        control, dp = setup_replicas(cfg, control, pi, info.local_world_size == info.world_size)
    if control.rank != 0:
        return run_worker(cfg, control, pi, device)
    executor = MultiRankExecutor(cfg, control, pi, device, dp)
    try:
        result = driver(executor) if pi.dp_rank == 0 else replica_driver(executor)
    finally:
        executor.shutdown()
    return result if isinstance(result, int) else 0
