"""Serving performance features and their tooling as users drive them (#21, round 2): /metrics as a
vLLM user reads it (token counters equal what the client got: stop strings, aborts, n > 1), bad
`RANKSERVE_*` values as start-up errors naming the knob (misspelt ones warned about), --cache-dir
and --tokenizer paths, bench output paths checked before the run, bench serve flags of another
dataset refused, bench latency's one batch."""
from __future__ import annotations

import re
import time

import httpx
import pytest
from click.testing import CliRunner

from conftest import STORIES_EMBEDDED
from test_server import Server

from rankserve.launch.cli import main
from rankserve.runtime import envs

PROMPT = "Once upon a time"
STORIES = str(STORIES_EMBEDDED)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "8", "--kv-cache-memory-gb", "0.05")
    yield s
    assert s.stop() == 0


def samples(url: str) -> dict[str, float]:
    """Every sample of /metrics by series name (labels other than model_name / engine kept)."""
    out = {}
    for m in re.finditer(r"^(rankserve:\w+)(\{[^}]*\})? (\S+)$", httpx.get(url + "/metrics").text, re.M):
        kept = [kv for kv in re.findall(r'\w+="[^"]*"', m.group(2) or "")
                if not kv.startswith(("model_name=", "engine="))]
        labels = "{" + ",".join(kept) + "}" if kept else ""
        out[m.group(1) + labels] = out.get(m.group(1) + labels, 0.0) + float(m.group(3))
    return out


def grew(before: dict, after: dict) -> dict[str, float]:
    """The counters' increase; none may go backwards."""
    back = {k: (before[k], v) for k, v in after.items()
            if k.endswith(("_total", "_count", "_sum")) and v < before.get(k, 0.0)}
    assert not back, f"counters went backwards: {back}"
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def settle(url: str, key: str, value: float, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = samples(url)
        if s.get(key, 0.0) >= value or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


# ---- /metrics: generation_tokens_total counts the tokens the client got ---------------------------
@pytest.mark.parametrize("body", [
    dict(max_tokens=40, stop=[" the"]),  # the engine runs on until the API's abort reaches it
    dict(max_tokens=40, stop=[" was"], n=3, temperature=1.0, seed=3),
])
def test_generation_tokens_equal_delivered_with_stop_strings(server, body):
    for _ in range(3):  # (the engine's extra tokens are a race: a few tries make it certain)
        before = samples(server.url)
        r = httpx.post(server.url + "/v1/completions", json=dict(model=server_model(server), prompt=PROMPT,
                                                                 **{"temperature": 0, **body}))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert any(c["finish_reason"] == "stop" for c in r.json()["choices"])
        time.sleep(0.3)  # the engine's last steps for the cut requests
        d = grew(before, samples(server.url))
        assert d["rankserve:generation_tokens_total"] == usage["completion_tokens"]
        assert d["rankserve:request_generation_tokens_sum"] == usage["completion_tokens"]
        assert d["rankserve:prompt_tokens_total"] == usage["prompt_tokens"] * body.get("n", 1)


def test_generation_tokens_of_an_aborted_stream(server):
    before = samples(server.url)
    chunks = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(
            model=server_model(server), prompt=PROMPT, max_tokens=200, ignore_eos=True, stream=True)) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 5:
                break
    key = 'rankserve:request_success_total{finished_reason="abort"}'
    settle(server.url, key, before.get(key, 0.0) + 1)
    time.sleep(0.3)
    after = samples(server.url)
    d = grew(before, after)
    assert d[key] == 1
    assert d["rankserve:generation_tokens_total"] == d["rankserve:request_generation_tokens_sum"] >= 5
    assert after["rankserve:num_requests_running"] == after["rankserve:kv_cache_blocks_used"] == 0


def server_model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


