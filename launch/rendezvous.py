"""Rendezvous without MPI (plain `srun`): rank 0 binds, the others find it, jobs never mix.

Deriving one port from the job and step ids collides (step 7 of job J and step 0 of job J+1
landed on the same port: one job's rank 0 failed with EADDRINUSE and its rank 1 joined the other
job's store and hung). Instead:

- every rank computes the same short list of candidate ports from the job's token;
- rank 0 listens on the first candidate that is free (a "beacon"), and starts the torch
  TCPStore on a port the kernel picks (port 0: nothing to collide with);
- every other rank walks the candidates on rank 0's host and checks in with the token, its rank
  and host. A port held by another job's beacon, or by any other program, answers something else
  and is skipped, so a rank can never join a store of another job. The beacon answers `wait` and
  keeps the connection; once every rank has checked in it sends them all the store's port.

The rendezvous is also where a failed start is shared (srun without `--kill-on-bad-exit` leaves
the other ranks running): a rank whose start fails (MODEL missing on its node, a bad flag)
checks in with its error; rank 0 tells every rank waiting, and every one that checks in later,
that the start failed, then exits naming it. A rank 0 that fails itself opens a beacon that
only says so. A waiting rank whose connection to rank 0 ends without an answer knows rank 0 is
gone; rank 0 likewise learns of a waiting rank that ends. So no rank waits for a dead one.

The token names the cluster, job and step (`rankserve slurm <cluster>:<job>.<step>`), unique
while the step runs.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
import zlib
from typing import Mapping

log = logging.getLogger(__name__)

_BASE, _SPAN, _STRIDE = 15000, 15000, 7919  # below Linux's ephemeral range (32768+); 7919 is prime
NUM_CANDIDATES = 32
_REPLY_TIMEOUT_S = 2.0
LINGER_S = 60.0  # after a failed start, rank 0 keeps telling ranks that check in late this long
NOTICE_S = 60.0  # a rank whose start failed looks this long for rank 0 to tell it

Failure = tuple[int, str, str]  # (rank, host, error)


class StartupFailed(Exception):
    """The start failed on some rank: `failures` as far as this rank knows them."""

    def __init__(self, failures: list[Failure]):
        super().__init__("; ".join(f"rank {r} on {h}: {e}" for r, h, e in failures))
        self.failures = failures


class RankLost(ConnectionError):
    """Rank 0 went away while this rank waited for the others."""


def slurm_token(env: Mapping[str, str]) -> str:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return f"rankserve slurm {env.get('SLURM_CLUSTER_NAME', '')}:{env.get('SLURM_JOB_ID', '0')}.{step}"


def candidate_ports(token: str, n: int = NUM_CANDIDATES) -> list[int]:
    """The same n distinct ports on every rank of one step; different steps start elsewhere."""
    seed = zlib.crc32(token.encode())
    return [_BASE + (seed + i * _STRIDE) % _SPAN for i in range(n)]


class Beacon:
    """Rank 0's side: answers the ranks 1..world_size-1 of `token` (other tokens get `wrong job`)
    with `payload` once all have checked in, or with the first failure (`failure`: rank 0's own)."""

    def __init__(self, token: str, candidates: list[int], world_size: int, payload: str | None,
                 failure: Failure | None = None):
        self.token, self.payload, self.world_size = token, payload, world_size
        self.sock = None
        for port in candidates:
            try:
                self.sock = socket.create_server(("", port), backlog=64)
                break
            except OSError:
                continue
        if self.sock is None:
            raise RuntimeError(f"rendezvous: all {len(candidates)} candidate ports "
                               f"({candidates[0]}, ...) are in use on this host")
        self.port = self.sock.getsockname()[1]
        self.failures: list[Failure] = []
        self.failed_at: float | None = None
        self.arrived: set[int] = set()
        self.waiting: dict[socket.socket, tuple[int, str]] = {}
        self.settled = threading.Event()  # every rank checked in (and was answered, if failed)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._closed = False
        if failure is not None:
            self._fail(*failure)
        self._check_settled()
        threading.Thread(target=self._serve, name="rankserve-rendezvous", daemon=True).start()

    def wait(self, timeout_s: float, linger_s: float = LINGER_S) -> None:
        """Until every rank has checked in and got the payload. Raises StartupFailed once every
        rank has heard of a failure (or `linger_s` after it), TimeoutError after `timeout_s`."""
        deadline, said = time.monotonic() + timeout_s, False
        while not self.settled.wait(0.1):
            now = time.monotonic()
            if now > deadline or (self.failed_at is not None and now > self.failed_at + linger_s):
                break
            if self.failed_at is not None and now > self.failed_at + 2 and not said:
                said = True  # the error line waits until every rank knows: say why meanwhile
                missing = sorted(set(range(1, self.world_size)) - self.arrived)
                log.warning("rank %d on %s failed to start (%s); telling rank(s) %s when they "
                            "check in (at most %.0f s)", *self.failures[0],
                            ", ".join(map(str, missing)), linger_s)
        self.close()
        if self.failures:
            raise StartupFailed(sorted(self.failures))
        if not self.settled.is_set():
            missing = sorted(set(range(1, self.world_size)) - self.arrived)
            raise TimeoutError(f"rendezvous: rank(s) {', '.join(map(str, missing))} of {self.token!r} "
                               f"did not check in with rank 0 within {timeout_s:.0f} s")

    def close(self) -> None:
        self._closed = True  # the thread closes the sockets (it may be using them)

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._sel.select(timeout=0.2):
                    if key.fileobj is self.sock:
                        self._accept()
                    else:  # a waiting rank's connection: readable only once it is closed
                        self._hung_up(key.fileobj)
        finally:
            for conn in [self.sock, *self.waiting]:
                conn.close()
            self._sel.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        try:
            conn.settimeout(_REPLY_TIMEOUT_S)
            fields = _readline(conn).split("\t", 3)
            if fields[0] != self.token or len(fields) < 3 or not fields[1].isdigit() \
                    or not 0 < int(fields[1]) < self.world_size:
                conn.sendall(b"wrong job\n")
                conn.close()
                return
            rank, host = int(fields[1]), fields[2]
            self.arrived.add(rank)
            if len(fields) == 4:
                self._fail(rank, host, fields[3])
            if self.failures:
                _send_close(conn, self._failed_line())
            else:
                conn.sendall(b"wait\n")
                self.waiting[conn] = (rank, host)
                self._sel.register(conn, selectors.EVENT_READ)
        except OSError:
            conn.close()
        self._check_settled()

    def _hung_up(self, conn: socket.socket) -> None:
        rank, host = self.waiting.pop(conn)
        self._sel.unregister(conn)
        conn.close()
        self._fail(rank, host, "its process ended while it waited for the others")
        self._check_settled()

    def _fail(self, rank: int, host: str, error: str) -> None:
        self.failures.append((rank, host, error))
        if self.failed_at is None:
            self.failed_at = time.monotonic()
        for conn in list(self.waiting):  # tell the ranks that wait
            self._sel.unregister(conn)
            del self.waiting[conn]
            _send_close(conn, self._failed_line())

    def _failed_line(self) -> str:
        rank, host, error = self.failures[0]
        return "\t".join(["failed", str(rank), _field(host), _field(error)])

    def _check_settled(self) -> None:
        if not self.arrived.issuperset(range(1, self.world_size)):
            return
        if not self.failures:
            for conn in list(self.waiting):
                self._sel.unregister(conn)
                del self.waiting[conn]
                _send_close(conn, f"go\t{self.payload}")
        self.settled.set()


def join(host: str, token: str, candidates: list[int], rank: int, me: str, timeout_s: float,
         error: str | None = None) -> str:
    """Other ranks' side: check in with the beacon of `token` on `host` (waiting for it to
    start) and return its payload once every rank has checked in. With `error` (this rank's
    start failed) the beacon answers at once. Raises StartupFailed when the start failed
    somewhere, RankLost when rank 0 went away meanwhile, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    request = "\t".join([token, str(rank), _field(me)] + ([_field(error)] if error is not None else []))
    seen: dict[int, str] = {}
    while True:
        for port in candidates:
            reply = _ask(host, port, request, deadline)
            if reply is None:  # nobody there (yet), or not a beacon
                continue
            kind, _, rest = reply.partition("\t")
            if kind == "go":
                return rest
            if kind == "failed":
                r, h, e = (rest.split("\t", 2) + ["", ""])[:3]
                raise StartupFailed([(int(r) if r.isdigit() else -1, h, e)])
            if kind == "lost":
                raise RankLost(f"rank 0 on {host} closed the rendezvous without an answer "
                               "(it ended, or gave up waiting for a rank)")
            if kind == "timeout":
                raise TimeoutError(f"rendezvous: rank 0 on {host} still waited for other ranks of "
                                   f"{token!r} after {timeout_s:.0f} s")
            seen[port] = reply or "no answer"
        if time.monotonic() > deadline:
            others = ", ".join(f"{p}: {r}" for p, r in seen.items()) or "none answered"
            raise TimeoutError(f"rendezvous: no rank 0 of {token!r} on {host} after {timeout_s:.0f} s "
                               f"(other listeners on the candidate ports: {others})")
        time.sleep(0.2)


def _ask(host: str, port: int, request: str, deadline: float) -> str | None:
    """The beacon's final answer to `request` (`lost` if it hung up after `wait`), the reply of
    anything else listening on `port`, or None where nothing answers."""
    try:
        conn = socket.create_connection((host, port), timeout=_REPLY_TIMEOUT_S)
    except OSError:
        return None
    with conn, conn.makefile("rb") as lines:  # `wait` and the answer may come in one packet
        try:
            conn.settimeout(_REPLY_TIMEOUT_S)
            conn.sendall(f"{request}\n".encode())
            reply = lines.readline(4096).decode(errors="replace").strip()
        except OSError:
            return None
        if reply != "wait":
            return reply
        # rank 0's beacon: it answers once every rank is there
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            return lines.readline(4096).decode(errors="replace").strip() or "lost"
        except socket.timeout:
            return "timeout"  # the caller's deadline is over: it raises TimeoutError
        except OSError:
            return "lost"


def _field(text: str) -> str:
    return " ".join(text.split())[:2000]  # one line, no tabs


def _send_close(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(f"{line}\n".encode())
    except OSError:
        pass
    conn.close()


def _readline(conn: socket.socket, limit: int = 4096) -> str:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < limit:
        chunk = conn.recv(limit)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()
