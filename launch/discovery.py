"""Rank discovery and device pinning.

`discover()` answers "who am I" from whatever launched the process, in this order:

1. MPI (`mpirun`, `mpiexec`, `srun --mpi=pmix|pmi2`): only when an MPI launcher's variables are
   present is mpi4py imported; rank and size then come from `MPI.COMM_WORLD`, the local rank from
   `COMM_WORLD.Split_type(COMM_TYPE_SHARED)`. Importing mpi4py initialises MPI, so a plain
   single-process run or the API child process (see `scrub_launcher_env`) never does it.
2. Slurm `srun` without MPI: `SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID`, only inside a job
   step (`SLURM_STEP_ID` set); a batch script or an `salloc` shell is a single process.
3. torchrun / the deepspeed launcher: `RANK/WORLD_SIZE/LOCAL_RANK`.
4. A single process.

`RANKSERVE_LAUNCHER=mpi|slurm|torchrun|single` forces one of them (e.g. `slurm` on a cluster
whose default `srun --mpi` plugin sets PMIx variables although you want no MPI).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from ..runtime import envs

log = logging.getLogger(__name__)

LAUNCHERS = ("mpi", "slurm", "torchrun", "single")

# Any of these means an MPI process manager started us (Open MPI/PRRTE, MPICH Hydra, Slurm PMI2,
# PMIx, MVAPICH, Intel MPI's Hydra).
_MPI_VARS = (
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE", "PMI_FD",
)
# Variables an unrelated child process must not inherit, or it would believe it is an MPI or
# Slurm rank (and try to talk to the process manager).
_SCRUB_PREFIXES = (
    "OMPI_", "PMI_", "PMIX_", "PRTE_", "OPAL_", "SLURM_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCAL",
    "MV2_", "I_MPI_", "TORCHELASTIC_",
)
_SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    world_size: int
    rank: int
    local_rank: int  # index among the ranks on this host
    local_world_size: int  # ranks on this host
    host: str
    launcher: str  # one of LAUNCHERS

    @property
    def is_driver(self) -> bool:
        """Rank 0 hosts the engine core and the API process."""
        return self.rank == 0


_mpi_info: RankInfo | None = None  # Split_type is collective: compute it once per process


def discover(env: Mapping[str, str] | None = None) -> RankInfo:
    """Find rank, world size and local rank from the launcher (see the module docstring)."""
    env = os.environ if env is None else env
    launcher = envs.get("RANKSERVE_LAUNCHER", env) or detect_launcher(env)
    if launcher not in LAUNCHERS:
        raise ValueError(f"RANKSERVE_LAUNCHER={launcher!r}; expected one of {LAUNCHERS}")
    host = socket.gethostname()
    if launcher == "mpi":
        return _discover_mpi(host)
    if launcher == "slurm":
        rank = int(env["SLURM_PROCID"])
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        local_world = _slurm_local_world_size(env, world)
        return RankInfo(world, rank, int(env.get("SLURM_LOCALID", 0)), local_world, host, "slurm")
    if launcher == "torchrun":
        world = int(env["WORLD_SIZE"])
        # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE; without either assume
        # one node, the only case where we cannot tell
        local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
        return RankInfo(world, int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), local_world, host,
                        "torchrun")
    return RankInfo(1, 0, 0, 1, host, "single")


def detect_launcher(env: Mapping[str, str]) -> str:
    """Name the launcher from environment variables alone (never touches MPI)."""
    if any(v in env for v in _MPI_VARS):
        return "mpi"
    if ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env:
        return "slurm"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    return "single"


def _discover_mpi(host: str) -> RankInfo:
    global _mpi_info
    if _mpi_info is None:
        try:
            from mpi4py import MPI  # initialises MPI: only here, only under an MPI launcher
        except ImportError as e:
            raise RuntimeError(
                "launched by an MPI launcher (PMI/PMIx/OMPI variables are set) but mpi4py cannot be "
                f"imported ({e}); install mpi4py against your MPI (see slurm/README.md) or set "
                "RANKSERVE_LAUNCHER=slurm to run srun tasks without MPI") from e
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        _mpi_info = RankInfo(world.Get_size(), world.Get_rank(), node.Get_rank(), node.Get_size(),
                             host, "mpi")
        node.Free()
    return _mpi_info


def mpi_library() -> str:
    """First line of MPI.Get_library_version() when MPI is in use here, else ""."""
    if _mpi_info is None:
        return ""
    from mpi4py import MPI
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def _slurm_local_world_size(env: Mapping[str, str], world: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3": tasks on node 0, 1, 2, ...
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return world
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return world
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node_id = int(env.get("SLURM_NODEID", 0))
    return counts[node_id] if node_id < len(counts) else world


def scrub_launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` without MPI/PMI/PMIx/Slurm/Hydra/torchrun rank variables.

    Use it for the API child process (and any helper subprocess): it then discovers itself as a
    single process and never contacts the MPI process manager. CUDA_VISIBLE_DEVICES is kept.
    """
    return {k: v for k, v in env.items()
            if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as "gpu[01-03,07],login1" (no scontrol needed)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts += _expand_one(item)
    return hosts


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        width = len(lo)  # "01-04" keeps its zero padding
        for i in range(int(lo), int(hi or lo) + 1):
            out += [f"{prefix}{i:0{width}d}{tail}" for tail in _expand_one(rest)]
    return out
