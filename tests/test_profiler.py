"""Profiling a live engine (runtime/profiler.py): `--profiler-config` with vLLM's keys, then
LLM.start_profile / stop_profile, POST /start_profile and /stop_profile, `bench serve --profile`,
`generate --profiler-config`, one trace per rank under `mpiexec -n 2 --tp 2`."""
from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import torch
import pytest
from click.testing import CliRunner

from conftest import STORIES_EMBEDDED
from rankserve import LLM, SamplingParams
from rankserve.runtime.config import ConfigError
from rankserve.runtime.profiler import parse_profiler_config
from test_server import Server

RANKSERVE = [sys.executable, "-m", "rankserve.launch"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def torch_config(d, **kw) -> str:
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(d), **kw})


def check_trace(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events), path  # the model's ops


@pytest.mark.parametrize("value,msg", [
    ('{"profiler": "torch"}', "needs \"torch_profiler_dir\""),
    ('{"profiler": "nsys"}', "profiler must be one of torch, cuda"),
    ('{"profiler": "torch", "torch_profiler_dir": "d", "delay": 1}', "unsupported key(s) delay"),
    ('{"profiler": "torch", "torch_profiler_dir": "d", "torch_profiler_with_stack": "no"}',
     "torch_profiler_with_stack must be true or false"),
    ('{"profiler": "cuda", "torch_profiler_dir": "d"}', "torch_profiler_dir is for the torch profiler"),
    ('{"profiler": "cuda", "torch_profiler_record_shapes": true}', "apply to the torch profiler only"),
    ('{"torch_profiler_dir": "d"}', "say which profiler"),
    ("[1]", "must be a JSON object"),
    ("{", "must be a JSON object"),
])
def test_bad_profiler_config_is_named(tmp_path, monkeypatch, value, msg):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_profiler_config(value)
    assert "--profiler-config" in str(e.value) and msg in str(e.value)


def test_profiler_config_dir_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = parse_profiler_config('{"profiler": "torch", "torch_profiler_dir": "traces"}')
    assert p.torch_profiler_dir == str(tmp_path / "traces") and os.path.isdir(p.torch_profiler_dir)
    assert parse_profiler_config("{}") is None and parse_profiler_config(None) is None


def test_cuda_profiler_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="cuda profiler .* needs a CUDA device"):
        LLM(STORIES_EMBEDDED, device="cpu", profiler_config={"profiler": "cuda"})


def test_llm_profile_window(tmp_path):
    llm = LLM(STORIES_EMBEDDED, profiler_config=torch_config(tmp_path, torch_profiler_with_stack=False))
    want = [o.outputs[0].token_ids for o in llm.generate(["Once upon", "The cat"], GREEDY)]
    with pytest.raises(ValueError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(ValueError, match="running already"):
        llm.start_profile()
    got = [o.outputs[0].token_ids for o in llm.generate(["Once upon", "The cat"], GREEDY)]
    traces = llm.stop_profile()["traces"]
    assert got == want  # profiling changes no token
    assert len(traces) == 1 and traces[0].startswith(str(tmp_path)) and traces[0].endswith("-rank0.pt.trace.json.gz")
    check_trace(traces[0])
    table = traces[0].replace(".pt.trace.json.gz", ".txt")
    assert "Self CPU" in open(table).read()
    llm.start_profile()  # a second window gets its own files
    llm.generate(["Once"], GREEDY)
    assert llm.stop_profile()["traces"] != traces


def test_llm_without_profiler_config_says_how():
    llm = LLM(STORIES_EMBEDDED)
    with pytest.raises(ValueError, match="--profiler-config"):
        llm.start_profile()


def test_benches_refuse_profiler_config(tmp_path):
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["bench", "throughput", str(STORIES_EMBEDDED), "--profiler-config",
                                  torch_config(tmp_path)])
    assert r.exit_code == 2 and "--profile-dir" in r.output


