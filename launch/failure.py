"""Take the whole job down when one rank fails; shut down cleanly on SIGTERM/SIGINT.

`install_failure_handlers(info, control, on_shutdown=None)` is collective (call it on every rank
right after `init_distributed`). It installs:

- An excepthook (main thread and other threads): logs `rank R on HOST failed: <traceback>`,
  waits 0.5 s so the heartbeat can name a dead peer if that is what broke a collective, and
  ends the job: `MPI.COMM_WORLD.Abort(1)` under MPI (the process manager kills every rank), else
  `os._exit(1)`, which peers notice through the heartbeat below.
- A heartbeat: rank 0 listens on a TCP port (address broadcast over `control`), every other rank
  keeps one connection to it. A SIGKILLed or crashed process has its socket closed by the kernel,
  so the peer sees EOF at once; a silent peer (node lost, network cut) is declared lost after
  `RANKSERVE_HEARTBEAT_TIMEOUT` seconds (default 30) without a ping (pings every few seconds).
  On loss, the survivor logs `lost rank R on HOST` and aborts as above; rank 0 going down takes
  the rest with it. This is plain TCP in a daemon thread, so it needs no MPI thread support and
  costs one wakeup every few seconds. A rank that exits normally says goodbye (`B`) when its
  exit teardown starts and done (`D`) when it is over, so a clean exit is not a failure; a
  process that ends between the two (crashed or killed at exit) is (see `_exit_teardown`).
  `RANKSERVE_HEARTBEAT=0` turns it off (MPI launchers, torchrun and `srun --kill-on-bad-exit`
  also kill the job when a process dies; the heartbeat adds the message and covers lost nodes).
- SIGTERM/SIGINT (Slurm time limit, scancel, Ctrl-C): the registered shutdown callbacks run once,
  then the process exits with 128+signal. A server (`drain_on_signal`) drains instead: rank 0's
  `on_drain` callback stops taking requests and lets those in flight finish, then shuts the
  workers down as usual; a worker that got the signal tells rank 0 (`T`), and any rank still
  there when the grace period is over (or at a second signal) shuts down as above. The signal
  is also seen by the heartbeat thread through `signal.set_wakeup_fd` (which then handles it
  alone), so shutdown starts even while the main thread is stuck inside a C call (a blocking
  collective). Callbacks may therefore run on that thread; keep them thread-safe.
- faulthandler (multi-rank): a rank that dies by SIGABRT or SIGSEGV prints its Python stacks.
- An exit teardown (atexit, multi-rank): goodbye, process group destroyed, MPI finalized
  with the heartbeat still watching, done (`_exit_teardown`).

`abort(msg)` is for code that detects a fatal error itself.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

from ..runtime import envs
from .discovery import RankInfo

log = logging.getLogger(__name__)

_info: RankInfo | None = None
_callbacks: list = []
_shutdown_lock = threading.Lock()
_heartbeat: "_Heartbeat | None" = None
_keep: list = []  # the signal wakeup socket must stay open
_drain: dict = {"grace_s": None, "begin": [], "timer": None, "signals": 0}  # see drain_on_signal
_drain_lock = threading.Lock()


def install_failure_handlers(info: RankInfo, control, on_shutdown=None) -> None:
    """Install excepthooks, signal handlers and (multi-rank) the heartbeat. Collective."""
    global _info, _heartbeat
    _info = info
    if on_shutdown is not None:
        register_shutdown(on_shutdown)
    sys.excepthook = _excepthook
    threading.excepthook = lambda a: _excepthook(a.exc_type, a.exc_value, a.exc_traceback)
    heartbeat = info.world_size > 1 and envs.get("RANKSERVE_HEARTBEAT")
    wake_r = None
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)
        if heartbeat:
            wake_r, wake_w = socket.socketpair()
            wake_w.setblocking(False)
            signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
            _keep.append(wake_w)
    if heartbeat:
        _heartbeat = _Heartbeat(info, control, wake_r)
    if info.world_size > 1:
        # a rank killed by SIGABRT/SIGSEGV (gloo's threads, MPI) prints where, in every thread
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
        # registered after init_distributed's own handler, so it runs first (atexit is LIFO)
        atexit.register(_exit_teardown)


def register_shutdown(callback) -> None:
    """Run `callback()` once on SIGTERM/SIGINT (or a peer's shutdown), before exiting."""
    _callbacks.append(callback)


def drain_on_signal(grace_s: float) -> None:
    """SIGTERM/SIGINT (or a peer's `T`) start a drain instead of an immediate shutdown (serve,
    on every rank): `on_drain` callbacks run (rank 0 without one shuts down at once: it is still
    starting), and whatever still runs `grace_s` later, or at a second signal, shuts down."""
    _drain["grace_s"] = grace_s


def on_drain(callback) -> None:
    """Run `callback()` when a drain starts (rank 0's engine: stop the API, finish requests)."""
    _drain["begin"].append(callback)


def _signal(signum: int, peer: str = "") -> None:
    """A signal (or a peer's drain notice, `peer` naming it): drain or shut down."""
    rank0 = _info is None or _info.rank == 0
    with _drain_lock:
        started = _drain["timer"] is not None
        _drain["signals"] += not peer
        drain = _drain["grace_s"] is not None and not started and (_drain["begin"] or not rank0)
        if drain:
            timer = threading.Timer(_drain["grace_s"], _shutdown, (signum, "drain time is over"))
            timer.daemon = True
            _drain["timer"] = timer
    if not drain:
        # a second signal to this rank: now (its own first one may come after a peer's notice)
        if not started or _drain["signals"] > 1:
            _shutdown(signum, peer)
        return
    log.warning("%s: %s%s, draining (at most %.0f s)", _where(), signal.Signals(signum).name,
                f" ({peer})" if peer else "", _drain["grace_s"])
    timer.start()
    for cb in _drain["begin"]:
        cb()
    if _heartbeat and not rank0:  # rank 0 runs the drain
        _heartbeat.say(b"T")


def abort(msg: str, code: int = 1) -> None:
    """Log a fatal error for this rank and end the whole job. Never returns."""
    log.critical("%s: fatal: %s", _where(), msg)
    _die(code)


def _where() -> str:
    return f"rank {_info.rank} on {_info.host}" if _info else f"pid {os.getpid()}"


def _excepthook(exc_type, exc, tb) -> None:
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if issubclass(exc_type, ValueError):  # a user error (flags, checkpoint): its message says it
        log.critical("%s failed: %s: %s", _where(), exc_type.__name__, exc)
        log.debug("%s", text)
    else:
        log.critical("%s failed: %s", _where(), text)
    if _heartbeat:
        # a failed collective is usually a dead peer: let the heartbeat name it before we go
        time.sleep(0.5)
    _die(1)


def _die(code: int, mpi_abort: bool = True) -> None:
    """End the job now: MPI Abort under MPI, otherwise exit and let the heartbeat tell peers."""
    if _heartbeat:
        _heartbeat.leave(b"F", wait_s=0.5)
    _flush()
    if mpi_abort and _info is not None and _info.launcher == "mpi" and _info.world_size > 1:
        from mpi4py import MPI

        # Abort from a helper thread is only legal with full thread support
        if threading.current_thread() is threading.main_thread() or \
                MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _flush() -> None:
    for h in logging.getLogger().handlers + [logging.lastResort]:
        if h is not None:
            try:
                h.flush()
            except Exception:
                pass
    sys.stderr.flush()


def _exit_teardown() -> None:
    """At a normal exit: goodbye to peers, destroy the process group, finalize MPI, done.

    MPI finalize is collective (MPICH waits in it for every rank). Left to mpi4py it runs after
    Python's own teardown, holding the GIL, so nothing could notice a peer that dies meanwhile;
    under srun, which does not kill the other ranks when one dies, rank 0 then waited forever
    for a rank that had died by SIGABRT at exit. Here it runs with the GIL released while the
    heartbeat keeps watching: a peer whose process ends after its goodbye but before its done
    ends this rank too, with a message naming it.
    """
    if _drain["timer"] is not None:  # drained: this is the normal exit
        _drain["timer"].cancel()
    hb = _heartbeat
    if hb is not None:
        hb.begin_exit()
    from . import bootstrap

    bootstrap._destroy_process_group()
    if _info is not None and _info.launcher == "mpi":
        _finalize_mpi()
    if hb is not None:
        hb.leave(b"D")


def _finalize_mpi() -> None:
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    fn = _c_mpi_finalize()
    if fn is None:
        MPI.Finalize()  # mpi4py holds the GIL in it: a dead peer goes unnoticed (unknown library)
    elif fn() != 0:  # ctypes releases the GIL; mpi4py skips its own finalize afterwards
        log.warning("%s: MPI_Finalize failed", _where())


def _c_mpi_finalize():
    """MPI_Finalize of the MPI library this process loaded (found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        if os.path.basename(path).startswith("libmpi"):
            try:
                return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0)).MPI_Finalize
            except (OSError, AttributeError):
                continue
    try:
        return ctypes.CDLL(None).MPI_Finalize
    except (OSError, AttributeError):
        return None


def _on_signal(signum, frame) -> None:
    if not _keep:  # else the heartbeat thread takes it from the wakeup fd: one handler per signal
        _signal(signum)


def _shutdown(signum: int, reason: str = "") -> None:
    """Run the callbacks once, tell peers, exit 128+signum. A second caller just waits."""
    if not _shutdown_lock.acquire(blocking=False):
        if threading.current_thread() is threading.main_thread():
            while True:  # the other thread is exiting the process
                time.sleep(1)
        return
    name = signal.Signals(signum).name
    log.warning("%s: %s%s, shutting down", _where(), name, f" ({reason})" if reason else "")
    for cb in _callbacks:
        try:
            cb()
        except Exception:
            log.exception("%s: shutdown callback failed", _where())
    if _heartbeat:
        _heartbeat.leave(b"S")
    _flush()
    os._exit(128 + signum)


class _Heartbeat:
    """Rank 0 is the hub; every other rank holds one TCP connection to it (see module doc)."""

    def __init__(self, info: RankInfo, control, wake_r):
        self.info = info
        self.timeout = envs.get("RANKSERVE_HEARTBEAT_TIMEOUT")
        self.interval = min(3.0, self.timeout / 5)
        # conn -> [rank, host, last_seen, said goodbye (its exit teardown has started)]
        self.peers: dict[socket.socket, list] = {}
        self.lock = threading.Lock()
        addr = None
        if info.rank == 0:
            lsock = socket.create_server(("", 0), backlog=max(16, info.world_size))
            addr = (_reachable_host(info), lsock.getsockname()[1], info.host)
        addr = control.bcast(addr)
        if info.rank == 0:
            lsock.settimeout(120)
            for _ in range(info.world_size - 1):
                conn, _ = lsock.accept()
                peer_rank, peer_host = _readline(conn).split(" ", 1)
                self.peers[conn] = [int(peer_rank), peer_host, time.monotonic(), False]
            lsock.close()
        else:
            conn = socket.create_connection(addr[:2], timeout=120)
            conn.sendall(f"{info.rank} {info.host}\n".encode())
            self.peers[conn] = [0, addr[2], time.monotonic(), False]
        control.barrier()  # everyone is connected before anyone can fail
        for conn in self.peers:
            conn.setblocking(False)
        self.wake_r = wake_r
        self.leaving = False
        self.exiting = False
        threading.Thread(target=self._run, name="rankserve-heartbeat", daemon=True).start()

    def say(self, code: bytes) -> None:
        with self.lock:
            for conn in list(self.peers):
                try:
                    conn.send(code)
                except OSError:
                    pass

    def begin_exit(self) -> None:
        """This rank's exit teardown starts: say goodbye (B) and keep watching the peers."""
        self.exiting = True
        self.say(b"B")

    def leave(self, code: bytes, wait_s: float = 1.0) -> None:
        """Send `code` (D done exiting, F failed, S shutting down) and close gracefully.

        Closing a socket with unread data (a ping) makes the kernel send a reset, which can
        destroy the message in flight; so half-close and read until the peer closes (it does so
        on any of these codes), for at most wait_s.
        """
        if self.leaving:
            return
        self.leaving = True  # from now on the heartbeat thread ignores EOFs
        with self.lock:
            conns = list(self.peers)
        for conn in conns:
            try:
                conn.send(code)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                conns.remove(conn)
        deadline = time.monotonic() + wait_s
        with selectors.DefaultSelector() as sel:
            for conn in conns:
                sel.register(conn, selectors.EVENT_READ)
            while sel.get_map() and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    try:
                        if key.fileobj.recv(4096):
                            continue
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        pass
                    sel.unregister(key.fileobj)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for conn in self.peers:
            sel.register(conn, selectors.EVENT_READ)
        if self.wake_r is not None:
            sel.register(self.wake_r, selectors.EVENT_READ)
        next_ping = 0.0
        while not self.leaving:
            now = time.monotonic()
            if now >= next_ping:
                self.say(b"P")
                next_ping = now + self.interval
            for key, _ in sel.select(timeout=self.interval):
                if key.fileobj is self.wake_r:
                    signum = self.wake_r.recv(1)[0]
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        _signal(signum)
                elif not self.leaving:  # leave() owns the sockets now
                    self._read(key.fileobj, sel)
            now = time.monotonic()
            for rank, host, seen, _ in list(self.peers.values()):
                if now - seen > self.timeout and not self.leaving:
                    self._lost(rank, host, f"no heartbeat for {now - seen:.0f} s")

    def _read(self, conn, sel) -> None:
        peer = self.peers[conn]
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if self.leaving:
            return
        if not data:
            self._lost(peer[0], peer[1], "its process ended during its exit teardown, before MPI "
                       "and the process group were finished (killed or crashed at exit)" if peer[3]
                       else "connection closed without a goodbye (killed or crashed)")
        peer[2] = time.monotonic()
        if b"B" in data:
            peer[3] = True
        if any(c in data for c in (b"D", b"F", b"S")):
            # close our side first: the peer is waiting for it before it exits (see leave)
            sel.unregister(conn)
            with self.lock:
                del self.peers[conn]
            conn.close()
        if b"F" in data:
            self._lost(peer[0], peer[1], "it reported a failure (traceback in its log)")
        if b"S" in data:
            _shutdown(signal.SIGTERM, f"rank {peer[0]} on {peer[1]} is shutting down")
        if b"T" in data:
            _signal(signal.SIGTERM, f"rank {peer[0]} on {peer[1]} got a signal")

    def _lost(self, rank: int, host: str, why: str) -> None:
        log.critical("%s: lost rank %d on %s: %s; ending the job", _where(), rank, host, why)
        # during the exit teardown the main thread may be inside MPI_Finalize, which MPI_Abort
        # from this thread would race: exit instead (the launcher sees a failed rank)
        _die(1, mpi_abort=not self.exiting)


def _reachable_host(info: RankInfo) -> str:
    if envs.get("RANKSERVE_MASTER_ADDR"):
        return envs.get("RANKSERVE_MASTER_ADDR")
    return "127.0.0.1" if info.local_world_size == info.world_size else info.host


def _readline(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(256)
        if not chunk:
            raise ConnectionError("heartbeat peer closed during handshake")
        buf += chunk
    return buf.decode().strip()
