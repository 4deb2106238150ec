"""GPU: ranks started the way plain `srun` starts them (Slurm variables, no MPI) meet through the
job-token rendezvous, pin cuda:<local rank> and give the single-GPU greedy tokens over NCCL.
Run on a machine with 2+ GPUs (the lead's GPU session); skipped otherwise."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import STORIES_EMBEDDED

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

PROMPTS = ["Once upon a time", "Lily and Tom were"]


def _srun_like(rank: int, flags: list[str], job: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    env.update(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
               SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost")
    cmd = [sys.executable, "-m", "rankserve.launch", "generate", str(STORIES_EMBEDDED), *flags,
           "--max-tokens", "16", "--ignore-eos", "--json"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"]])
def test_plain_srun_style_ranks_on_two_gpus(flags):
    from rankserve import LLM, SamplingParams
    procs = [_srun_like(r, flags, job=str(os.getpid())) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    assert "device=cuda:0" in outs[0] and "device=cuda:1" in outs[1], outs
    got = [json.loads(x)["token_ids"] for x in outs[0].splitlines() if x.startswith("{")]
    llm = LLM(str(STORIES_EMBEDDED), gpu_memory_utilization=0.2)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert got == [o.outputs[0].token_ids for o in ref]
