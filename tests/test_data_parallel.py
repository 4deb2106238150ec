"""Data parallelism (`--data-parallel-size`): the load balancer's choices, the rank layout, the
combinations refused with a clear error, and a real `mpiexec -n 4 rankserve serve
--data-parallel-size 2 --tp 2` on CPU: concurrent requests give the single-rank greedy tokens,
both replicas serve (per-replica /metrics), shared prefixes stick to one replica, and a rank of
replica 1 that fails ends the job with the rank named."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rankserve import LLM, SamplingParams
from rankserve.runtime.config import ConfigError, EngineConfig, ParallelConfig
from rankserve.runtime.parallel import build_parallel_info, global_rank, replica_ranks
from rankserve.runtime.serve.load_balancer import LoadBalancer
from test_server import free_port

from conftest import STORIES_EMBEDDED

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw", "Lily and Tom were",
           "One day, a cat", "The sun was"]


# ---- the balancer --------------------------------------------------------------------------------
def test_balancer_spreads_load_and_follows_prefixes():
    lb = LoadBalancer(2, block_size=4, slack=2)
    # distinct prompts alternate while loads are equal, then go where there is room
    picks = [lb.pick([i, i + 1, i + 2, i + 3, 99]) for i in range(0, 40, 10)]
    assert picks == [0, 1, 0, 1] and lb.inflight == [2, 2]
    lb.finished(1, 2)
    assert lb.pick([7, 7, 7, 7]) == 1
    # a queue and a full KV cache weigh on top of the requests in flight
    lb.record_stats(1, num_waiting=5, kv_usage=0.9)
    assert lb.pick([8, 8, 8, 8]) == 0
    lb.record_stats(1, num_waiting=0, kv_usage=0.0)

    # a shared prefix sticks to the replica that has it cached ...
    lb = LoadBalancer(2, block_size=4, slack=2)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    first = lb.pick(shared + [1])
    assert [lb.pick(shared + [i]) for i in range(2, 4)] == [first, first]  # within the slack
    assert lb.affinity_hits >= 1
    # ... the longest remembered prefix wins ...
    other = 1 - first
    lb.finished(first, 3)
    lb.pick([40, 41, 42, 43])  # to keep the loads even
    longer = shared + [70, 71, 72, 73]
    lb.prefixes[lb._block_hashes(longer, None)[-1]] = other
    assert lb.pick(longer + [0]) == other
    # ... until its replica is busier than the least loaded by more than the slack
    lb = LoadBalancer(2, block_size=4, slack=2)
    e = lb.pick(shared)
    lb.inflight[e] += 5
    assert lb.pick(shared + [1]) == 1 - e
    # an adapter (salt) has its own prefix space; short prompts have no block to remember
    assert lb._block_hashes(shared, "lora-a") != lb._block_hashes(shared, None)
    assert lb._block_hashes([1, 2, 3], None) == []
    assert LoadBalancer(1).pick([1] * 64) == 0


# ---- layout and refused combinations ------------------------------------------------------------
def test_rank_layout():
    pc = ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=2)
    assert replica_ranks(pc) == [[0, 1], [2, 3]] and pc.total_ranks == 4 and pc.world_size == 2
    pi = build_parallel_info(3, 4, pc)  # tp 1: no process groups needed
    assert (pi.dp_rank, pi.pp_rank, pi.tp_rank) == (1, 1, 0)
    assert global_rank(pi, 0) == 2  # the previous stage of replica 1, not of replica 0
    with pytest.raises(ConfigError, match="--data-parallel-size 2 = 4 ranks, but the job has 2"):
        build_parallel_info(0, 2, pc)


def test_refused_combinations():
    with pytest.raises(ConfigError, match="wide EP"):
        EngineConfig.from_kwargs(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="--data-parallel-size must be >= 1"):
        EngineConfig.from_kwargs(dp=0)
    with pytest.raises(ConfigError, match="rankserve serve --data-parallel-size"):
        LLM(str(STORIES_EMBEDDED), data_parallel_size=2)
    from rankserve.launch.startup import run_on_ranks  # generate and the benches
    from rankserve.launch.preflight import LaunchError  # one line from one rank, on every launcher
    with pytest.raises(LaunchError, match="served by `rankserve serve` only"):
        run_on_ranks(EngineConfig.from_kwargs(dp=2), lambda llm: None)
    r = subprocess.run([sys.executable, "-m", "rankserve.launch", "serve", "--dp", "2", "--tp", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs 4 ranks" in r.stderr and "mpirun -np 4" in r.stderr, r.stderr[-2000:]


# ---- the real thing ------------------------------------------------------------------------------
def metric_by_engine(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{re.escape(name)}{{([^}}]*)}} (\S+)$', text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
        out[engine] = out.get(engine, 0.0) + float(m.group(2))
    return out


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_mpi_dp2_tp2_server():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # rank 3 (replica 1's TP rank 1) raises at its 260th step: later than the checks below take
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               RANKSERVE_HEARTBEAT_TIMEOUT="20", RANKSERVE_INJECT_FAULT="3:260")
    proc = subprocess.Popen(
        ["mpiexec", "-n", "4", sys.executable, "-m", "rankserve.launch", "serve",
         "--data-parallel-size", "2", "--tp", "2", "--kv-cache-memory-gb", "0.02", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(str(STORIES_EMBEDDED)).generate(PROMPTS, sp)]
    try:
        deadline = time.monotonic() + 240
        while not any("rankserve: serving" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        http = httpx.Client(base_url=url, timeout=120)

        def complete(prompt):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        # concurrent requests over both replicas: the single-rank greedy tokens, every time
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, PROMPTS * 4))
        assert got == want * 4
        text = http.get("/metrics").text
        served = metric_by_engine(text, "rankserve:request_success_total")
        assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
        assert sum(served.values()) == 4 * len(PROMPTS)
        gen = metric_by_engine(text, "rankserve:generation_tokens_total")
        assert sum(gen.values()) == 16 * 4 * len(PROMPTS) and min(gen.values()) > 0, gen

        # shared prefixes (3 KV blocks) go to the replica that cached them
        prefix = list(range(100, 148))
        before = metric_by_engine(http.get("/metrics").text, "rankserve:request_success_total")
        for i in range(4):
            r = http.post("/v1/completions", json={"prompt": prefix + [200 + i], "max_tokens": 2})
            assert r.status_code == 200, r.text
        after = metric_by_engine(http.get("/metrics").text, "rankserve:request_success_total")
        delta = sorted(after[e] - before.get(e, 0) for e in after)
        assert delta == [0, 4], (before, after)
        hits = metric_by_engine(http.get("/metrics").text, "rankserve:prefix_cache_hits_total")
        assert max(hits.values()) >= 3 * 32, hits

        # a rank of replica 1 fails (two long requests: one per replica, and replica 1 passes its
        # 260th step): the job ends, naming the rank, as for any rank
        def long_request(prompt):
            try:
                return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 260,
                                                          "ignore_eos": True}).status_code
            except httpx.HTTPError as e:  # the API process went down with the job
                return type(e).__name__
        with ThreadPoolExecutor(2) as pool:
            codes = list(pool.map(long_request, PROMPTS[:2]))
        proc.wait(90)
        reader.join(30)  # the last lines may still be in the pipe
        out = "".join(lines)
        assert proc.returncode != 0 and re.search(r"rank 3 on \S+ failed", out), out[-3000:]
        assert "injected fault" in out and codes != [200, 200], codes
    except AssertionError as e:
        raise AssertionError(f"{e}\n{''.join(lines)[-3000:]}") from e
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_torchrun_style_dp2_without_mpi():
    """Two ranks started the torchrun way (no MPI: gloo control channels, split per replica):
    `serve --dp 2` answers with the single-rank tokens from both replicas."""
    port, store = free_port(), free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store),
               RANKSERVE_HEARTBEAT_TIMEOUT="20")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "rankserve.launch", "serve", "--dp", "2", "--kv-cache-memory-gb", "0.02",
         "--port", str(port)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(2)]
    lines: list[str] = []
    for p in procs:
        threading.Thread(target=lambda p=p: lines.extend(p.stdout), daemon=True).start()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(str(STORIES_EMBEDDED)).generate(PROMPTS, sp)]
    try:
        deadline = time.monotonic() + 180
        while not any("rankserve: serving" in x for x in lines):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)

        def complete(prompt):
            return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, PROMPTS * 2)) == want * 2
        served = metric_by_engine(httpx.get(f"http://127.0.0.1:{port}/metrics").text,
                                  "rankserve:request_success_total")
        assert set(served) == {"0", "1"} and sum(served.values()) == 2 * len(PROMPTS), served
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
