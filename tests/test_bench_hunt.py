"""Benchmark tooling as a user drives it (#21): the step-log summary on odd files, --profile-steps
and --profile-dir combinations, bench serve's flag checks and ShareGPT files that are not quite
ShareGPT, and a step budget that cannot hold --max-model-len without chunked prefill."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import STORIES_EMBEDDED

from rankserve.launch.cli import main
from rankserve.runtime.bench import serve, steplog

STORIES = str(STORIES_EMBEDDED)
SMALL = ("--kv-cache-memory-gb", "0.01", "--max-num-seqs", "8")
NEW = "1.{i},0.01,{p},3,3,0,0.001,0.002,0.003,0.004,0.005,0.006"
OLD = "1.{i},0.01,{p},3,3,0"


def write(tmp_path, lines) -> str:
    path = tmp_path / "steps.csv"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# ---- python -m rankserve.runtime.bench.steplog ----------------------------------------------------
def test_steplog_file_mixing_old_and_new_rows(tmp_path):
    """The server appends: a file from an older server (6 columns) then a newer one (12)."""
    path = write(tmp_path, [OLD.format(i=0, p=0), NEW.format(i=1, p=0), OLD.format(i=2, p=0),
                            NEW.format(i=3, p=0)])
    out = steplog.summarise(steplog.load(path))
    assert "3 steps with outputs" in out
    assert "host, decode-only steps: drain 1.00" in out  # from the rows that have phases


def test_steplog_skips_lines_that_are_not_rows(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, [NEW.format(i=0, p=0), "", "1.5,0.01,0,3", "garbage",
                            NEW.format(i=1, p=0), NEW.format(i=2, p=0)[:-9]])  # cut off mid-write
    monkeypatch.setattr("sys.argv", ["steplog", path])
    steplog.main()
    out = capsys.readouterr()
    assert "1 steps with outputs" in out.out
    assert "skipped 4 line(s)" in out.err


@pytest.mark.parametrize("argv, needle", [([], "usage"), (["/no/such/file.csv"], "cannot read")])
def test_steplog_cli_errors_without_traceback(monkeypatch, argv, needle):
    monkeypatch.setattr("sys.argv", ["steplog", *argv])
    with pytest.raises(SystemExit) as e:
        steplog.main()
    assert needle in str(e.value.code)


# ---- bench throughput / latency: profiling flags -------------------------------------------------
@pytest.mark.parametrize("cmd", ["throughput", "latency"])
@pytest.mark.parametrize("flags, needle", [
    (("--profile-steps", "1", "5"), "--profile-dir"),  # would be ignored
    (("--profile-dir", "PROF", "--backend", "hf"), "--backend rankserve"),  # hf is never profiled
])
def test_profile_flags_that_would_be_ignored_are_refused(tmp_path, cmd, flags, needle):
    flags = tuple(str(tmp_path / "p") if f == "PROF" else f for f in flags)
    r = CliRunner().invoke(main, ["bench", cmd, STORIES, *SMALL, *flags])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "p").exists()


def test_profile_steps_past_the_run_are_cut_to_fit(tmp_path):
    """A window past the run's last step recorded nothing and then crashed in torch.profiler
    (after the whole timed run): it is cut to the run's steps, with a note."""
    out_json = tmp_path / "sub" / "l.json"  # a directory that does not exist yet
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, *SMALL, "--input-len", "8",
                                  "--output-len", "6", "--num-iters", "1", "--num-iters-warmup", "0",
                                  "--output-json", str(out_json), "--profile-dir", str(tmp_path / "prof"),
                                  "--profile-steps", "50", "5"])
    assert r.exit_code == 0, r.output[-3000:] + repr(r.exception)
    assert "--profile-steps 50 5: the run has" in r.output
    prof = json.loads(out_json.read_text())["results"]["rankserve"]["profile"]
    assert prof["steps"] >= 1 and prof["first_step"] <= 6
    assert (tmp_path / "prof" / "trace-latency.json.gz").exists()


# ---- bench serve: flags and datasets ----------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (("--metric-percentiles", "50,abc"), "--metric-percentiles"),
    (("--request-rate", "nan"), "--request-rate"),
    (("--burstiness", "nan"), "--burstiness"),
    (("--burstiness", "inf"), "--burstiness"),
    (("--goodput", "ttft:nan"), "--goodput"),
    (("--endpoint", "v1/completions"), "--endpoint"),  # was glued to the port: every request failed
])
def test_bench_serve_bad_numbers_name_the_flag(flags, needle):
    # checked before any connection: no server on port 1
    r = CliRunner().invoke(main, ["bench", "serve", "--port", "1", "--random-vocab-size", "100",
                                  "--model", "m", "--disable-tqdm", *flags])
    assert r.exit_code == 1 and needle in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("text, needle", [
    ('["a", "b"]', "no usable conversation"),  # rows that are not objects
    ('[{"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]', "no usable conversation"),
    ('[{"conversations": "hello"}]', "no usable conversation"),
    ("not json\n", "neither JSON nor JSONL (line 1"),
    ('{"conversations": []}\n{oops\n', "neither JSON nor JSONL (line 2"),
])
def test_sharegpt_files_that_are_not_sharegpt(tmp_path, text, needle):
    path = tmp_path / "d.json"
    path.write_text(text)
    args = serve.ServeBenchArgs(dataset_name="sharegpt", dataset_path=str(path), sharegpt_output_len=5,
                                num_prompts=2)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        serve.sharegpt_dataset(args, np.random.default_rng(0), None)


