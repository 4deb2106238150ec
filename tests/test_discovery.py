"""Launcher detection, env scrubbing, device selection and hostlists: pure env logic, no MPI.

The MPI branch of discover() imports mpi4py (which initialises MPI), so it is exercised by the
mpiexec tests in test_mpi_bootstrap.py; here we only check that it is chosen, and that choosing
anything else never imports mpi4py.
"""

import subprocess
import sys

import pytest

from rankserve.launch import bootstrap, discovery
from rankserve.launch.discovery import (RankInfo, detect_launcher, discover, expand_hostlist,
                                        scrub_launcher_env)
from rankserve.runtime.config import select_device

SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_STEP_NODELIST": "gpu[07-08]",
}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
    {"PMI_SIZE": "2", "PMI_RANK": "1"},
    {"PMIX_RANK": "0", **SLURM_STEP},  # srun --mpi=pmix: MPI wins over the Slurm variables
    {"MPI_LOCALNRANKS": "2"},
])
def test_mpi_launchers_detected(env):
    assert detect_launcher(env) == "mpi"


def test_slurm_step_without_mpi():
    info = discover(SLURM_STEP)
    assert info == RankInfo(6, 5, 1, 2, info.host, "slurm")


def test_slurm_outside_a_step_is_single():
    # a batch script or salloc shell has job variables but no step: one process
    env = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    assert discover(env).launcher == "single"


def test_slurm_tasks_per_node_repeat_form():
    env = {**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2",
           "SLURM_STEP_NUM_TASKS": "11"}
    assert discover(env).local_world_size == 3


def test_torchrun():
    info = discover(TORCHRUN)
    assert (info.world_size, info.rank, info.local_rank, info.local_world_size, info.launcher) \
        == (4, 3, 1, 2, "torchrun")


def test_deepspeed_launcher_local_size():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "4"}
    assert discover(env).local_world_size == 4


def test_single():
    assert discover({}) == RankInfo(1, 0, 0, 1, discover({}).host, "single")


def test_forced_launcher_and_bad_value():
    assert discover({"PMIX_RANK": "0", **SLURM_STEP, "RANKSERVE_LAUNCHER": "slurm"}).rank == 5
    with pytest.raises(ValueError, match="RANKSERVE_LAUNCHER"):
        discover({"RANKSERVE_LAUNCHER": "ray"})


def test_non_mpi_paths_never_import_mpi4py():
    code = ("import sys; from rankserve.launch.discovery import discover\n"
            f"for env in [{{}}, {SLURM_STEP!r}, {TORCHRUN!r}]: discover(env)\n"
            "import rankserve.launch.bootstrap, rankserve.launch.failure\n"
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_scrub_launcher_env():
    env = {"PATH": "/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1", "PMI_RANK": "0",
           "PMI_FD": "9", "PMIX_NAMESPACE": "x", "OMPI_COMM_WORLD_SIZE": "2", "HYDRA_CONTROL_FD": "3",
           "MPI_LOCALNRANKS": "2", "SLURM_PROCID": "0", "RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "RANKSERVE_X": "keep"}
    out = scrub_launcher_env(env)
    assert out == {"PATH": "/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1",
                   "RANKSERVE_X": "keep"}
    assert env["PMI_RANK"] == "0"  # input untouched
    assert discover(out).launcher == "single"


# --- select_device precedence ---------------------------------------------------------------

def test_cpu_without_cuda():
    assert select_device(3, None, False, env={"CUDA_VISIBLE_DEVICES": "1"}) == "cpu"
    with pytest.raises(ValueError, match="--device-ids 4,5 was given but no CUDA"):
        select_device(3, [4, 5], False, env={})  # never silently ignored


def test_device_ids_pick_by_local_rank():
    assert select_device(2, [4, 5, 6, 7], True, env={}) == "cuda:6"


def test_device_ids_translate_through_visible_devices():
    assert select_device(1, [4, 6], True, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "cuda:2"
    with pytest.raises(ValueError, match="--device-ids.*not in CUDA_VISIBLE_DEVICES"):
        select_device(0, [1], True, env={"CUDA_VISIBLE_DEVICES": "4,5"})


def test_too_few_device_ids_names_the_flag():
    with pytest.raises(ValueError, match="--device-ids 4,5 lists 2 device"):
        select_device(2, [4, 5], True, env={})


def test_visible_devices_one_per_task_uses_index_0():
    assert select_device(5, None, True, env={"CUDA_VISIBLE_DEVICES": "3"}) == "cuda:0"


def test_visible_devices_whole_node_uses_local_rank():
    assert select_device(2, None, True, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == "cuda:2"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        select_device(4, None, True, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})


def test_default_is_local_rank():
    assert select_device(3, None, True, env={}) == "cuda:3"
    assert select_device(3, [], True, env={}) == "cuda:3"


# --- Slurm hostlists and rendezvous address -------------------------------------------------

@pytest.mark.parametrize("spec,hosts", [
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("a1,b[8-10,12],c", ["a1", "b8", "b9", "b10", "b12", "c"]),
    ("r[1-2]-n[3-4]", ["r1-n3", "r1-n4", "r2-n3", "r2-n4"]),
    ("login", ["login"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_master_env_override():
    assert bootstrap.master_env({**SLURM_STEP, "MASTER_ADDR": "h", "MASTER_PORT": "7"}) == "h:7"
    assert bootstrap.master_env(SLURM_STEP) is None  # srun: rank 0's beacon (test_launch_rendezvous)


def test_single_process_bootstrap_is_a_noop():
    import torch.distributed as dist

    control = bootstrap.init_distributed(discover({}), "cpu", 5)
    assert not dist.is_initialized()
    assert control.bcast({"a": 1}) == {"a": 1} and control.bcast_idle(2) == 2
    assert control.gather("x") == ["x"]
    with pytest.raises(ValueError):
        control.send(1, dest=1)


def test_pack_inline_and_overflow():
    header, rest = bootstrap._pack({"ids": list(range(10))})
    assert rest is None and len(header) == bootstrap.HEADER_BYTES
    header, rest = bootstrap._pack(b"x" * 10000)
    assert rest is not None and bootstrap._header_len(header) == len(rest)


def test_discovery_module_has_no_mpi_state():
    assert discovery._mpi_info is None  # nothing in this process went through the MPI branch


def test_discover_reads_os_environ(monkeypatch):
    for k in list(__import__("os").environ):
        if k in ("RANK", "WORLD_SIZE", "RANKSERVE_LAUNCHER") or detect_launcher({k: "1"}) == "mpi" \
                or k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert discover().rank == 3
