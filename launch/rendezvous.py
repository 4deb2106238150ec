"""Rendezvous without MPI (plain `srun`): rank 0 binds, the others find it, jobs never mix.

Deriving one port from the job and step ids collides (step 7 of job J and step 0 of job J+1
landed on the same port: one job's rank 0 failed with EADDRINUSE and its rank 1 joined the other
job's store and hung). Instead:

- every rank computes the same short list of candidate ports from the job's token;
- rank 0 listens on the first candidate that is free (a "beacon"), and starts the torch
  TCPStore on a port the kernel picks (port 0: nothing to collide with);
- every other rank walks the candidates on rank 0's host, sends the token and gets the store's
  port back only from the beacon whose token matches. A port held by another job's beacon, or by
  any other program, answers something else and is skipped, so a rank can never join a store of
  another job.

The token names the cluster, job and step (`rankserve slurm <cluster>:<job>.<step>`), unique
while the step runs.
"""
from __future__ import annotations

import socket
import threading
import time
import zlib
from typing import Mapping

_BASE, _SPAN, _STRIDE = 15000, 15000, 7919  # below Linux's ephemeral range (32768+); 7919 is prime
NUM_CANDIDATES = 32
_REPLY_TIMEOUT_S = 2.0


def slurm_token(env: Mapping[str, str]) -> str:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return f"rankserve slurm {env.get('SLURM_CLUSTER_NAME', '')}:{env.get('SLURM_JOB_ID', '0')}.{step}"


def candidate_ports(token: str, n: int = NUM_CANDIDATES) -> list[int]:
    """The same n distinct ports on every rank of one step; different steps start elsewhere."""
    seed = zlib.crc32(token.encode())
    return [_BASE + (seed + i * _STRIDE) % _SPAN for i in range(n)]


class Beacon:
    """Rank 0's side: answers `token` with `payload` until closed; other tokens get `wrong job`."""

    def __init__(self, token: str, candidates: list[int], payload: str):
        self.token, self.payload = token, payload
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
        self.sock.settimeout(0.2)
        self._closed = False
        threading.Thread(target=self._serve, name="rankserve-rendezvous", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(_REPLY_TIMEOUT_S)
                    asked = _readline(conn)
                    conn.sendall(f"{self.payload if asked == self.token else 'wrong job'}\n".encode())
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def find(host: str, token: str, candidates: list[int], timeout_s: float) -> str:
    """Other ranks' side: the payload of the beacon of `token` on `host` (waits for it to start)."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, str] = {}
    while True:
        for port in candidates:
            try:
                with socket.create_connection((host, port), timeout=_REPLY_TIMEOUT_S) as conn:
                    conn.settimeout(_REPLY_TIMEOUT_S)
                    conn.sendall(f"{token}\n".encode())
                    reply = _readline(conn)
            except OSError:  # nobody there (yet), or not a beacon
                continue
            if reply and reply != "wrong job":
                return reply
            seen[port] = reply or "no answer"
        if time.monotonic() > deadline:
            others = ", ".join(f"{p}: {r}" for p, r in seen.items()) or "none answered"
            raise TimeoutError(f"rendezvous: no rank 0 of {token!r} on {host} after {timeout_s:.0f} s "
                               f"(other listeners on the candidate ports: {others})")
        time.sleep(0.2)


def _readline(conn: socket.socket, limit: int = 256) -> str:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < limit:
        chunk = conn.recv(limit)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()