def test_server_profile_routes_and_bench_serve_profile(tmp_path):
    s = Server(str(STORIES_EMBEDDED), "--profiler-config",
               torch_config(tmp_path, torch_profiler_use_gzip=False, torch_profiler_dump_cuda_time_total=False))
    try:
        r = httpx.post(s.url + "/stop_profile")
        assert r.status_code == 400 and "not running" in r.json()["error"]["message"]
        # bench serve --profile: the measured run between /start_profile and /stop_profile
        b = subprocess.run([*RANKSERVE, "bench", "serve", "--port", str(s.port), "--num-prompts", "3",
                            "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
                            "--random-vocab-size", "200", "--profile"], capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stdout + b.stderr
        traces = [x.split("trace: ", 1)[1] for x in b.stdout.splitlines() if x.startswith("trace: ")]
        assert len(traces) == 1 and traces[0].endswith("-rank0.pt.trace.json"), b.stdout
        check_trace(traces[0])
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".txt")]  # dump off
        assert httpx.post(s.url + "/start_profile").json() == {"profiling": True}
        r = httpx.post(s.url + "/start_profile")
        assert r.status_code == 400 and "running already" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 3})
        assert r.status_code == 200
        body = httpx.post(s.url + "/stop_profile", timeout=120).json()
        assert body["profiling"] is False and len(body["traces"]) == 1 and body["traces"] != traces
    finally:
        assert s.stop() == 0


def test_server_without_profiler_config_400():
    s = Server(str(STORIES_EMBEDDED))
    try:
        for path in ("/start_profile", "/stop_profile"):
            r = httpx.post(s.url + path)
            assert r.status_code == 400 and "--profiler-config" in r.json()["error"]["message"]
        b = subprocess.run([*RANKSERVE, "bench", "serve", "--port", str(s.port), "--num-prompts", "1",
                            "--random-input-len", "8", "--random-output-len", "2", "--random-vocab-size", "200",
                            "--profile"],
                           capture_output=True, text=True, timeout=300)
        assert b.returncode != 0 and "--profiler-config" in b.stderr + b.stdout
    finally:
        assert s.stop() == 0


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_mpi_pp2_server_profiles_every_rank_while_requests_run(tmp_path):
    """`mpiexec -n 2 serve --pp 2`: start and stop land while steps are in flight (the last stage
    sends their results to rank 0 while rank 0 gathers the ranks' answers); no request is
    hurt, and both ranks' traces are written before /stop_profile answers."""
    s = Server(str(STORIES_EMBEDDED), "--pp", "2", "--profiler-config",
               torch_config(tmp_path, torch_profiler_with_stack=False), mpi=2, timeout=240)
    body = {"prompt": "Once upon a time there was a little girl " * 8, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "prompt_logprobs": 20, "logprobs": 5}
    try:
        want = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120) for _ in range(8)]
            time.sleep(0.3)
            assert httpx.post(s.url + "/start_profile", timeout=60).status_code == 200
            time.sleep(0.3)
            r = httpx.post(s.url + "/stop_profile", timeout=120)
            assert r.status_code == 200, r.text
            assert [f.result().json()["choices"][0]["text"] for f in futs] == [want] * 8
        traces = r.json()["traces"]
        assert [t[-len("-rank0.pt.trace.json.gz"):] for t in traces] == ["-rank0.pt.trace.json.gz",
                                                                          "-rank1.pt.trace.json.gz"]
        for t in traces:  # written before the answer
            check_trace(t)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{''.join(s.lines)[-3000:]}") from e
    finally:
        s.stop()


def test_generate_profiler_config_prints_traces(tmp_path):
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["generate", str(STORIES_EMBEDDED), "--prompt", "Once", "--max-tokens", "3",
                                  "--profiler-config", torch_config(tmp_path)])
    assert r.exit_code == 0, r.output
    traces = [x.split("trace: ", 1)[1] for x in r.stderr.splitlines() if x.startswith("trace: ")]
    assert len(traces) == 1
    check_trace(traces[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_profile_window_records_kernels(tmp_path):
    """On CUDA (graphs captured): the trace holds the device's kernels, the table is sorted by
    device time, and tokens are unchanged."""
    llm = LLM(STORIES_EMBEDDED, profiler_config=torch_config(tmp_path, torch_profiler_with_stack=False))
    want = [o.outputs[0].token_ids for o in llm.generate(["Once upon", "The cat"], GREEDY)]
    llm.start_profile()
    got = [o.outputs[0].token_ids for o in llm.generate(["Once upon", "The cat"], GREEDY)]
    (trace,) = llm.stop_profile()["traces"]
    assert got == want
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert "Self CUDA" in open(trace.replace(".pt.trace.json.gz", ".txt")).read()
