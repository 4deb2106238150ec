"""srun-without-MPI rendezvous (launch/rendezvous.py): ports cannot collide, jobs never mix."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import STORIES_EMBEDDED

from rankserve.launch.rendezvous import (Beacon, RankLost, StartupFailed, candidate_ports, join,
                                         slurm_token)


def _env(job, step):
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_CLUSTER_NAME": "c"}


def test_tokens_of_the_formerly_colliding_steps_differ():
    # the old derived port, 15000 + (job*7 + step) % 15000, was equal for these two steps
    a, b = slurm_token(_env(100, 7)), slurm_token(_env(101, 0))
    assert a != b
    ports = candidate_ports(a)
    assert len(set(ports)) == len(ports) and all(15000 <= p < 30000 for p in ports)


def _join(token, ports, timeout, rank=1, error=None):
    return join("127.0.0.1", token, ports, rank, "node2", timeout, error)


def test_two_jobs_on_the_same_ports_each_find_their_own_store():
    free = _free_ports(4)
    ta, tb = slurm_token(_env(100, 7)), slurm_token(_env(101, 0))
    a = Beacon(ta, free, 2, "store-of-A")
    b = Beacon(tb, free, 2, "store-of-B")  # A holds the first candidate: B takes the next
    try:
        assert a.port != b.port
        assert _join(tb, free, 5) == "store-of-B"
        assert _join(ta, free, 5) == "store-of-A"
        a.wait(5)
        b.wait(5)
    finally:
        a.close()
        b.close()
    c = Beacon(slurm_token(_env(102, 0)), free, 2, "store-of-C")
    try:  # a rank of another job waits, never joins
        with pytest.raises(TimeoutError, match="no rank 0 of"):
            _join(slurm_token(_env(103, 0)), free, 0.5)
    finally:
        c.close()


def test_other_listeners_on_candidates_are_skipped_and_late_rank0_is_awaited():
    free = _free_ports(3)
    squatter = socket.create_server(("", free[0]))  # some other program, never answers properly
    threading.Thread(target=lambda: [c.close() for c in [squatter.accept()[0]]], daemon=True).start()
    token = slurm_token(_env(7, 1))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("p", _join(token, free, 10)))
    t.start()  # the rank looks before rank 0 is up
    beacon = Beacon(token, free, 2, "12345")
    try:
        t.join(15)
        assert beacon.port != free[0] and result["p"] == "12345"
    finally:
        beacon.close()
        squatter.close()


def _joiner(token, ports, rank, error=None, timeout=20):
    """Rank `rank` checking in from a thread: its outcome lands in the returned dict."""
    out = {}

    def run():
        try:
            out["payload"] = _join(token, ports, timeout, rank, error)
        except Exception as e:
            out["error"] = e
        out["at"] = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_every_rank_gets_the_port_only_once_all_have_checked_in():
    free, token = _free_ports(2), slurm_token(_env(8, 0))
    beacon = Beacon(token, free, 3, "4242")
    first = _joiner(token, free, 1)
    time.sleep(0.5)
    assert "payload" not in first  # rank 2 is not there yet
    second = _joiner(token, free, 2)
    beacon.wait(10)
    for j in (first, second):
        j["thread"].join(5)
        assert j["payload"] == "4242"


def test_a_failed_rank_is_told_to_all_ranks_waiting_and_arriving():
    """Rank 2 waits, rank 1 reports its failure: rank 0 and rank 2 learn it at once; rank 3,
    arriving later, is told too; then rank 0 raises it."""
    free, token = _free_ports(2), slurm_token(_env(9, 0))
    beacon = Beacon(token, free, 4, "4242")
    waiting = _joiner(token, free, 2)
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(StartupFailed) as told:
        _join(token, free, 5, rank=1, error="MODEL\tis\nmissing")
    assert told.value.failures == [(1, "node2", "MODEL is missing")]
    waiting["thread"].join(5)
    assert isinstance(waiting["error"], StartupFailed) and waiting["at"] - t0 < 2
    with pytest.raises(StartupFailed):
        _join(token, free, 5, rank=3)
    with pytest.raises(StartupFailed) as e:
        beacon.wait(5)
    assert e.value.failures == [(1, "node2", "MODEL is missing")]


def test_a_failed_rank_0_tells_the_others_and_lingers_only_until_all_know():
    free, token = _free_ports(2), slurm_token(_env(10, 0))
    beacon = Beacon(token, free, 3, None, (0, "node1", "bad\tflag\n  --tp"))
    for r in (1, 2):
        with pytest.raises(StartupFailed) as e:
            _join(token, free, 5, rank=r)
        assert e.value.failures == [(0, "node1", "bad flag --tp")]
    t0 = time.monotonic()
    with pytest.raises(StartupFailed):
        beacon.wait(30)
    assert time.monotonic() - t0 < 1


def test_rank_0_vanishing_ends_the_wait_of_the_others_and_the_reverse():
    free, token = _free_ports(2), slurm_token(_env(11, 0))
    beacon = Beacon(token, free, 3, "4242")
    waiting = _joiner(token, free, 1)
    time.sleep(0.3)
    beacon.close()  # as rank 0's process ending closes its sockets
    waiting["thread"].join(5)
    assert isinstance(waiting["error"], RankLost), waiting
    # a waiting rank whose process ends: rank 0 stops waiting for the others and names it
    beacon = Beacon(token, free, 3, "4242")
    conn = socket.create_connection(("127.0.0.1", beacon.port))
    conn.sendall(f"{token}\t1\tnode2\n".encode())
    assert conn.recv(16) == b"wait\n"
    conn.close()
    t0 = time.monotonic()
    with pytest.raises(StartupFailed, match="rank 1 on node2: its process ended"):
        beacon.wait(30, linger_s=1)  # (it would tell rank 2, which never comes, for 1 s)
    assert time.monotonic() - t0 < 5


def test_all_candidates_busy_is_a_clear_error():
    held = [socket.create_server(("", p)) for p in _free_ports(2)]
    try:
        with pytest.raises(RuntimeError, match="candidate ports"):
            Beacon("t", [s.getsockname()[1] for s in held], 2, "x")
    finally:
        for s in held:
            s.close()


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports



# ---- a rank that fails alone at start-up under plain srun (no MPI, no --kill-on-bad-exit) ----

def _srun_ranks(n, args_of, env_of=lambda r: {}):
    """n ranks started the way plain `srun -n n` starts them on one node (Slurm variables, no
    MPI, no MASTER_*); args_of(rank) is the rank's command line (after `rankserve`)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "PMI", "OMPI_", "MASTER_")) and k not in ("RANK", "WORLD_SIZE")}
    job = str(os.getpid() * 100 + n)  # a job id of this test only: its own token and ports
    procs = []
    for r in range(n):
        env = dict(base, SLURM_CLUSTER_NAME="test", SLURM_JOB_ID=job, SLURM_STEP_ID="0",
                   SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0",
                   SLURM_STEP_NUM_TASKS=str(n), SLURM_NTASKS=str(n), SLURM_STEP_TASKS_PER_NODE=str(n),
                   SLURM_STEP_NODELIST="localhost", **env_of(r))
        procs.append(subprocess.Popen([sys.executable, "-m", "rankserve.launch", *args_of(r)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def _finish(procs, timeout):
    """(exit codes, output per rank, seconds until the last rank ended); kills what is left."""
    start, outs = time.monotonic(), {}
    try:
        for p in procs:
            outs[p] = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))[0]
    except subprocess.TimeoutExpired:
        pass
    finally:
        secs = time.monotonic() - start
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            if p not in outs:
                outs[p] = p.communicate()[0]
    return [p.returncode for p in procs], [outs[p] for p in procs], secs


@pytest.mark.parametrize("bad, what", [(1, "model"), (0, "model"), (2, "env")])
def test_a_rank_whose_start_fails_alone_under_plain_srun_ends_the_job_naming_it(tmp_path, bad, what):
    """MODEL is missing on one rank's node only (or a RANKSERVE_* value only its environment
    has is bad): that rank fails before the rendezvous, and the others used to wait for it for
    the whole rendezvous timeout (600 s): rank 0 listening for it, the others looking for a
    rank 0 that had exited. Now every rank exits 2 within seconds, rank 0 printing the error
    once, with the failing rank's name."""
    missing = tmp_path / "not-on-this-node"

    def args(r):
        model = missing if r == bad and what == "model" else STORIES_EMBEDDED
        return ["generate", str(model), "--pp", "3", "--prompt", "x", "--max-tokens", "2"]

    def env(r):
        return {"RANKSERVE_HEARTBEAT_TIMEOUT": "soon"} if r == bad and what == "env" else {}
    rcs, outs, secs = _finish(_srun_ranks(3, args, env), timeout=90)
    log = "\n".join(f"--- rank {r}:\n{o[-2000:]}" for r, o in enumerate(outs))
    assert rcs == [2, 2, 2] and secs < 30, (rcs, secs, log)
    lines = [x for o in outs for x in o.splitlines() if "rankserve: error:" in x]
    assert len(lines) == 1 and lines[0] in outs[0], log
    assert f"rank {bad} on {socket.gethostname()}: " in lines[0], log
    assert ("not-on-this-node" if what == "model" else "RANKSERVE_HEARTBEAT_TIMEOUT") in lines[0], log
    assert "Traceback" not in log, log


def test_plain_srun_ranks_that_all_fail_alike_print_once(tmp_path):
    """Every rank fails the same way (rank count ≠ tp × pp): one line, no rank prefix."""
    args = ["generate", str(STORIES_EMBEDDED), "--tp", "4", "--prompt", "x", "--max-tokens", "2"]
    rcs, outs, secs = _finish(_srun_ranks(2, lambda r: args), timeout=90)
    log = "\n".join(outs)
    lines = [x for x in log.splitlines() if "rankserve: error:" in x]
    assert rcs == [2, 2] and secs < 30 and len(lines) == 1, (rcs, secs, log[-3000:])
    assert lines[0].startswith("rankserve: error: --tensor-parallel-size 4") and "srun -n 4" in lines[0]


def test_plain_srun_ranks_still_meet_and_generate(tmp_path):
    args = ["generate", str(STORIES_EMBEDDED), "--tp", "2", "--prompt", "x", "--max-tokens", "2"]
    rcs, outs, secs = _finish(_srun_ranks(2, lambda r: args), timeout=120)
    assert rcs == [0, 0], "\n".join(outs)[-3000:]
    assert "rank 1: torch.distributed gloo rendezvous at localhost:" in outs[1], outs[1][-3000:]


def test_a_rank_failing_after_the_ranks_met_is_named_at_once():
    """Rank 1 fails after the rendezvous (a flag only its command line has, found when its engine
    is built): the failure handlers end the job, as before; it must not look for a rendezvous
    that is over (that made it wait 60 s for a rank 0 to tell)."""
    def args(r):
        return ["generate", str(STORIES_EMBEDDED), "--tp", "2", "--prompt", "x", "--max-tokens", "2",
                *(["--max-model-len", "100000"] if r == 1 else [])]
    rcs, outs, secs = _finish(_srun_ranks(2, args), timeout=90)
    log = "\n".join(outs)
    assert rcs == [1, 1] and secs < 30, (rcs, secs, log[-3000:])
    assert "rank 1 on " in outs[1] and "failed: ValueError: --max-model-len 100000" in outs[1], log[-3000:]
    assert "lost rank 1 on " in outs[0], log[-3000:]
