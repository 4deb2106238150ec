"""Process lifecycle: with the engine reached over tcp://, the API answers 503 once the engine
died, then exits. (API death stopping the engine: end of test_server_chat.py; SIGTERM: the
teardown of test_server.py.)"""
from __future__ import annotations

import time

import httpx

from test_server import STORIES_TEXT, Server, free_port


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_engine_death_gives_503_then_api_exits():
    s = Server("--engine-address", f"tcp://127.0.0.1:{free_port()}")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time",
                                                        "max_tokens": 8, "temperature": 0})
        assert STORIES_TEXT.startswith(r.json()["choices"][0]["text"])
        (api,) = s.children()
        s.proc.kill()  # SIGKILL: no goodbye from the engine
        s.proc.wait()
        assert wait_for(lambda: httpx.get(s.url + "/health").status_code == 503, 10)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]

        def gone():
            try:
                return open(f"/proc/{api}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True
        assert wait_for(gone, 30)  # the orphaned API process does not linger
    finally:
        s.stop()
