"""Sleep mode, weight updates and the host KV tier through the live server, one process and
`mpiexec -n 2 ... --tp 2` (every rank sleeps, wakes and loads): the HTTP answers (200, 409 while
busy, 503 while asleep), the same greedy tokens after waking, the new model's tokens after
new weights (from disk, and from a trainer's process group), a prefix served from the host tier
(usage and /metrics), all with the single-process LLM's tokens as the reference."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rankserve import LLM
from test_server import Server, free_port, metric
from test_sleep import PROMPTS, SMALL, checkpoint_manifest, greedy, perturbed_copy, start_trainer

KEY = "sk-sleep"
FLAGS = ("--enable-sleep-mode", "--kv-offload-size", "0.01", "--num-gpu-blocks-override", "16",
         "--block-size", "16", "--max-model-len", "256", "--api-key", KEY)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    a = checkpoint("LlamaForCausalLM")
    b = perturbed_copy(a, tmp_path_factory.mktemp("llama_b") / "ckpt")
    return a, b, {p: greedy(LLM(p, **SMALL)) for p in (a, b)}


def exercise(url: str, models, engine_ranks: int) -> None:
    a, b, want = models
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def complete(prompt, max_tokens=12, **extra):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True,
                                               "return_token_ids": True, **extra})
        return r

    def greedy_http():
        return [complete(p).json()["choices"][0]["token_ids"] for p in PROMPTS]

    def metrics():
        return httpx.get(url + "/metrics").text

    assert greedy_http() == want[a]

    # busy: a sleep while a request runs is refused (409), not waited for (on a loaded machine
    # the request may finish before the sleep arrives: then it sleeps, wakes and tries again)
    for _ in range(5):
        long = threading.Thread(target=complete, args=([5, 6, 7], 240))
        long.start()
        deadline = time.monotonic() + 30
        while metric(metrics(), "rankserve:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = http.post("/sleep", params={"level": 1})
        long.join()
        if r.status_code != 200:
            break
        assert http.post("/wake_up").status_code == 200
    assert r.status_code == 409 and "running" in r.json()["error"]["message"], r.text

    # level 1: requests get a 503 until both stages are awake; then the same tokens
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 200 and r.json()["is_sleeping"], r.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    r = complete(PROMPTS[0])
    assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/health").status_code == 200
    assert metric(metrics(), "rankserve:engine_sleep_level") == 1
    assert http.post("/wake_up", params={"tags": "weights"}).json()["asleep"] == ["kv_cache"]
    assert complete(PROMPTS[0]).status_code == 503
    assert http.post("/wake_up", params={"tags": "kv_cache"}).json()["is_sleeping"] is False
    assert metric(metrics(), "rankserve:engine_sleep_level") == 0
    assert greedy_http() == want[a]

    # the host tier: a prefix the 16-block device tier evicted comes back from host memory
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(100)]
    first = complete(shared, 4).json()
    for _ in range(3):
        complete([rng.randrange(3, 500) for _ in range(100)], 4)
    hits = metric(metrics(), "rankserve:host_prefix_cache_hits_total")
    again = complete(shared, 4).json()
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert metric(metrics(), "rankserve:host_prefix_cache_hits_total") - hits == 96
    assert metric(metrics(), "rankserve:host_kv_blocks_loaded_total") >= 6

    # level 2, RL-style: wake the weights, load a new checkpoint, wake the KV cache. The
    # arguments may come as a JSON body too (not ignored: level 1 for {"level": 2} would keep
    # the weights in host memory); an unknown field or a conflict with the query is a 400
    r = http.post("/sleep", json={"levle": 2})
    assert r.status_code == 400 and "levle" in r.json()["error"]["message"], r.text
    r = http.post("/sleep", params={"level": 1}, json={"level": 2})
    assert r.status_code == 400 and "level" in r.json()["error"]["message"], r.text
    r = http.post("/sleep", json={"level": 2})
    assert r.status_code == 200 and r.json()["level"] == 2, r.text
    assert http.post("/wake_up", json={"tags": ["weights"]}).json()["asleep"] == ["kv_cache"]
    r = http.post("/update_weights_from_disk", json={"model_path": b})
    assert r.status_code == 200 and r.json()["success"], r.text
    http.post("/wake_up")
    assert greedy_http() == want[b]
    # vLLM's level 2 flow: the weights the engine started with (A), reloaded in place on every rank
    http.post("/sleep", params={"level": 2})
    http.post("/wake_up", params={"tags": "weights"})
    r = http.post("/collective_rpc", json={"method": "reload_weights"})
    assert r.status_code == 200 and r.json() == {"results": [None] * engine_ranks}, r.text
    http.post("/wake_up", params={"tags": "kv_cache"})
    assert greedy_http() == want[a]
    r = http.post("/collective_rpc", json={"method": "load_model"})
    assert r.status_code == 400 and "load_model" in r.json()["error"]["message"], r.text
    r = http.post("/update_weights_from_disk", json={"model_path": b})
    assert r.status_code == 200 and greedy_http() == want[b], r.text
    r = http.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]

    # a trainer broadcasts A's weights back over a group of its own (gloo on CPU)
    port = free_port()
    trainer = start_trainer(a, port, 1 + engine_ranks)
    try:
        r = http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 1 + engine_ranks, "group_name": "weight_update_group", "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        r = http.post("/update_weights_from_distributed", json=checkpoint_manifest(a))
        assert r.status_code == 200 and r.json()["success"], r.text
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, out
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert http.post("/destroy_weights_update_group", json={}).status_code == 200
    assert greedy_http() == want[a]


def test_server_sleep_weights_host_tier(models):
    s = Server(models[0], *FLAGS)
    try:
        exercise(s.url, models, 1)
    finally:
        assert s.stop() == 0


def test_admin_routes_without_sleep_mode_are_400(models):
    s = Server(models[0], "--max-model-len", "256", "--num-gpu-blocks-override", "16")
    try:
        for path in ("/sleep", "/wake_up"):
            r = httpx.post(s.url + path)
            assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/is_sleeping").json() == {"is_sleeping": False}
        r = httpx.post(s.url + "/update_weights_from_distributed", json={"names": ["x"]})
        assert r.status_code == 400 and "go together" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": "/x", "bogus": 1})
        assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
        # a query parameter these routes do not take is refused, not ignored: /sleep?levle=2 as
        # a level 1 sleep, vLLM's /sleep?tags=kv_cache as a sleep of everything, or
        # /wake_up?tag=weights as a wake-up of both would each do what was not asked
        for path, query in (("/sleep", "levle=2"), ("/sleep", "tags=kv_cache"), ("/sleep", "mode=abort"),
                            ("/wake_up", "tag=weights"),
                            ("/reset_prefix_cache", "reset_running_requests=true")):
            r = httpx.post(f"{s.url}{path}?{query}")
            name = query.partition("=")[0]
            assert r.status_code == 400 and name in r.json()["error"]["message"], (path, query, r.text)
    finally:
        assert s.stop() == 0


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_mpi_tp2_server_sleep_weights_host_tier(models):
    """The same under `mpiexec -n 2 rankserve serve --tp 2`: rank 0 broadcasts every admin call."""
    port = free_port()
    proc = subprocess.Popen(
        ["mpiexec", "-n", "2", sys.executable, "-m", "rankserve.launch", "serve", models[0], "--tp", "2",
         "--port", str(port), *FLAGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("rankserve: serving" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        exercise(f"http://127.0.0.1:{port}", models, 2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{''.join(lines)[-3000:]}") from e
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