# ---- RANKSERVE_* knobs: a bad value is a start-up error naming it ---------------------------------
@pytest.mark.parametrize("name, value", [
    ("RANKSERVE_HEARTBEAT_TIMEOUT", "abc"),  # read only by multi-rank jobs: was ignored
    ("RANKSERVE_HEARTBEAT_TIMEOUT", "-1"),
    ("RANKSERVE_HEARTBEAT", "maybe"),  # anything but 0/false/no/off meant on
    ("RANKSERVE_PRECOMPILE", "of"),
    ("RANKSERVE_GRAMMAR_THREADS", "two"),  # read at the first structured-output request
    ("RANKSERVE_GRAMMAR_THREADS", "-3"),
    ("RANKSERVE_PEAK_TFLOPS", "0"),  # a cost model dividing by it
    ("RANKSERVE_HOST_LINK_GBPS", "nan"),
    ("RANKSERVE_INJECT_FAULT", "zz"),
    ("RANKSERVE_SKINNY_MAX_M", "-1"),
    ("RANKSERVE_COMM_LIB", "Torch"),  # anything but `torch` silently meant deepspeed
])
def test_bad_knob_values_are_start_up_errors(name, value):
    r = CliRunner().invoke(main, ["serve", "--help"], env={name: value})
    assert r.exit_code == 1 and name in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(ValueError, match=name):
        envs.check({name: value})


def test_good_knob_values_pass():
    envs.check({"RANKSERVE_HEARTBEAT": "OFF", "RANKSERVE_PRECOMPILE": "true", "RANKSERVE_INJECT_FAULT": "1:5",
                "RANKSERVE_GRAMMAR_THREADS": "4", "RANKSERVE_PEAK_TFLOPS": "0.5", "RANKSERVE_LAUNCHER": "single",
                "RANKSERVE_SKINNY_MAX_M": "0", "RANKSERVE_STEP_LOG": ""})
    assert envs.get("RANKSERVE_HEARTBEAT", {"RANKSERVE_HEARTBEAT": "OFF"}) is False
    r = CliRunner().invoke(main, ["serve", "--help"], env={"RANKSERVE_HEARTBEAT": "0"})
    assert r.exit_code == 0, r.output


# ---- --cache-dir ------------------------------------------------------------------------------------
def test_unwritable_cache_dir_with_torch_compile_is_a_flag_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, "--cache-dir", str(blocker / "sub"),
                                  "--compilation-level", "2", "--device", "cpu", "--output-len", "2"])
    assert r.exit_code == 2 and "--cache-dir" in r.output and "Traceback" not in r.output, r.output


def test_relative_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    from rankserve.launch.caches import usable_caches
    from rankserve.runtime.config import EngineConfig
    monkeypatch.chdir(tmp_path)
    cfg = usable_caches(EngineConfig.from_kwargs(cache_dir="cache"), given_cache_dir=True,
                        env={"TRITON_CACHE_DIR": str(tmp_path)})
    assert cfg.compilation.cache_dir == str(tmp_path / "cache")


# ---- bench output paths are checked before the run --------------------------------------------------
@pytest.mark.parametrize("cmd", [["bench", "latency", STORIES], ["bench", "throughput", STORIES],
                                 ["bench", "sleep", STORIES]])
