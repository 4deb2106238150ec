"""Startup errors of a multi-rank job: checked before the rendezvous, one line, printed once."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from rankserve.launch.discovery import RankInfo
from rankserve.launch.preflight import (LaunchError, check_mpi_world, check_world_size,
                                        launch_command, resolve_device)
from rankserve.runtime.config import EngineConfig

from conftest import STORIES_EMBEDDED

RANKSERVE = [sys.executable, "-m", "rankserve.launch"]
mpi = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")


def _info(world, rank=0, local_world=None, launcher="mpi"):
    return RankInfo(world, rank, rank, local_world or world, "h", launcher)


def _one_error_line(out: str) -> str:
    lines = [x for x in out.splitlines() if "rankserve: error:" in x]
    assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
    return lines[0]


@pytest.mark.parametrize("launcher, env, cmd", [
    ("mpi", {}, "mpirun -np 4"),
    ("slurm", {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}, "srun -n 4"),
    ("mpi", {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "PMI_SIZE": "2"}, "srun -n 4"),  # srun --mpi=pmi2
    ("single", {"SLURM_JOB_ID": "1"}, "srun -n 4"),  # in an sbatch/salloc shell
    ("torchrun", {}, "torchrun --nproc-per-node 4"),
])
def test_launch_command_matches_the_launcher(launcher, env, cmd):
    assert launch_command(launcher, 4, env).startswith(cmd)


def test_world_size_mismatch_reported_by_rank_0_only():
    cfg = EngineConfig.from_kwargs(tensor_parallel_size=4)
    for rank in (0, 1):
        with pytest.raises(LaunchError, match="needs 4 ranks but the job has 2") as e:
            check_world_size(_info(2, rank), cfg, {})
        assert e.value.report == (rank == 0)


def test_mixed_mpi_builds_named():
    env = {"PMI_SIZE": "2", "PMI_RANK": "1"}
    with pytest.raises(LaunchError, match=r"PMI_SIZE=2\) but MPI sees a world of 1") as e:
        check_mpi_world(_info(1), env, "Open MPI v4.1")
    assert not e.value.report  # PMI rank 1 stays quiet
    check_mpi_world(_info(2), env)  # a matching world passes


def test_too_few_device_ids_checked_on_every_rank_even_without_cuda():
    cfg = EngineConfig.from_kwargs(device_ids="0")
    with pytest.raises(LaunchError, match="lists 1 device.* but 2 ranks run on h") as e:
        resolve_device(_info(2, rank=1, local_world=2), cfg)
    assert not e.value.report  # rank 0 fails the same way and says it


@mpi
def test_rank_count_mismatch_under_mpiexec_is_one_line():
    r = subprocess.run(["mpiexec", "-n", "2", *RANKSERVE, "generate", str(STORIES_EMBEDDED), "--tp", "4",
                        "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "mpirun -np 4" in _one_error_line(r.stdout + r.stderr)


@mpi
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_under_mpiexec_fails_instead_of_falling_back():
    r = subprocess.run(["mpiexec", "-n", "2", *RANKSERVE, "generate", str(STORIES_EMBEDDED), "--tp", "2",
                        "--device", "cuda", "--prompt", "x"], capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "device=cpu" not in out
    assert "--device cuda" in _one_error_line(out)


def test_mixed_mpi_build_message_in_a_real_process():
    # Open MPI's launcher variables around an mpi4py built for MPICH: MPI sees a world of 1
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    r = subprocess.run([*RANKSERVE, "generate", str(STORIES_EMBEDDED), "--tp", "2", "--prompt", "x"],
                       capture_output=True, text=True, timeout=120, env=env)
    if "No module named 'mpi4py'" in r.stderr:
        pytest.skip("mpi4py not installed")
    assert r.returncode == 2
    assert "OMPI_COMM_WORLD_SIZE=2) but MPI sees a world of 1" in _one_error_line(r.stderr)


@pytest.mark.parametrize("kw", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_offline_llm_with_tp_in_one_process_is_refused(kw):
    """vLLM's `LLM(model, tensor_parallel_size=2)` in a plain script (or in every rank of
    `mpirun -np 2 python script.py`) ran one full engine per process, silently at TP 1: refused,
    naming the flag and the launch that runs it."""
    from rankserve import LLM
    from rankserve.runtime.config import ConfigError
    with pytest.raises(ConfigError, match=r"needs 2 ranks.*one process.*mpirun -np 2 rankserve"):
        LLM(str(STORIES_EMBEDDED), **kw)
