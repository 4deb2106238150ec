"""Data parallelism (`--data-parallel-size N`): N engine replicas behind the one API on rank 0.

Each replica is a block of TP × PP consecutive ranks (runtime/parallel.py) with a control channel
of its own, and its first rank (the replica's leader) runs an EngineCore over a
`MultiRankExecutor`, exactly as rank 0 does for a single engine. Rank 0 leads replica 0 and starts
the API process; the API connects to every leader's ZMQ socket (replica 0: ipc, the others: tcp,
bound here before the model loads and gathered to rank 0) and balances requests over them
(runtime/serve/load_balancer.py).

Why leaders, not N engine cores on rank 0: an engine core's executor is its replica's rank 0 (it
holds a model shard and broadcasts the step plans), so cores on rank 0 would need another hop per
step to reach the other replicas, and N schedulers would share one Python thread. With one core
per leader, every replica schedules in its own process at full speed, and the API protocol is the
same as for one engine.

Failure: every rank of every replica still belongs to the job's heartbeat and excepthooks
(launch/failure.py), so a replica that fails takes the job down with the rank named, like any
rank. Shutdown: when rank 0's server stops, it sends SHUTDOWN to the other leaders, which stop
their workers and exit.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from ..models.parallel import ParallelInfo
from . import envs
from .config import EngineConfig
from .parallel import replica_ranks

log = logging.getLogger("rankserve.dp")


@dataclass
class DataParallelContext:
    """This rank's place among the replicas. On rank 0, `addresses` lists the other leaders'
    engine sockets (replica 1 first); on another leader, `bound` is its (zmq context, ROUTER
    socket) already listening."""
    dp_rank: int
    dp_size: int
    addresses: list[str] = field(default_factory=list)
    bound: tuple | None = None


def local_address_towards(host: str) -> str:
    """This host's address on the interface that reaches `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def setup_replicas(cfg: EngineConfig, control, pi: ParallelInfo, single_node: bool):
    """Collective over the whole job: returns (this replica's control channel, its context).

    The job channel `control` is split into one channel per replica; every leader but rank 0
    binds a ROUTER socket on an address rank 0 can reach and the addresses are gathered there."""
    import zmq
    sub = control.split(replica_ranks(cfg.parallel))
    ctx = DataParallelContext(pi.dp_rank, pi.dp_size)
    head = None if control.rank else (envs.get("RANKSERVE_MASTER_ADDR") or socket.gethostname())
    head = control.bcast(head)
    endpoint = None
    if sub.rank == 0 and pi.dp_rank > 0:
        host = "127.0.0.1" if single_node else local_address_towards(head)
        zctx = zmq.Context()
        sock = zctx.socket(zmq.ROUTER)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        sock.bind(f"tcp://{host}:*")  # the kernel picks the port: nothing to collide with
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        ctx.bound = (zctx, sock)
        log.info("data-parallel replica %d: engine socket %s", pi.dp_rank, endpoint)
    gathered = control.gather(endpoint)
    if control.rank == 0:
        ctx.addresses = [a for a in gathered if a]
        assert len(ctx.addresses) == pi.dp_size - 1, gathered
    return sub, ctx
