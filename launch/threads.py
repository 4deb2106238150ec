"""Torch CPU threads per rank, from the CPUs the launcher gave this process.

torch starts as many intra-op threads as the machine has cores. With several ranks per node
that oversubscribes the node (plain `srun` without CPU binding), while `mpirun`, which binds each
rank to a core, gets one. The count here follows the launcher's binding: the CPUs in this
process's affinity mask; when that is the whole machine (no binding), the node's cores split
among its ranks; never more than Slurm's `--cpus-per-task`. `OMP_NUM_THREADS` set by the user
wins.
"""
from __future__ import annotations

import os
from typing import Mapping

from .discovery import RankInfo


def rank_threads(info: RankInfo, env: Mapping[str, str], affinity: int, cpu_count: int) -> int | None:
    """Threads for this rank, or None to leave torch's setting alone."""
    if env.get("OMP_NUM_THREADS"):
        return None
    n = affinity
    if affinity >= cpu_count and info.local_world_size > 1:  # not bound: share the node
        n = cpu_count // info.local_world_size
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit():
        n = min(n, int(per_task))
    return max(1, n)


def set_rank_threads(info: RankInfo) -> int:
    """Apply rank_threads to torch; returns the thread count in effect."""
    import torch

    n = rank_threads(info, os.environ, len(os.sched_getaffinity(0)), os.cpu_count() or 1)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
