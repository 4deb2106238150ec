"""srun-without-MPI rendezvous (launch/rendezvous.py): ports cannot collide, jobs never mix."""
import socket
import threading

import pytest

from rankserve.launch.rendezvous import Beacon, candidate_ports, find, slurm_token


def _env(job, step):
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_CLUSTER_NAME": "c"}


def test_tokens_of_the_formerly_colliding_steps_differ():
    # the old derived port, 15000 + (job*7 + step) % 15000, was equal for these two steps
    a, b = slurm_token(_env(100, 7)), slurm_token(_env(101, 0))
    assert a != b
    ports = candidate_ports(a)
    assert len(set(ports)) == len(ports) and all(15000 <= p < 30000 for p in ports)


def test_two_jobs_on_the_same_ports_each_find_their_own_store():
    free = _free_ports(4)
    ta, tb = slurm_token(_env(100, 7)), slurm_token(_env(101, 0))
    a = Beacon(ta, free, "store-of-A")
    b = Beacon(tb, free, "store-of-B")  # A holds the first candidate: B takes the next
    try:
        assert a.port != b.port
        assert find("127.0.0.1", tb, free, 5) == "store-of-B"
        assert find("127.0.0.1", ta, free, 5) == "store-of-A"
        with pytest.raises(TimeoutError, match="no rank 0 of"):  # a third job's rank waits, never joins
            find("127.0.0.1", slurm_token(_env(102, 0)), free, 0.5)
    finally:
        a.close()
        b.close()


def test_other_listeners_on_candidates_are_skipped_and_late_rank0_is_awaited():
    free = _free_ports(3)
    squatter = socket.create_server(("", free[0]))  # some other program, never answers properly
    threading.Thread(target=lambda: [c.close() for c in [squatter.accept()[0]]], daemon=True).start()
    token = slurm_token(_env(7, 1))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("p", find("127.0.0.1", token, free, 10)))
    t.start()  # the rank looks before rank 0 is up
    beacon = Beacon(token, free, "12345")
    try:
        t.join(15)
        assert beacon.port != free[0] and result["p"] == "12345"
    finally:
        beacon.close()
        squatter.close()


def test_all_candidates_busy_is_a_clear_error():
    held = [socket.create_server(("", p)) for p in _free_ports(2)]
    try:
        with pytest.raises(RuntimeError, match="candidate ports"):
            Beacon("t", [s.getsockname()[1] for s in held], "x")
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

