"""`rankserve bench scaling`: one real `bench throughput` and `bench latency` record of the
embedded model at TP 1, copies of them as the runs of larger TP sizes with hand-set tokens/s,
and the speedups, efficiencies, table, JSON and plot computed from them."""
import copy
import json
import sys

import pytest
from click.testing import CliRunner

from conftest import STORIES_EMBEDDED
from test_bench import invoke_cli

from rankserve.launch.cli import main
from rankserve.runtime.bench import scaling

STORIES = str(STORIES_EMBEDDED)


@pytest.fixture(scope="module")
def real_records(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    invoke_cli("throughput", STORIES, "--num-prompts", "3", "--input-len", "8", "16",
               "--output-len", "3", "5", "--output-json", str(d / "t.json"))
    invoke_cli("latency", STORIES, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
               "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(d / "l.json"))
    return json.loads((d / "t.json").read_text()), json.loads((d / "l.json").read_text())


def derive(rec, gpus, tok_s, tp=None, pp=1, model=None, gpu="NVIDIA H200"):
    """`rec` as the run of slurm/scaling.sbatch at `gpus` GPUs, with `tok_s` tokens/s."""
    r = copy.deepcopy(rec)
    tp = tp or gpus
    res = r["results"]["rankserve"]
    res["num_devices"] = gpus
    res["output_tokens_per_s" if r["kind"] == "throughput" else "decode_tokens_per_s"] = tok_s
    r["parallel"] = dict(tp=tp, pp=pp, ep=False)
    r["env"]["gpu"] = gpu
    r["env"]["command"] = f"rankserve bench {r['kind']} MODEL --tp {tp} --pp {pp}"
    if model:
        r["model"]["name"] = model
    return r


def write(d, name, rec):
    (d / name).write_text(json.dumps(rec))


def test_real_records_carry_the_parallel_split(real_records):
    for rec in real_records:
        assert rec["parallel"] == dict(tp=1, pp=1, ep=False)
        assert rec["results"]["rankserve"]["num_devices"] == 1


def test_scaling_table_json_markdown_and_plot(tmp_path, real_records):
    thr, lat = real_records
    base = thr["results"]["rankserve"]["output_tokens_per_s"]
    write(tmp_path, "throughput-tp1.json", thr)  # the real record is the baseline
    write(tmp_path, "throughput-tp2.json", derive(thr, 2, 1.8 * base))
    write(tmp_path, "throughput-tp4.json", derive(thr, 4, 3.0 * base))
    # a 70B model starts at 4 GPUs; 16 = TP 8 × PP 2
    for gpus, tok_s in ((4, 200.0), (8, 340.0), (16, 520.0)):
        write(tmp_path, f"70b-{gpus}.json", derive(thr, gpus, tok_s, tp=min(gpus, 8), pp=max(1, gpus // 8),
                                                   model="llama-3.1-70b"))
    write(tmp_path, "latency-tp1.json", derive(lat, 1, 50.0))
    write(tmp_path, "latency-tp2.json", derive(lat, 2, 60.0))
    write(tmp_path, "comm.json", {"env": {}, "world_size": 2, "results": []})  # bench comm's
    hf_only = copy.deepcopy(thr)
    hf_only["results"] = {"hf": hf_only["results"]["rankserve"]}
    write(tmp_path, "hf.json", hf_only)

    r = CliRunner().invoke(main, ["bench", "scaling", str(tmp_path)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "skipping" in r.output and "comm.json: not a rankserve bench" in r.output
    assert "hf.json: no rankserve result" in r.output

    out = json.loads((tmp_path / "scaling.json").read_text())
    assert {s["path"].rsplit("/", 1)[1] for s in out["skipped"]} == {"comm.json", "hf.json"}
    groups = {(g["kind"], g["model"]): g for g in out["groups"]}
    assert set(groups) == {("throughput", "stories260K"), ("throughput", "llama-3.1-70b"),
                           ("latency", "stories260K")}

    def check(g, rows):  # GPUs, TP, PP, speedup, efficiency of each run, in order
        assert [(x["gpus"], x["tp"], x["pp"]) for x in g["runs"]] == [row[:3] for row in rows]
        assert [(x["speedup"], x["efficiency"]) for x in g["runs"]] == \
            [pytest.approx(row[3:]) for row in rows]
    check(groups["throughput", "stories260K"], [(1, 1, 1, 1.0, 1.0), (2, 2, 1, 1.8, 0.9), (4, 4, 1, 3.0, 0.75)])
    g70 = groups["throughput", "llama-3.1-70b"]
    assert g70["baseline_gpus"] == 4  # (340/200)/(8/4) = 0.85, (520/200)/(16/4) = 0.65
    check(g70, [(4, 4, 1, 1.0, 1.0), (8, 8, 1, 1.7, 0.85), (16, 8, 2, 2.6, 0.65)])
    check(groups["latency", "stories260K"], [(1, 1, 1, 1.0, 1.0), (2, 2, 1, 1.2, 0.6)])  # 60/50 over 2

    assert "85.0%" in r.output and "1.70x" in r.output  # the printed table
    md = (tmp_path / "scaling.md").read_text()
    assert "### llama-3.1-70b, throughput: 3 requests, prompts 8-16, outputs 3-5" in md
    assert "### stories260K, latency: batch 1, 8 in / 3 out" in md
    assert "| GPUs | TP | PP | output tok/s | speedup | efficiency | date | GPU | command |" in md
    assert ("| 16 | 8 | 2 | 520.0 | 2.60× | 65.0% | " + thr["env"]["date"][:10]) in md
    assert "| NVIDIA H200 | `rankserve bench throughput MODEL --tp 8 --pp 2` |" in md
    assert f"| 1 | 1 | 1 | {base:.1f} | 1.00× | 100.0% |" in md
    assert f"| {thr['ceilings']['device']} |" in md  # a CPU run names the device of its ceilings
    assert "| 2 | 2 | 1 | 60.0 | 1.20× | 60.0% |" in md and "decode tok/s" in md

    # a second run reads its own scaling.json silently
    r = CliRunner().invoke(main, ["bench", "scaling", str(tmp_path), "--no-plot"])
    assert r.exit_code == 0 and "scaling.json" not in r.output.split("wrote")[0]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_explicit_files_and_output_dir(tmp_path, real_records, monkeypatch):
    thr, _ = real_records
    write(tmp_path, "a.json", thr)
    write(tmp_path, "b.json", derive(thr, 2, thr["results"]["rankserve"]["output_tokens_per_s"]))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["bench", "scaling", "a.json", "b.json", "--no-plot"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "scaling.md").is_file() and not (tmp_path / "scaling.png").exists()  # cwd
    r = CliRunner().invoke(main, ["bench", "scaling", str(tmp_path), "--output-dir", str(tmp_path / "o"),
                                  "--no-plot"])
    assert r.exit_code == 0 and "50.0%" in (tmp_path / "o" / "scaling.md").read_text()


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, real_records, monkeypatch):
    write(tmp_path, "t.json", real_records[0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    r = CliRunner().invoke(main, ["bench", "scaling", str(tmp_path)])
    assert r.exit_code == 0 and "matplotlib is not installed" in r.output
    assert (tmp_path / "scaling.md").is_file() and not (tmp_path / "scaling.png").exists()


def test_older_records_take_tp_pp_from_the_command(tmp_path, real_records):
    rec = copy.deepcopy(real_records[0])
    del rec["parallel"]  # written before records carried it
    rec["results"]["rankserve"]["num_devices"] = 8
    rec["env"]["argv"] = ["/bin/rankserve", "bench", "throughput", "m", "--tp=4", "--pp", "2"]
    write(tmp_path, "old.json", rec)
    run, why = scaling.read_record(tmp_path / "old.json")
    assert why is None and (run["gpus"], run["tp"], run["pp"]) == (8, 4, 2)


def test_errors_name_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(main, ["bench", "scaling", str(empty)])
    assert r.exit_code == 1 and f"no JSON files in {empty}" in r.output
    (empty / "x.json").write_text("{not json")
    (empty / "y.json").write_text(json.dumps({"kind": "something else"}))
    r = CliRunner().invoke(main, ["bench", "scaling", str(empty)])
    assert r.exit_code == 1 and "x.json: not JSON" in r.output and "y.json: not a rankserve" in r.output
    assert f"no rankserve bench throughput/latency records in {empty}" in r.output
    r = CliRunner().invoke(main, ["bench", "scaling", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
