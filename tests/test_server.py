"""Live server on the embedded stories260K: the real `rankserve serve` CLI as a subprocess, used
through the official openai client and raw HTTP (completions, errors, disconnects, processes)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. "
                "One day, she saw a big, red ball.")
API_KEY = "sk-rankserve-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m rankserve.launch serve ARGS --port P` (under `mpiexec -n MPI` if given), ready
    once it printed its URL."""

    def __init__(self, *args: str, timeout: float = 180, env: dict | None = None, mpi: int = 0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mpi = mpi
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(
            (["mpiexec", "-n", str(mpi)] if mpi else [])
            + [sys.executable, "-m", "rankserve.launch", "serve", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=bool(mpi))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not any("rankserve: serving" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
            time.sleep(0.1)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def children(self) -> list[int]:
        """Processes whose parent is the engine process."""
        kids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    kids.append(int(d))
        return kids

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            if self.mpi:  # every rank (mpiexec's session)
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self.mpi:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(text: str, name: str) -> float:
    """Sum of the samples of one metric (all label sets)."""
    vals = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert vals, f"{name} not in /metrics"
    return sum(vals)


@pytest.fixture(scope="module")
def step_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("steps") / "steps.csv"


@pytest.fixture(scope="module")
def server(step_log):
    s = Server("--api-key", API_KEY, "--max-num-seqs", "256", env={"RANKSERVE_STEP_LOG": str(step_log)})
    yield s
    assert s.stop() == 0  # SIGTERM shuts both processes down cleanly
    assert not s.children()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as c:
        yield c


def model_of(client) -> str:
    return client.models.list().data[0].id



def test_api_server_runs_uvloop(server):
    """uvloop is a dependency: the API process runs its event loop (uvicorn.run would pick it;
    our own asyncio.run did not, so the server ran on asyncio's loop)."""
    import importlib.util
    assert importlib.util.find_spec("uvloop") is not None
    assert any("API server event loop: uvloop" in line for line in server.lines), server.lines[-20:]

def test_one_api_child_process(server):
    kids = server.children()
    assert len(kids) == 1, kids
    cmd = Path(f"/proc/{kids[0]}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "rankserve.runtime.serve.app" in cmd


def test_service_endpoints(server, client, http):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.endswith("stories260K")
    assert models[0].model_extra["max_model_len"] == 512


def test_greedy_completion_is_the_known_story(client):
    r = client.completions.create(model=model_of(client), prompt="Once upon a time",
                                  max_tokens=30, temperature=0)
    assert STORIES_TEXT.startswith(r.choices[0].text) and len(r.choices[0].text) > 60
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 30, 35)


def test_step_log_records_every_step(server, client, step_log):
    """RANKSERVE_STEP_LOG: one CSV line per engine step (40 one-token requests at once, then
    four of 200 tokens)."""
    model = model_of(client)
    r = client.completions.create(model=model, prompt=["Once upon a time"] * 40, max_tokens=1)
    assert len(r.choices) == 40
    for _ in range(4):
        client.completions.create(model=model, prompt="Once", max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sum(int(row.split(",")[3]) for row in step_log.read_text().splitlines()) >= 40 + 800
    rows = [line.split(",") for line in step_log.read_text().splitlines()]
    assert rows and all(len(row) == 12 for row in rows)
    gaps = [float(row[1]) for row in rows]
    assert all(0 <= g < 60 for g in gaps)
    assert sum(int(row[2]) for row in rows) >= 40 * 5  # the prompts' tokens
    assert max(int(row[4]) for row in rows) >= 1
    from rankserve.runtime.bench.steplog import load, summarise
    text = summarise(load(str(step_log)))
    assert "gap ms p50" in text and "[0, 1)" in text and "host, decode-only steps" in text, text


def test_streamed_completion_matches_with_usage(client):
    full = client.completions.create(model=model_of(client), prompt="Once upon a time",
                                     max_tokens=20, temperature=0).choices[0].text
    chunks = list(client.completions.create(
        model=model_of(client), prompt="Once upon a time", max_tokens=20, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == 5


def test_n2_and_seed_reproducibility(client):
    kw = dict(model=model_of(client), prompt="Once upon a time", max_tokens=12, temperature=1.0,
              n=2, seed=123)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in a.choices]
    other = client.completions.create(**dict(kw, seed=7))
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_stop_string(client):
    r = client.completions.create(model=model_of(client), prompt="Once upon a time",
                                  max_tokens=30, temperature=0, stop=["Lily"])
    c = r.choices[0]
    assert c.text == ", there was a little girl named "
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == "Lily"


def test_logprobs(client):
    r = client.completions.create(model=model_of(client), prompt="Once upon a time",
                                  max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and p <= 0
        assert max(top.values()) == pytest.approx(p)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(p)


def test_batch_and_token_prompts(client):
    r = client.completions.create(model=model_of(client), prompt=["Once upon a time", "Lily"],
                                  max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert STORIES_TEXT.startswith(r.choices[0].text)
    assert r.usage.completion_tokens == 10
    r = client.completions.create(model=model_of(client), prompt=[1, 403, 407, 261, 378],
                                  max_tokens=5, temperature=0)
    assert STORIES_TEXT.startswith(r.choices[0].text) and r.usage.prompt_tokens == 5


def test_tokenize_detokenize_render(http):
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()
    assert ids["tokens"] == [1, 403, 407, 261, 378] and ids["count"] == 5
    assert http.post("/detokenize", json={"tokens": ids["tokens"][1:]}).json()["prompt"] == \
        "Once upon a time"
    assert http.post("/detokenize", json={"tokens": [1, 99999]}).status_code == 400
    r = http.post("/v1/completions/render", json={"prompt": "Once upon a time"}).json()
    assert r["prompts"][0]["prompt_token_ids"] == [1, 403, 407, 261, 378]


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # not under /v1
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"x-api-key": API_KEY})
    assert r.status_code == 200


@pytest.mark.parametrize("body,status,needle", [
    ('{"prompt": "hi", "max_tokens": ', 400, "not valid JSON"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"max_tokens": 3}, 400, "prompt: Field required"),
    ({"prompt": "hi", "model": "gpt-17"}, 404, "gpt-17"),
    ({"prompt": "word " * 600}, 400, "max_model_len"),
    ({"prompt": [1, 99999]}, 400, "token ids"),
    ({"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
])
def test_bad_completion_requests(http, body, status, needle):
    if isinstance(body, str):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    # and the server keeps serving
    ok = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_requests_stream_and_chat(http, client):
    r = http.post("/v1/completions", json={"prompt": "word " * 600, "stream": True})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_of(client), prompt="hi", max_tokens=0)


def test_metrics_count_requests(http):
    before = http.get("/metrics").text
    http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 7,
                                       "temperature": 0})
    after = http.get("/metrics").text
    for name, grew in (("rankserve:request_success_total", 1),
                       ("rankserve:generation_tokens_total", 7),
                       ("rankserve:time_to_first_token_seconds_count", 1),
                       ("rankserve:inter_token_latency_seconds_count", 6),
                       ("rankserve:e2e_request_latency_seconds_count", 1)):
        assert metric(after, name) - metric(before, name) == grew, name
    assert metric(after, "rankserve:prompt_tokens_total") >= 5
    assert metric(after, "rankserve:prefix_cache_queries_total") >= 5
    assert 'finished_reason="length"' in after
    assert metric(after, "rankserve:kv_cache_blocks_total") > 0
    assert metric(after, "rankserve:num_requests_running") == 0


PHASES = ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token")


def test_metrics_request_phases(http):
    """vLLM's per-request phase histograms, from the engine's timestamps: a length finish, a
    one-token request (no time per output token) and a stop string the API matched."""
    def snapshot() -> dict[str, float]:
        text = http.get("/metrics").text
        names = {p: f"request_{p}_seconds" for p in PHASES} | {"e2e": "e2e_request_latency_seconds"}
        return {f"{p}_{k}": metric(text, f"rankserve:{name}_{k}")
                for p, name in names.items() for k in ("count", "sum")}
    before = snapshot()
    for body in ({"max_tokens": 7}, {"max_tokens": 1}, {"max_tokens": 30, "stop": ["Lily"]}):
        r = http.post("/v1/completions", json={"prompt": "Once upon a time", "temperature": 0, **body})
        assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    d = {k: v - before[k] for k, v in snapshot().items()}
    assert {p: d[f"{p}_count"] for p in PHASES} == dict.fromkeys(PHASES[:4], 3) | {
        "time_per_output_token": 2}
    assert all(d[f"{p}_sum"] >= 0 for p in PHASES)
    assert d["decode_time_sum"] > 0 and d["time_per_output_token_sum"] > 0
    # the running phase is prefill then decode; queued → last token lies within the e2e latency
    assert abs(d["prefill_time_sum"] + d["decode_time_sum"] - d["inference_time_sum"]) < 1e-6
    assert d["queue_time_sum"] + d["inference_time_sum"] <= d["e2e_sum"]


def wait_idle(server, timeout: float = 30) -> str:
    """/metrics once no request runs and no block is in use (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics").text
        idle = metric(text, "rankserve:kv_cache_blocks_used") == 0 and \
            metric(text, "rankserve:num_requests_running") == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def finished(text: str, reason: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf'^rankserve:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$', text, re.M))


def test_disconnects_free_every_block(server):
    """200 clients that hang up after the first chunk of a long stream: all blocks come back."""
    async def one(c: httpx.AsyncClient):
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            await asyncio.gather(*(one(c) for _ in range(200)))
    before = wait_idle(server)
    asyncio.run(main())
    text = wait_idle(server)
    assert metric(text, "rankserve:kv_cache_blocks_used") == 0
    assert metric(text, "rankserve:num_requests_running") == 0
    assert metric(text, "rankserve:kv_cache_usage_perc") == 0
    assert finished(text, "abort") - finished(before, "abort") == 200
    assert finished(text, "length") == finished(before, "length")
    # as vLLM's: requests the client aborted get no phase histograms (request_success has them)
    for p in PHASES:
        name = f"rankserve:request_{p}_seconds_count"
        assert metric(text, name) == metric(before, name), p


def test_non_streaming_disconnects_abort(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}
            results = await asyncio.gather(*(c.post("/v1/completions", json=body)
                                             for _ in range(10)), return_exceptions=True)
        assert all(isinstance(r, httpx.TimeoutException) for r in results)
    before = wait_idle(server)
    asyncio.run(main())
    text = wait_idle(server)
    assert metric(text, "rankserve:kv_cache_blocks_used") == 0
    assert finished(text, "abort") - finished(before, "abort") == 10
    assert finished(text, "length") == finished(before, "length")


def test_idle_engine_does_not_spin(server):
    def cpu_seconds():
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before = cpu_seconds()
    time.sleep(2)
    assert cpu_seconds() - before < 0.3