def test_sharegpt_bad_rows_are_left_out(tmp_path):
    rows = ["x", {"conversations": [{"from": "human"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    args = serve.ServeBenchArgs(dataset_name="sharegpt", dataset_path=str(path), sharegpt_output_len=5,
                                num_prompts=3)
    out = serve.sharegpt_dataset(args, np.random.default_rng(0), None)
    assert [r.prompt for r in out] == ["hi"] * 3


# ---- serve / generate: a step budget below the context without chunked prefill -------------------
def test_budget_below_max_model_len_without_chunked_prefill_is_a_cli_error():
    """It started and then refused every prompt longer than the budget, one by one."""
    r = CliRunner().invoke(main, ["generate", STORIES, *SMALL, "--prompt", "Once", "--max-tokens", "2",
                                  "--max-model-len", "256", "--max-num-batched-tokens", "8",
                                  "--no-enable-chunked-prefill"])
    assert r.exit_code == 1, r.output
    assert "--max-num-batched-tokens (8) is smaller than --max-model-len (256)" in r.output


@pytest.mark.parametrize("args, needle", [
    # throughput generated fewer tokens than asked (cut at max_model_len) and reported the rate
    (("throughput", "--max-model-len", "64", "--input-len", "50", "60", "--output-len", "20", "30",
      "--num-prompts", "2"), "--input-len 60 + --output-len 30 = 90 tokens, more than the context of 64"),
    # latency raised a RuntimeError traceback after its timed run
    (("latency", "--input-len", "500", "--output-len", "30", "--num-iters", "1"),
     "530 tokens, more than the context of 512 (--max-model-len, from the model config)"),
])
def test_requests_longer_than_the_context_are_refused_before_the_run(args, needle):
    r = CliRunner().invoke(main, ["bench", args[0], STORIES, *SMALL, *args[1:]])
    assert r.exit_code == 1 and needle in r.output, r.output[-2000:] + repr(r.exception)


def test_profile_window_line_names_the_steps_it_recorded(tmp_path):
    """--profile-steps 2 3 records steps 2, 3 and 4: the summary said "steps 2..5" (one past the
    window), unlike the cut-to-fit note and the README, which count both ends."""
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, *SMALL, "--input-len", "8",
                                  "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0",
                                  "--profile-dir", str(tmp_path / "prof"), "--profile-steps", "2", "3"])
    assert r.exit_code == 0, r.output[-3000:] + repr(r.exception)
    assert "profile window: steps 2..4 of" in r.output, r.output[-2000:]


def test_bench_serve_negative_seed_names_the_flag():
    """numpy's "expected non-negative integer" reached the user without the flag's name."""
    r = CliRunner().invoke(main, ["bench", "serve", "--port", "1", "--random-vocab-size", "100",
                                  "--model", "m", "--disable-tqdm", "--seed", "-1"])
    assert r.exit_code == 2 and "--seed" in r.output and "Traceback" not in r.output, r.output


def profiled_latency(tmp_path, output_len: int):
    """(CLI result, the saved profile record) of a profiled one-iteration `bench latency`."""
    out_json = tmp_path / "l.json"
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, *SMALL, "--input-len", "8",
                                  "--output-len", str(output_len), "--num-iters", "1",
                                  "--num-iters-warmup", "0", "--output-json", str(out_json),
                                  "--profile-dir", str(tmp_path / "prof")])
    assert r.exit_code == 0, r.output[-3000:] + repr(r.exception)
    return r, json.loads(out_json.read_text())["results"]["rankserve"]["profile"]


def test_profile_of_a_one_step_run_times_that_step(tmp_path):
    """--output-len 1: the run is one engine step, which the profiler recorded, but the summary
    said "steps 1..0", 0 steps in 0 ms (the last step was timed up to a next step that never came)."""
    r, prof = profiled_latency(tmp_path, 1)
    assert prof["first_step"] == 1 and prof["steps"] == 1 and prof["wall_s"] > 0, prof
    assert "profile window: steps 1..1 of 1" in r.output


def test_cpu_profile_claims_no_device_time(tmp_path):
    """Without a GPU there are no device kernels: "device kernels 0.0 ms" and a busy fraction of
    0.0 read as an idle GPU."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU only")
    r, prof = profiled_latency(tmp_path, 4)
    assert prof["device_busy_s"] is None and prof["device_busy_fraction"] is None, prof
    assert "device kernels" not in r.output
