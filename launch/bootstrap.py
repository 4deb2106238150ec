"""Join torch.distributed and build the control plane.

`init_distributed(info, device, timeout_s)` is collective: every rank calls it once, after
`discover()` and `DeviceConfig.resolve()`. It returns a `ControlChannel`, the small-message control plane
used every engine step (step plans out, sampled token ids back); tensors go over the default
torch.distributed group (NCCL on GPU, gloo on CPU).

Rendezvous:
- MPI: rank 0 starts the torch TCPStore on port 0 (the kernel picks a free port, so there is no
  window between choosing a port and binding it) and broadcasts `host:port` over MPI. The host is
  127.0.0.1 when all ranks share one node, else `RANKSERVE_MASTER_ADDR` or this host's name.
- Slurm without MPI: `MASTER_ADDR/MASTER_PORT` if set; else rank 0 (on the first host of
  `SLURM_STEP_NODELIST`, via `scontrol show hostnames` when available) starts the store on port 0
  and the other ranks learn that port from its rendezvous beacon, which answers only ranks of the
  same job step (launch/rendezvous.py): no port can collide, no rank can join another job. The
  beacon answers once every rank has checked in, or tells every rank that one failed to start
  (`slurm_startup_failure`), so no rank waits for one that is gone.
- torchrun / deepspeed launcher: `env://` (MASTER_ADDR/MASTER_PORT, or torchrun's agent store).

Idle waiting: `ControlChannel.bcast_idle` is the call workers sit in between requests. It posts a
non-blocking broadcast of a fixed 4 KiB header (MPI `Ibcast`, gloo `async_op=True`) and polls it:
a short busy spin (so a busy engine pays no extra latency), then sleeps that back off to 1 ms. An
idle worker therefore uses ~1% of a core instead of 100% (MPICH and Open MPI spin inside a
blocking `MPI_Bcast`), and it returns to Python often, so SIGTERM handlers run while idle. Plans
that fit the header travel in that one collective; larger ones follow in a second broadcast.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import shutil
import socket
import subprocess
import time
from typing import Any

from ..runtime import envs
from .discovery import RankInfo, expand_hostlist

log = logging.getLogger(__name__)

HEADER_BYTES = 4096  # 8-byte length + inline payload; a typical decode-step plan fits
_LEN = 8
_SPIN_S = 2e-4  # busy-poll this long before sleeping
_MAX_SLEEP_S = 1e-3  # worst added latency for the first request after an idle period
# The control group may sit idle for hours between requests; liveness is the heartbeat's job
# (launch/failure.py), not a collective timeout.
_IDLE_TIMEOUT = datetime.timedelta(days=365)


def _pack(obj: Any) -> tuple[bytearray, bytearray | None]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = bytearray(HEADER_BYTES)
    header[:_LEN] = len(data).to_bytes(_LEN, "little")
    if len(data) <= HEADER_BYTES - _LEN:
        header[_LEN:_LEN + len(data)] = data
        return header, None
    return header, bytearray(data)


def _header_len(header) -> int:
    return int.from_bytes(bytes(header[:_LEN]), "little")


def _poll(done) -> None:
    """Wait until done() is true without holding a core (see module docstring)."""
    start = time.perf_counter()
    delay = 2e-5
    while not done():
        if time.perf_counter() - start < _SPIN_S:
            continue
        time.sleep(delay)
        delay = min(delay * 2, _MAX_SLEEP_S)


class ControlChannel:
    """Small picklable messages between ranks. All methods except send/recv are collective."""

    rank = 0
    world_size = 1

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        """Root's `obj` on every rank (latency-first; may spin while waiting)."""
        return obj

    def bcast_idle(self, obj: Any = None, root: int = 0) -> Any:
        """Like bcast, for waiting on work of unknown arrival time: sleeps instead of spinning.

        Every rank, root included, must use bcast_idle for the same broadcast (a non-blocking
        collective does not match a blocking one).
        """
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """List of every rank's obj on root, None elsewhere."""
        return [obj]

    def barrier(self) -> None:
        pass

    def send(self, obj: Any, dest: int) -> None:
        """Send without waiting for the receive: a rank that sends a step's result moves on to
        the next step, whose input the receiver may be sending it meanwhile (a blocking send
        of a large message would wait for that receiver: a deadlock). Sends to one peer arrive
        in order."""
        raise ValueError(f"send to rank {dest}: single-process run has no peers")

    def recv(self, source: int) -> Any:
        raise ValueError(f"recv from rank {source}: single-process run has no peers")

    def split(self, groups: list[list[int]]) -> "ControlChannel":
        """Collective: the channel of the group (of `groups`, a partition of the ranks) this rank
        is in, with ranks numbered within it (data parallelism: one channel per replica)."""
        if len(groups) == 1:
            return self
        raise ValueError(f"{type(self).__name__} cannot be split")

    def _log_size(self, what: str, nbytes: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %d bytes", what, nbytes)


class SingleControl(ControlChannel):
    """One process: every collective is the identity."""


class MPIControl(ControlChannel):
    """mpi4py pickle-based calls on a private duplicate of COMM_WORLD."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()  # own context: no clash with other MPI users
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()

    def bcast(self, obj=None, root=0):
        if self.rank == root and log.isEnabledFor(logging.DEBUG):
            self._log_size("bcast", len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))
        return self.comm.bcast(obj, root=root)

    def bcast_idle(self, obj=None, root=0):
        MPI = self._MPI
        if self.rank == root:
            header, rest = _pack(obj)
            self._log_size("bcast_idle", _header_len(header))
        else:
            header, rest = bytearray(HEADER_BYTES), None
        req = self.comm.Ibcast([header, MPI.BYTE], root=root)
        _poll(req.Test)
        n = _header_len(header)
        if n <= HEADER_BYTES - _LEN:
            return obj if self.rank == root else pickle.loads(header[_LEN:_LEN + n])
        if rest is None:
            rest = bytearray(n)
        self.comm.Bcast([rest, MPI.BYTE], root=root)  # sender is active now: a short wait
        return obj if self.rank == root else pickle.loads(rest)

    def gather(self, obj, root=0):
        return self.comm.gather(obj, root=root)

    def split(self, groups):
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        sub = self.comm.Split(color, key=self.rank)
        try:
            return MPIControl(sub)
        finally:
            sub.Free()  # MPIControl keeps its own duplicate

    def barrier(self):
        self.comm.barrier()

    def send(self, obj, dest):
        self._sending = [r for r in getattr(self, "_sending", []) if not r.Test()]
        self._sending.append(self.comm.isend(obj, dest=dest))  # (the request holds the pickle)

    def recv(self, source):
        return self.comm.recv(source=source)


class GlooControl(ControlChannel):
    """A dedicated gloo group (srun without MPI, torchrun): works next to an NCCL default group."""

    def __init__(self, group=None, ranks: list[int] | None = None):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group or dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        # torch.distributed names peers by their global rank; this channel by its own numbering
        self.ranks = ranks or list(range(dist.get_world_size()))
        self.rank = self.ranks.index(dist.get_rank())
        self.world_size = len(self.ranks)

    def split(self, groups):
        mine = None
        for g in groups:  # every rank creates every group, in the same order
            pg = self._dist.new_group(g, backend="gloo", timeout=_IDLE_TIMEOUT)
            if self._dist.get_rank() in g:
                mine = (pg, list(g))
        return GlooControl(*mine)

    def _bcast_bytes(self, buf: bytearray, root: int, idle: bool) -> None:
        t = self._torch.frombuffer(buf, dtype=self._torch.uint8)
        work = self._dist.broadcast(t, src=self.ranks[root], group=self.group, async_op=True)
        if idle:
            _poll(work.is_completed)
        work.wait()  # also raises if a peer dropped out

    def _bcast(self, obj, root, idle):
        if self.rank == root:
            header, rest = _pack(obj)
            self._log_size("bcast", _header_len(header))
        else:
            header, rest = bytearray(HEADER_BYTES), None
        self._bcast_bytes(header, root, idle)
        n = _header_len(header)
        if n <= HEADER_BYTES - _LEN:
            return obj if self.rank == root else pickle.loads(header[_LEN:_LEN + n])
        if rest is None:
            rest = bytearray(n)
        self._bcast_bytes(rest, root, idle=False)
        return obj if self.rank == root else pickle.loads(rest)

    # gloo blocks in a condition variable rather than spinning, so bcast just waits; bcast_idle
    # also polls, which lets Python signal handlers run during long idle periods
    def bcast(self, obj=None, root=0):
        return self._bcast(obj, root, idle=False)

    def bcast_idle(self, obj=None, root=0):
        return self._bcast(obj, root, idle=True)

    def gather(self, obj, root=0):
        out = [None] * self.world_size if self.rank == root else None
        self._dist.gather_object(obj, out, dst=self.ranks[root], group=self.group)
        return out

    def barrier(self):
        self._dist.barrier(group=self.group)

    def send(self, obj, dest):
        torch, dist = self._torch, self._dist
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        # the tensors live until their sends completed
        self._sending = [(w, t) for w, t in getattr(self, "_sending", []) if not all(x.is_completed() for x in w)]
        self._sending.append(([dist.isend(t, dst=self.ranks[dest], group=self.group) for t in (size, data)],
                              (size, data)))

    def recv(self, source):
        torch, dist, src = self._torch, self._dist, self.ranks[source]
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=src, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=src, group=self.group)
        return pickle.loads(data.numpy().tobytes())


def init_distributed(info: RankInfo, device: str, timeout_s: float = 600.0) -> ControlChannel:
    """Join torch.distributed (nccl for cuda devices, else gloo); return the control channel.

    Collective over all ranks. A single process gets a `SingleControl` and no process group.
    """
    if info.world_size == 1 and info.launcher == "single":
        return SingleControl()
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = dict(backend=backend, rank=info.rank, world_size=info.world_size,
                                  timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device(device)

    if info.launcher == "mpi":
        control: ControlChannel = MPIControl()
        addr = None
        if info.rank == 0:
            host = _master_host(info)
            store = _master_store(host, info.world_size, timeout)
            addr = f"{host}:{store.port}"
        addr = control.bcast(addr)
        if info.rank != 0:
            host, port = addr.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), info.world_size, is_master=False, timeout=timeout)
        log.info("rank %d: torch.distributed %s rendezvous at %s", info.rank, backend, addr)
        dist.init_process_group(store=store, **kwargs)
        atexit.register(_destroy_process_group)
        return control

    if info.launcher == "slurm" and not master_env(os.environ):
        store, addr = _slurm_store(info, timeout_s)
        log.info("rank %d: torch.distributed %s rendezvous at %s", info.rank, backend, addr)
        dist.init_process_group(store=store, **kwargs)
        atexit.register(_destroy_process_group)
        return GlooControl()
    if info.launcher == "slurm":
        addr = master_env(os.environ)
        init_method = f"tcp://{addr}"
    elif info.launcher == "torchrun":
        init_method = "env://"
        addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    else:
        raise ValueError(f"cannot bootstrap launcher {info.launcher!r} with {info.world_size} ranks")
    log.info("rank %d: torch.distributed %s rendezvous at %s", info.rank, backend, addr)
    dist.init_process_group(init_method=init_method, **kwargs)
    atexit.register(_destroy_process_group)
    return GlooControl()


def _destroy_process_group() -> None:
    # A process group left to interpreter teardown can die in std::terminate (gloo's threads),
    # turning a clean exit into SIGABRT; tear it down while Python is still intact.
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # exiting anyway; do not mask the real exit status
            # but say so: the group is then left to interpreter teardown (see above)
            log.warning("destroy_process_group at exit failed: %s", e)


def _master_host(info: RankInfo) -> str:
    if envs.get("RANKSERVE_MASTER_ADDR"):
        return envs.get("RANKSERVE_MASTER_ADDR")
    if info.local_world_size == info.world_size:
        return "127.0.0.1"  # one node: works even where the hostname does not resolve
    return socket.gethostname()


def _master_store(host: str, world_size: int, timeout):
    import torch.distributed as dist

    # port 0: the kernel picks a free port and the store holds it from that moment on
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def _slurm_rendezvous(info: RankInfo) -> tuple[str, str, list[int]]:
    """(rank 0's host, the step's token, candidate ports) for srun-launched ranks without MPI."""
    from .rendezvous import candidate_ports, slurm_token

    env = os.environ
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise RuntimeError("srun without MPI: SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is not set")
    host = envs.get("RANKSERVE_MASTER_ADDR") or first_host(nodelist)  # where rank 0 runs
    token = slurm_token(env)
    return host, token, candidate_ports(token)


def _slurm_store(info: RankInfo, timeout_s: float):
    """(store, "host:port") for srun-launched ranks without MPI, once every rank has checked in
    with rank 0's beacon; a LaunchError on every rank when one of them failed to start."""
    import torch.distributed as dist

    from .preflight import job_failed, met
    from .rendezvous import Beacon, RankLost, StartupFailed, join

    host, token, candidates = _slurm_rendezvous(info)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if info.rank == 0:
            store = _master_store(host, info.world_size, timeout)
            port = store.port
            Beacon(token, candidates, info.world_size, str(port)).wait(timeout_s)
        else:
            port = int(join(host, token, candidates, info.rank, info.host, timeout_s))
            store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)
    except StartupFailed as e:
        raise job_failed(e.failures, info) from None
    except (RankLost, TimeoutError) as e:  # this rank's own view: it prints it
        raise job_failed([(info.rank, info.host, str(e))], info, report=True) from None
    met()
    return store, f"{host}:{port}"


