"""Streams in flight when the job ends under mpiexec: they end with an error event, never cut,
and Ctrl-C prints no traceback (the API process is outside the launcher's process group)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import STORIES_EMBEDDED
from test_server import free_port

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")]


class Job:
    def __init__(self, *flags: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "serve",
             str(STORIES_EMBEDDED), "--tp", "2", "--port", str(self.port), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=dict(os.environ, RANKSERVE_HEARTBEAT_TIMEOUT="20"))
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 180
        while not any("rankserve: serving" in x for x in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text[-3000:]
            time.sleep(0.1)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def pid(self, rank: int) -> int:
        return int(re.search(rf"rank {rank}/2 host=\S+ pid=(\d+)", self.text).group(1))

    def stream(self, max_tokens: int = 480) -> tuple[threading.Thread, dict]:
        """A streaming completion; returns (thread, result) once its first token arrived."""
        result: dict = {"events": []}
        first = threading.Event()

        def run():
            body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body,
                                  timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            result["events"].append(line[6:])
                            first.set()
            except httpx.HTTPError as e:
                result["cut"] = repr(e)
            first.set()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert first.wait(60)
        return t, result

    def finish(self, timeout=60) -> str:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail("job did not end:\n" + self.text[-3000:])
        time.sleep(1.0)  # the API process's last lines
        return self.text


def _ended_with_error(t, result, log):
    t.join(30)
    assert "cut" not in result, f"stream cut without an error event: {result['cut']}\n{log[-3000:]}"
    events = result["events"]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]


def test_sigkilled_rank_under_mpiexec_gives_streams_an_error_event():
    job = Job()
    t, result = job.stream()
    os.kill(job.pid(1), signal.SIGKILL)
    log = job.finish()
    _ended_with_error(t, result, log)


def test_ctrl_c_under_mpiexec_no_traceback_and_streams_end_with_an_event():
    job = Job()
    t, result = job.stream()
    os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
    log = job.finish()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    t.join(30)
    assert "cut" not in result, f"stream cut: {result['cut']}\n{log[-3000:]}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_under_mpiexec_drains_requests_in_flight(sig):
    """scancel / the time limit (SIGTERM) or Ctrl-C (SIGINT, which mpiexec passes to every rank)
    give a multi-rank server's requests in flight --shutdown-timeout to finish, as one process
    does: no new requests, the stream ends normally, every rank exits 0."""
    job = Job("--shutdown-timeout", "30")
    t, result = job.stream(max_tokens=60)
    job.proc.send_signal(sig)  # to mpiexec, as scancel / a terminal does
    log = job.finish()
    t.join(30)
    events = result["events"]
    assert "cut" not in result and events[-1] == "[DONE]", log[-3000:]
    last = json.loads(events[-2])
    assert "error" not in last and last["choices"][0]["finish_reason"] == "length", (events[-3:], log[-3000:])
    assert job.proc.returncode == 0, log[-3000:]
