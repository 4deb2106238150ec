"""Per-rank torch threads from the launcher's CPU binding (launch/threads.py)."""
import pytest

from rankserve.launch.discovery import RankInfo
from rankserve.launch.threads import rank_threads


def _info(local_world):
    return RankInfo(local_world, 0, 0, local_world, "h", "slurm")


@pytest.mark.parametrize("local_world, env, affinity, cpus, want", [
    (4, {}, 64, 64, 16),                               # srun without binding: share the node
    (4, {"SLURM_CPUS_PER_TASK": "8"}, 64, 64, 8),      # ... capped at --cpus-per-task
    (2, {}, 1, 64, 1),                                 # mpirun binds to a core: one
    (2, {}, 6, 64, 6),                                 # srun --cpu-bind / cgroup: the task's CPUs
    (8, {}, 4, 4, 1),                                  # more ranks than cores: at least one
    (2, {"OMP_NUM_THREADS": "3"}, 64, 64, None),       # the user's choice wins
])
def test_rank_threads(local_world, env, affinity, cpus, want):
    assert rank_threads(_info(local_world), env, affinity, cpus) == want