@pytest.mark.parametrize("flag", ["--output-json", "--plot"])
def test_unwritable_bench_outputs_are_flag_errors(tmp_path, cmd, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    if flag == "--plot" and cmd[1] == "sleep":
        flag = "--output-json"
    r = CliRunner().invoke(main, [*cmd, flag, str(blocker / "out.json"), "--device", "cpu"])
    assert r.exit_code == 2 and flag in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("flags, needle", [
    (("--save-result", "--result-dir", "{blocker}/d"), "--result-dir"),
    (("--result-filename", "{blocker}/r.json"), "--result-filename"),
    (("--plot", "{blocker}/p.png"), "--plot"),
])
def test_bench_serve_unwritable_results_fail_before_the_run(tmp_path, flags, needle):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = CliRunner().invoke(main, ["bench", "serve", "--port", "1", "--random-vocab-size", "100", "--model", "m",
                                  "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                                  "--disable-tqdm", *(f.format(blocker=blocker) for f in flags)])
    assert r.exit_code == 1 and needle in r.output and "requests (random)" not in r.output, r.output


@pytest.mark.parametrize("flags, needle", [
    (("--dataset-path", "{sharegpt}"), "--dataset-path"),  # random prompts would be sent instead
    (("--sharegpt-output-len", "4"), "--sharegpt-output-len"),
    (("--dataset-name", "prefix_repetition", "--dataset-path", "{sharegpt}"), "--dataset-path"),
    (("--dataset-name", "sharegpt", "--dataset-path", "{sharegpt}", "--random-input-len", "64"),
     "--random-input-len"),
    (("--dataset-name", "prefix_repetition", "--random-range-ratio", "0.5"), "--random-range-ratio"),
    (("--prefix-repetition-num-prefixes", "3"), "--prefix-repetition-num-prefixes"),
    (("--burstiness", "0.5"), "--request-rate"),  # gaps of an infinite rate: none
])
def test_bench_serve_flags_of_another_dataset_are_refused(tmp_path, flags, needle):
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]')
    r = CliRunner().invoke(main, ["bench", "serve", "--port", "1", "--random-vocab-size", "100", "--model", "m",
                                  "--disable-tqdm", *(f.format(sharegpt=sharegpt) for f in flags)])
    assert r.exit_code == 1 and needle in r.output and "requests (" not in r.output, r.output


def test_bad_knob_value_fails_the_offline_engine_at_start(monkeypatch):
    from rankserve.runtime.llm import LLM
    monkeypatch.setenv("RANKSERVE_GRAMMAR_THREADS", "0")  # read at the first structured request
    with pytest.raises(ValueError, match="RANKSERVE_GRAMMAR_THREADS"):
        LLM(STORIES, kv_cache_memory_gb=0.01)


def test_a_misspelt_knob_is_warned_about():
    warnings = envs.check({"RANKSERVE_PRECOMPIL": "0", "RANKSERVE_PORT": "8000", "RANKSERVE_HEARTBEAT": "1"})
    assert warnings == ["RANKSERVE_PRECOMPIL is not a rankserve environment variable (ignored); "
                        "did you mean RANKSERVE_PRECOMPILE?"]


def test_a_misspelt_knob_is_logged_once_per_process(caplog):
    """`rankserve generate` checks at the CLI and again in LLM(): the warning came twice."""
    env = {"RANKSERVE_GRAMMAR_THREAD": "3"}
    with caplog.at_level("WARNING", logger="rankserve.envs"):
        assert envs.check(env) == envs.check(env) != []  # still returned each time
    assert sum("RANKSERVE_GRAMMAR_THREAD " in r.getMessage() for r in caplog.records) == 1


# ---- bench latency: one batch --------------------------------------------------------------------------
def test_latency_batch_larger_than_max_num_seqs_is_refused():
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, "--max-num-seqs", "2", "--batch-size", "3",
                                  "--input-len", "4", "--output-len", "2", "--kv-cache-memory-gb", "0.01"])
    assert r.exit_code == 1 and "--max-num-seqs" in r.output and "latency 0" not in r.output, r.output


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_bad_knob_under_mpirun_is_one_line_from_rank_0(capfd, rank, printed):
    env = {"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_SIZE": "2", "RANKSERVE_HEARTBEAT_TIMEOUT": "0"}
    r = CliRunner().invoke(main, ["serve", "--help"], env=env)
    err = capfd.readouterr().err
    assert r.exit_code == 2 and "Traceback" not in r.output + err, r.output
    assert ("RANKSERVE_HEARTBEAT_TIMEOUT" in err) == printed, err


def test_num_loras_with_an_unwritable_cache_dir_is_a_flag_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = CliRunner().invoke(main, ["bench", "throughput", STORIES, "--num-prompts", "2", "--input-len", "4", "4",
                                  "--output-len", "2", "2", "--enable-lora", "--num-loras", "1",
                                  "--max-lora-rank", "8", "--cache-dir", str(blocker / "c")])
    assert r.exit_code == 2 and "--cache-dir" in r.output and "--num-loras" in r.output, r.output


@pytest.mark.parametrize("where", ["/nonexistent/tokenizer", "EMPTY"])
def test_bench_serve_tokenizer_that_cannot_load_names_the_flag(tmp_path, where):
    where = str(tmp_path) if where == "EMPTY" else where
    r = CliRunner().invoke(main, ["bench", "serve", "--port", "1", "--model", "m", "--tokenizer", where,
                                  "--num-prompts", "2", "--disable-tqdm"])
    assert r.exit_code == 1 and "--tokenizer" in r.output, (r.output, r.exception)


@pytest.mark.parametrize("cmd", [["serve"], ["bench", "latency"]])
def test_engine_tokenizer_that_is_not_a_directory_is_a_flag_error(cmd):
    r = CliRunner().invoke(main, [*cmd, STORIES, "--tokenizer", "/nonexistent/tokenizer"])
    assert r.exit_code == 2 and "--tokenizer" in r.output, (r.output, r.exception)