def slurm_startup_failure(info: RankInfo, error: str) -> Exception:
    """This srun rank (no MPI) failed to start with `error`: tell the others through the
    rendezvous (rank 0 prints it, naming this rank; see launch/rendezvous.py) and return the
    LaunchError to raise. Without a rank 0 to tell, the rank prints it itself."""
    from .preflight import job_failed
    from .rendezvous import LINGER_S, NOTICE_S, Beacon, StartupFailed, join

    try:
        host, token, candidates = _slurm_rendezvous(info)
        if info.rank == 0:
            Beacon(token, candidates, info.world_size, None, (0, info.host, error)).wait(LINGER_S)
        else:
            join(host, token, candidates, info.rank, info.host, NOTICE_S, error)
    except StartupFailed as e:
        return job_failed(e.failures, info)
    except Exception as e:  # nobody to tell: the others end by their own rendezvous timeout
        log.warning("rank %d: could not tell the other ranks that this rank failed: %s", info.rank, e)
    return job_failed([(info.rank, info.host, error)], info, report=True)


def master_env(env) -> str | None:
    """`MASTER_ADDR:MASTER_PORT` when both are set (an explicit rendezvous), else None."""
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def first_host(nodelist: str) -> str:
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError) as e:
            log.warning("scontrol show hostnames failed (%s); parsing %r", e, nodelist)
    return expand_hostlist(nodelist)[0]
