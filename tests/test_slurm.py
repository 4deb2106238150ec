"""rankserve under a real Slurm 22.05 with two nodes in their own network namespaces.

The cluster comes from tests/slurm_harness.py (root; it installs Debian's Slurm and munge when
missing). Without root or namespaces these tests skip with the reason; with CI=true they fail
instead (and .ci/run checks that they ran). Everything runs as a user would type it: srun,
sbatch, scancel, with the `rankserve` command of this environment.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_harness
from conftest import REPO, STORIES_EMBEDDED

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
_SIBLING = Path(sys.executable).with_name("rankserve")  # this environment's command
RANKSERVE = str(_SIBLING) if _SIBLING.exists() else (shutil.which("rankserve") or str(_SIBLING))
PROMPTS = ["Once upon a time", "Lily and Tom were"]


@pytest.fixture(scope="session")
def slurm(request):
    try:
        cluster = slurm_harness.ensure()
    except slurm_harness.Unavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Slurm harness must run on CI: {e}")
        pytest.skip(f"no Slurm cluster: {e}")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %o %T"], capture_output=True,
                           text=True, env=cluster.env).stdout
    shown = "; ".join(" ".join(line.split()) for line in nodes.splitlines())
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # in the CI log, not only on failure
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nSlurm cluster up: nodes (name address state): {shown}")
    addrs = [line.split()[1] for line in nodes.splitlines()]
    assert len(set(addrs)) == 2, nodes  # two nodes, two different addresses
    if os.environ.get("CI_SLURM_STAMP"):  # .ci/run checks that the cluster came up
        Path(os.environ["CI_SLURM_STAMP"]).write_text(nodes)
    return cluster


def _run(cluster, cmd, timeout=120, cwd=None, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cluster.env,
                          cwd=cwd, **kw)


def _single(stories_llm):
    from rankserve import SamplingParams
    outs = stories_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mpi, par", [("none", "--tp"), ("none", "--pp"), ("pmi2", "--tp")])
def test_srun_two_nodes_matches_single_rank(slurm, stories_llm, tmp_path, mpi, par):
    """`srun -N 2 -n 2 rankserve generate --tp/--pp 2`: plain srun (rankserve's own rendezvous)
    and `--mpi=pmi2` (the pip mpich's PMI-2 client talks to Slurm's pmi2 plugin)."""
    cmd = ["srun", f"--mpi={mpi}", "-N", "2", "-n", "2", RANKSERVE, "generate", str(STORIES_EMBEDDED),
           par, "2", "--max-tokens", "12", "--ignore-eos", "--json"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    env = dict(slurm.env)
    if mpi == "pmi2":  # a compute node whose HOME cannot be written: caches move to /tmp
        env["HOME"] = "/dev/null/home"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    print(log, file=sys.stderr)
    assert ("is not writable" in log) == (mpi == "pmi2"), log[-3000:]
    hosts = dict(re.findall(r"rankserve rank (\d)/2 host=(\S+)", log))
    assert hosts == {"0": "node1", "1": "node2"}, log[-3000:]
    if mpi == "none":  # rank 0's store is on node1's own address, reached from node2
        assert re.search(r"rank 1: torch.distributed gloo rendezvous at node1:\d+", log), log[-3000:]
    got = [json.loads(x)["token_ids"] for x in r.stdout.splitlines() if x.startswith("{")]
    assert got == _single(stories_llm)


def test_srun_two_ranks_on_one_node_share_its_cores_and_mismatch_names_srun(slurm, tmp_path):
    base = ["srun", "-N", "1", "-n", "2", "-w", "node1", RANKSERVE, "generate", str(STORIES_EMBEDDED),
            "--max-tokens", "2", "--prompt", "x"]
    r = _run(slurm, [*base, "--tp", "2"], cwd=tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    # node1 has 2 CPUs and no binding (task/none): one torch thread per rank, not 2 each
    assert sorted(re.findall(r"rank (\d)/2 host=node1 \S+ local_rank=\d device=cpu threads=(\d+)", log)) \
        == [("0", "1"), ("1", "1")], log[-3000:]
    r = _run(slurm, [*base, "--tp", "4"], cwd=tmp_path)
    log = r.stdout + r.stderr
    lines = [x for x in log.splitlines() if "rankserve: error:" in x]
    assert r.returncode != 0 and "Traceback" not in log and len(lines) == 1, log[-3000:]
    assert "needs 4 ranks but the job has 2; launch with `srun -n 4" in lines[0]


def _wait_for(path: Path, pattern: str, timeout: float, job: str | None = None, env=None) -> re.Match:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m
        time.sleep(0.3)
    if job:
        subprocess.run(["scancel", job], env=env)
    pytest.fail(f"{pattern!r} not in {path} after {timeout} s:\n{text[-3000:]}")


def _job_state(cluster, job: str) -> str:
    out = _run(cluster, ["scontrol", "show", "job", job]).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "GONE"


def _wait_job_end(cluster, job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _job_state(cluster, job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(0.3)
    info = _run(cluster, ["scontrol", "show", "job", job]).stdout
    subprocess.run(["scancel", "-s", "KILL", job], env=cluster.env)
    pytest.fail(f"job {job} still {state} after {timeout} s:\n{info}")


def _sbatch(cluster, tmp_path, *args, env_extra=None) -> str:
    # as a user with this environment activated: `rankserve` is on PATH
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    env = dict(cluster.env, PATH=path, **(env_extra or {}))
    r = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                        "--gpus-per-node=0", "--time=5", f"--chdir={tmp_path}", *args], capture_output=True,
                       text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_sbatch_serve_url_answers_from_outside_and_scancel_ends_every_rank(slurm, tmp_path):
    import httpx
    job = _sbatch(slurm, tmp_path, str(REPO / "slurm" / "serve.sbatch"))  # the embedded model
    out = tmp_path / f"rankserve-{job}.out"
    try:
        m = _wait_for(out, r"rankserve is ready: http://(\S+):(\d+)", 120, job, slurm.env)
        head, port = m.group(1), int(m.group(2))
        assert head == "node1"
        base = f"http://{slurm.addr(head)}:{port}"  # from the host namespace: outside the job
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                         "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        subprocess.run(["scancel", job], env=slurm.env)
    state = _wait_job_end(slurm, job, 60)
    text = out.read_text()
    pids = re.findall(r"rankserve rank (\d)/2 host=(\S+) pid=(\d+)", text)
    assert {(r, h) for r, h, _ in pids} == {("0", "node1"), ("1", "node2")}, text[-3000:]
    assert state == "CANCELLED", state
    assert "Traceback" not in text, text[-3000:]
    for rank, host, _ in pids:  # every rank ran its shutdown, none was left to SIGKILL
        assert re.search(rf"rank {rank} on {host}: SIGTERM", text), text[-3000:]
    for _, _, pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"rank pid {pid} still alive"
    deadline = time.monotonic() + 15  # the port is free again (the API process exits last)
    while True:
        try:
            socket.create_connection((slurm.addr(head), port), timeout=2).close()
        except OSError:
            break
        assert time.monotonic() < deadline, f"port {port} on {head} still open after the job"
        time.sleep(0.3)


def test_sbatch_scaling_table_and_plot_on_cpu(slurm, tmp_path):
    job = _sbatch(slurm, tmp_path, str(REPO / "slurm" / "scaling.sbatch"), str(STORIES_EMBEDDED),
                  "--num-prompts", "4", "--input-len", "8", "8", "--output-len", "8", "8",
                  env_extra={"TP_SIZES": "1 2", "RESULTS_DIR": str(tmp_path / "res")})
    state = _wait_job_end(slurm, job, 150)
    text = (tmp_path / f"rankserve-scaling-{job}.out").read_text()
    assert state == "COMPLETED", text[-3000:]
    assert "host=node2" in text  # tp=2 spans both nodes
    r = subprocess.run([RANKSERVE, "bench", "scaling", str(tmp_path / "res")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    table = (tmp_path / "res" / "scaling.md").read_text()
    gpus = [int(m) for m in re.findall(r"^\|\s*(\d+)\s*\|", table, re.M)]
    assert sorted(gpus) == [1, 2], table
    if shutil.which("true") and _has_matplotlib():
        assert (tmp_path / "res" / "scaling.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


_RENDEZVOUS = ("import os, time, torch, torch.distributed as dist; "
               "from rankserve.launch.discovery import discover; "
               "from rankserve.launch.bootstrap import init_distributed; "
               "init_distributed(discover(), 'cpu', 60); t = torch.ones(1); dist.all_reduce(t); "
               "print('job', os.environ['SLURM_JOB_ID'], 'step', os.environ['SLURM_STEP_ID'], "
               "'sum', t.item(), flush=True); time.sleep(4)")


def test_step_7_of_job_j_and_step_0_of_job_j_plus_1_both_rendezvous(slurm, tmp_path):
    """Defect 1 end to end: these two steps used to get the same derived port; one rank 0 failed
    with EADDRINUSE and the other job's rank 1 joined the wrong store. Now both meet their own."""
    step = f"srun -N 2 -n 2 {sys.executable} -c \"{_RENDEZVOUS}\""
    a = _sbatch(slurm, tmp_path, "--output=a-%j.out", "--wrap",
                "for i in 1 2 3 4 5 6 7; do srun -N 1 -n 1 true; done; " + step)
    b = _sbatch(slurm, tmp_path, "--output=b-%j.out", "--wrap", step)
    if int(b) != int(a) + 1:
        pytest.skip(f"another job was submitted in between ({a}, {b})")
    for job, name, want_step in ((a, "a", "7"), (b, "b", "0")):
        state = _wait_job_end(slurm, job, 120)
        text = (tmp_path / f"{name}-{job}.out").read_text()
        assert state == "COMPLETED", text[-3000:]
        assert text.count(f"job {job} step {want_step} sum 2.0") == 2, text[-3000:]


def test_killed_rank_ends_the_job_naming_it(slurm, tmp_path):
    cmd = ["srun", "-N", "2", "-n", "2", RANKSERVE, "generate", str(STORIES_EMBEDDED), "--tp", "2",
           "--max-tokens", "400", "--ignore-eos", *[a for p in PROMPTS * 20 for a in ("--prompt", p)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(slurm.env, RANKSERVE_HEARTBEAT_TIMEOUT="20"), cwd=tmp_path)
    lines, pid = [], None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"rank 1/2 host=node2 pid=(\d+)", line)
        pid = int(m.group(1)) if m else pid
        if pid and "KV cache" in line:
            break
    assert pid, "".join(lines)[-3000:]
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail("job did not end:\n" + out[-3000:])
    text = "".join(lines) + out
    assert proc.returncode != 0
    assert "lost rank 1 on node2" in text, text[-3000:]


@pytest.mark.parametrize("bad", [1, 0])
def test_a_rank_whose_start_fails_alone_ends_the_step_in_seconds(slurm, tmp_path, bad):
    """Plain `srun` (no MPI, no --kill-on-bad-exit: srun leaves the other ranks running) where
    MODEL is missing on one rank's node: the others used to wait for it for the rendezvous
    timeout (600 s). Now the failure crosses to the other node through the rendezvous and the
    step ends in seconds, exit 2, rank 0 printing it once with the failing rank's name."""
    model = f'm={STORIES_EMBEDDED}; [ "$SLURM_PROCID" = {bad} ] && m={tmp_path}/not-on-this-node'
    start = time.monotonic()
    r = _run(slurm, ["srun", "-N", "2", "-n", "2", "bash", "-c",
                     f'{model}; exec {RANKSERVE} generate "$m" --tp 2 --prompt x --max-tokens 2'],
             cwd=tmp_path, timeout=120)
    secs, log = time.monotonic() - start, r.stdout + r.stderr
    lines = [x for x in log.splitlines() if "rankserve: error:" in x]
    assert r.returncode == 2 and secs < 30, (r.returncode, secs, log[-3000:])
    assert len(lines) == 1 and f"rank {bad} on node{bad + 1}: " in lines[0], log[-3000:]
    assert "not-on-this-node" in lines[0] and "Traceback" not in log, log[-3000:]


def test_rank_aborting_at_exit_under_pmi2_does_not_hang_rank_0(slurm, tmp_path):
    """CI once saw `srun --mpi=pmi2` rank 1 die by SIGABRT at exit after every token was printed,
    and rank 0 wait in MPI finalize for it until the test timed out (srun, unlike mpiexec, leaves
    the other ranks running). Here rank 1 aborts inside its exit teardown: rank 0 ends in seconds,
    non-zero, naming it."""
    from test_mpi_bootstrap import RANK_SCRIPT, _env
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    cmd = ["srun", "--mpi=pmi2", "-N", "2", "-n", "2", sys.executable, str(script), "abort_in_teardown"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(SLURM_CONF=slurm.env["SLURM_CONF"]), cwd=tmp_path)
    try:
        log, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # srun cancels the step (its ranks) on SIGTERM
        log, _ = proc.communicate()
        pytest.fail("rank 0 did not exit:\n" + log[-3000:])
    assert "rank 0 done" in log and "rank 1 done" in log, log[-3000:]
    assert proc.returncode != 0 and time.monotonic() - start < 30, log[-3000:]
    assert "rank 0 on node1: lost rank 1 on node2" in log, log[-3000:]
    assert re.search(r"Fatal Python error:\s*Aborted", log), log[-3000:]  # and rank 1 said where


# ---- serve.sbatch's layout, with srun / scontrol stubbed (no cluster needed) -----------------
def _serve_sbatch_srun_args(tmp_path, *args, nodes=1, per_node=8) -> list[str]:
    """The `rankserve serve` arguments serve.sbatch hands to srun in an allocation of `nodes`
    nodes x `per_node` tasks."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("srun", 'printf "%s\\n" "$@" > "$SRUN_ARGS"'), ("scontrol", "echo node1"),
                       ("curl", "exit 1")):
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    out = tmp_path / "srun.args"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SRUN_ARGS=str(out),
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NTASKS_PER_NODE=str(per_node), RANKSERVE_PORT="8000",
               RANKSERVE_HEALTH_TIMEOUT="0")
    r = subprocess.run(["bash", str(REPO / "slurm" / "serve.sbatch"), *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = out.read_text().split("\n")[:-1]
    return argv[argv.index("serve") + 1:]


def _layout(argv: list[str]) -> tuple[int, int, int]:
    """(tp, pp, dp) as rankserve reads them: the last of each flag wins."""
    got = {"tp": 1, "pp": 1, "dp": 1}
    names = {"--tp": "tp", "--tensor-parallel-size": "tp", "--pp": "pp",
             "--pipeline-parallel-size": "pp", "--dp": "dp", "--data-parallel-size": "dp"}
    argv = [part for a in argv for part in (a.split("=", 1) if a.startswith("--") else [a])]
    for flag, value in zip(argv, argv[1:]):
        if flag in names:
            got[names[flag]] = int(value)
    return got["tp"], got["pp"], got["dp"]


@pytest.mark.parametrize("nodes, args, layout", [
    (1, [], (8, 1, 1)),                                   # TP = tasks per node, PP = nodes
    (2, [], (8, 2, 1)),
    (2, ["--tp", "4"], (4, 1, 1)),                        # the user's --tp as given
    (1, ["--pp", "2"], (4, 2, 1)),                        # the user's --pp kept, TP fills the rest
    (2, ["--pipeline-parallel-size=4"], (4, 4, 1)),
    (1, ["--dp", "2"], (4, 1, 2)),                        # replicas share the tasks
    (2, ["--data-parallel-size", "2"], (8, 1, 2)),
])
def test_serve_sbatch_keeps_the_users_layout(tmp_path, nodes, args, layout):
    argv = _serve_sbatch_srun_args(tmp_path, "/models/m", *args, nodes=nodes)
    assert _layout(argv) == layout, argv
