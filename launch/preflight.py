"""Checks every rank makes before the rendezvous, reported once in one line.

A wrong rank count, a device that is not there or an mpi4py built for another MPI would
otherwise surface after the rendezvous (or hang in it) as a traceback on every rank. Each check
here gives the same answer on every rank, so all ranks exit with status 2 and only rank 0 (the
rank the launcher calls 0, even when MPI disagrees) prints `rankserve: error: ...`.
"""
from __future__ import annotations

import os
from typing import Mapping

from ..runtime.config import ConfigError, EngineConfig
from .discovery import RankInfo

EXIT_CODE = 2


class LaunchError(Exception):
    """A startup error of the whole job: `report` is true on the one rank that prints it."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


_agreed = False  # this rank has been through `agree`


def agree(info: RankInfo, error: str | None) -> None:
    """Before any rendezvous: every rank says whether its start failed. Collective under MPI.

    start_ranks calls it with None; a rank whose command line failed before that (a model
    directory missing on its node, a cache dir it cannot write) calls it from the CLI's error
    handler instead of exiting, so the other ranks never wait for it in MPI_Init or the
    rendezvous. Raises one LaunchError on every rank, printed by rank 0, naming the rank.
    Under plain srun the rendezvous itself carries the failure (bootstrap.slurm_startup_failure)."""
    global _agreed
    if _agreed or info.world_size == 1:
        return
    if info.launcher == "slurm" and error is not None:
        from .bootstrap import master_env, slurm_startup_failure
        if not master_env(os.environ):
            _agreed = True
            raise slurm_startup_failure(info, error)
    if info.launcher != "mpi":
        return
    _agreed = True
    from mpi4py import MPI
    failed = [(r, host, e) for r, (host, e) in
              enumerate(MPI.COMM_WORLD.allgather((info.host, error))) if e is not None]
    if failed:
        raise job_failed(failed, info)


def met() -> None:
    """The ranks have met without MPI (plain srun's rendezvous): a later failure of a rank is
    the failure handlers' (launch/failure.py), not a startup agreement's."""
    global _agreed
    _agreed = True


def job_failed(failed: list[tuple[int, str, str]], info: RankInfo,
               report: bool | None = None) -> LaunchError:
    """The LaunchError of a start that failed on the ranks `failed` ((rank, host, error), in
    rank order), once every rank knows (by default rank 0 prints it): the error, with the first
    failing rank's name unless every rank failed alike."""
    global _agreed
    _agreed = True
    rank, host, msg = failed[0]
    if len(failed) < info.world_size or len({e for *_, e in failed}) > 1:
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        msg = f"rank {rank} on {host}{more}: {msg}"
    return LaunchError(msg, report=info.rank == 0 if report is None else report)


def launch_command(launcher: str, n: int, env: Mapping[str, str]) -> str:
    """How to start n ranks with the launcher this job came from."""
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env  # srun, with or without MPI
    if in_step or (launcher == "single" and "SLURM_JOB_ID" in env):  # or an sbatch/salloc shell
        return f"srun -n {n} rankserve ..."
    if launcher == "torchrun":
        return f"torchrun --nproc-per-node {n} -m rankserve.launch ..."
    return f"mpirun -np {n} rankserve ..."


def parallel_layout(cfg: EngineConfig) -> str:
    pc = cfg.parallel
    parts = [f"--tensor-parallel-size {pc.tensor_parallel_size}",
             f"--pipeline-parallel-size {pc.pipeline_parallel_size}"]
    dp = pc.data_parallel_size
    if dp > 1:
        parts.insert(0, f"--data-parallel-size {dp}")
    return " × ".join(parts)


def check_world_size(info: RankInfo, cfg: EngineConfig, env: Mapping[str, str]) -> None:
    need = cfg.parallel.total_ranks  # every data-parallel replica's ranks
    if need == info.world_size:
        return
    raise LaunchError(
        f"{parallel_layout(cfg)} needs {need} rank{'s' if need > 1 else ''} but the job has "
        f"{info.world_size}; "
        f"launch with `{launch_command(info.launcher, need, env)}`", report=info.rank == 0)


# what the launcher says the world size is, per MPI family
_LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE",
                  "SLURM_STEP_NUM_TASKS")
_LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK",
                  "SLURM_PROCID")


def check_mpi_world(info: RankInfo, env: Mapping[str, str], library: str = "") -> None:
    """mpi4py built for another MPI than the launcher sees a world of 1 in every process."""
    if info.launcher != "mpi" or info.world_size != 1:
        return
    for name in _LAUNCHER_SIZE:
        if env.get(name, "").isdigit() and int(env[name]) > 1:
            rank = next((env[r] for r in _LAUNCHER_RANK if env.get(r, "").isdigit()), "0")
            raise LaunchError(
                f"the launcher started {env[name]} ranks ({name}={env[name]}) but MPI sees a world "
                f"of 1: mpi4py is built for another MPI than the launcher ({library or 'unknown'}). "
                "Use that MPI's own mpirun/mpiexec, rebuild mpi4py against the launcher's MPI "
                "(slurm/README.md), or under srun use `srun --mpi=none` (no MPI needed)",
                report=rank == "0")


def resolve_device(info: RankInfo, cfg: EngineConfig) -> str:
    """This rank's device; every rank checks `--device-ids` against the ranks on its node."""
    ids = cfg.device.ids
    try:
        if ids and len(ids) < info.local_world_size:
            raise ConfigError(
                f"--device-ids {cfg.device.device_ids} lists {len(ids)} device(s) but "
                f"{info.local_world_size} ranks run on {info.host}; give one id per rank on the node")
        return cfg.device.resolve(info.local_rank)
    except ConfigError as e:
        raise LaunchError(str(e), report=info.rank == 0 or not _fails(cfg)) from None


def _fails(cfg: EngineConfig) -> bool:
    """Would rank 0 (local rank 0) fail the same way? If not, the failing rank reports."""
    try:
        cfg.device.resolve(0)
        return False
    except ConfigError:
        return True


def report(e: LaunchError) -> int:
    if e.report:
        os.write(2, f"rankserve: error: {e}\n".encode())
    return EXIT_CODE
