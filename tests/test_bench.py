"""`rankserve bench throughput|latency` on CPU: the CLI end to end on stories260K (rankserve and
transformers backends), the byte/FLOP accounting of the physical floor on a hand-computed case,
step observation on a real engine, and the shipped architecture configs."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from conftest import STORIES_EMBEDDED

from rankserve.runtime.bench import common

STORIES = str(STORIES_EMBEDDED)


SMALL = ("--kv-cache-memory-gb", "0.01", "--max-num-seqs", "8")  # the CPU default allocates 1 GiB


def run_cli(*args, timeout=120):
    """The real entry point in a fresh process (as a user runs it)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-m", "rankserve.launch", "bench", *args, *SMALL], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def invoke_cli(*args):
    """The same CLI in this process (saves a second interpreter start on a loaded CI box)."""
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["bench", *args, *SMALL])
    assert r.exit_code == 0, r.output[-3000:] + repr(r.exception)
    return r.output


def check_floor(f):
    for key in ("bytes_weights", "bytes_kv_read", "bytes_kv_write", "flops_total", "floor_s"):
        assert f[key] > 0, key
    assert f["bound"] in ("memory", "compute")
    assert 0 < f["achieved_fraction"] <= 1.5


def check_env(rec, kind):
    assert rec["kind"] == kind
    env = rec["env"]
    for key in ("date", "torch", "transformers", "triton", "gpu", "command"):
        assert key in env
    c = rec["ceilings"]
    assert c["hbm_GBps"] > 0 and c["matmul_TFLOPs"] > 0 and "CPU" in c["note"]


def test_throughput_cli_rankserve_and_hf(tmp_path):
    out_json, png = tmp_path / "t.json", tmp_path / "t.png"
    stdout = run_cli("throughput", STORIES, "--num-prompts", "5", "--input-len", "8", "40",
                     "--output-len", "4", "12", "--seed", "3", "--backend", "rankserve",
                     "--backend", "hf", "--output-json", str(out_json), "--plot", str(png))
    rec = json.loads(out_json.read_text())
    check_env(rec, "throughput")
    assert rec["env"]["command"].startswith("rankserve bench throughput " + STORIES)
    wl = rec["workload"]
    assert wl["num_requests"] == 5 and 8 <= wl["prompt_len_min"] <= wl["prompt_len_max"] <= 40
    assert list(rec["results"]) == ["rankserve", "hf"]
    for name, r in rec["results"].items():
        assert f"[{name}]" in stdout
        assert r["num_requests"] == 5
        assert r["output_tokens"] == wl["output_tokens"]  # EOS ignored: every request ran to length
        assert r["prompt_tokens"] == wl["prompt_tokens"]
        assert r["requests_per_s"] == pytest.approx(5 / r["elapsed_s"])
        assert r["total_tokens_per_s"] > r["output_tokens_per_s"] > 0
        assert r["startup"]["load"] >= 0
        check_floor(r["floor"])
        # every step runs a forward over at least one token per unfinished request
        assert wl["output_len_max"] <= r["floor"]["num_steps"] <= wl["output_tokens"]
    assert "kv_alloc" in rec["results"]["rankserve"]["startup"]
    assert "continuous batching" in rec["results"]["hf"]["mode"]
    r = rec["results"]["rankserve"]  # vLLM's `bench throughput --output-json` keys, of rankserve's run
    assert rec["elapsed_time"] == r["elapsed_s"] and rec["num_requests"] == 5
    assert rec["total_num_tokens"] == wl["prompt_tokens"] + wl["output_tokens"]
    assert rec["requests_per_second"] == r["requests_per_s"]
    assert rec["tokens_per_second"] == pytest.approx(rec["total_num_tokens"] / r["elapsed_s"])
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000


def test_throughput_structured_output_mode(tmp_path):
    """--structured-output json: every request under one of the bench's JSON schemas; the outputs
    are documents (they may end before the workload's length), and the mode is recorded."""
    from rankserve.runtime.bench import throughput
    out_json = tmp_path / "s.json"
    invoke_cli("throughput", STORIES, "--num-prompts", "6", "--input-len", "8", "20",
               "--output-len", "8", "24", "--structured-output", "json", "--output-json", str(out_json))
    rec = json.loads(out_json.read_text())
    assert rec["workload"]["structured_output"] == "json"
    r = rec["results"]["rankserve"]
    assert 0 < r["output_tokens"] <= rec["workload"]["output_tokens"]
    g = r["structured_output"]  # mask rows filled by xgrammar or reused, counted over the run
    assert g["rows_filled"] > 0 and g["rows_reused"] >= 0 and g["fill_s"] > 0
    from rankserve import LLM
    llm = LLM(STORIES)  # the same params the bench sends: the texts are JSON prefixes of the schemas
    outs = llm.generate(["a"] * 3, [throughput.engine_params(24, s) for s in throughput.SCHEMAS])
    for o in outs:
        text = llm.tokenizer.decode(o.outputs[0].token_ids)
        assert text.lstrip()[:1] in "{[", text
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["bench", "throughput", STORIES, "--structured-output", "json",
                                  "--backend", "hf"])
    assert r.exit_code == 2 and "rankserve backend only" in r.output


def test_latency_cli_rankserve_and_hf(tmp_path):
    out_json = tmp_path / "l.json"
    invoke_cli("latency", STORIES, "--batch-size", "2", "--input-len", "12", "--output-len", "6",
            "--num-iters", "2", "--num-iters-warmup", "1", "--backend", "rankserve", "--backend", "hf",
            "--output-json", str(out_json), "--profile-dir", str(tmp_path / "prof"))
    rec = json.loads(out_json.read_text())
    check_env(rec, "latency")
    prof = rec["results"]["rankserve"]["profile"]  # 6 steps: the window is steps 1..3
    assert prof["first_step"] == 1 and prof["steps"] == 3 and prof["wall_s"] > 0
    assert (tmp_path / "prof" / "trace-latency.json.gz").stat().st_size > 1000
    for _name, r in rec["results"].items():
        assert len(r["latencies_s"]) == len(r["ttfts_s"]) == 2
        assert r["ttft_s"] > 0  # no timing comparisons: a loaded CI box reorders them
        assert r["ttft_floor"]["floor_s"] < r["floor"]["floor_s"]
        assert r["decode_tokens_per_s"] == pytest.approx(2 * 6 / r["latency_s"])
        check_floor(r["floor"])
        check_floor(r["ttft_floor"])
        assert r["floor"]["num_steps"] == 6  # one prefill step, then one per further token
        assert r["ttft_floor"]["num_steps"] == 1
    assert "static" in rec["results"]["hf"]["mode"]
    lat = rec["results"]["rankserve"]["latencies_s"]  # vLLM's `bench latency --output-json` keys
    assert rec["latencies"] == lat and rec["avg_latency"] == pytest.approx(sum(lat) / 2)
    assert list(rec["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(lat) <= rec["percentiles"]["50"] <= max(lat)


def test_profile_steps_picks_the_window(tmp_path):
    out_json = tmp_path / "l.json"
    invoke_cli("latency", STORIES, "--input-len", "12", "--output-len", "8", "--num-iters", "1",
               "--num-iters-warmup", "0", "--output-json", str(out_json),
               "--profile-dir", str(tmp_path / "prof"), "--profile-steps", "2", "3")
    prof = json.loads(out_json.read_text())["results"]["rankserve"]["profile"]
    assert prof["first_step"] == 2 and prof["steps"] == 3


def tiny_stats(**kw):
    base = dict(num_params=18, body_params=10, expert_params=0, num_experts=0, top_k=0,
                vocab_size=4, hidden_size=2, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=3)
    return common.ModelStats(**{**base, **kw})


def test_floor_accounting_by_hand():
    # one request, prompt 3, 2 output tokens, steps of 3 then 1 tokens, 2-byte dtype
    ceil = {"hbm_GBps": 1e-9, "matmul_TFLOPs": 1e-12}  # 1 byte/s and 1 FLOP/s
    f = common.physical_floor(tiny_stats(), [3], [2], [3, 1], 2, ceil)
    kv_tok = 2 * 1 * 1 * 3 * 2  # K and V, layers, kv heads, head_dim, bytes = 12
    assert f["bytes_kv_read"] == (3 + 4) * kv_tok  # contexts 3 (prefill) and 4 (decode)
    assert f["bytes_kv_write"] == 4 * kv_tok  # the last sampled token is never written
    assert f["bytes_weights"] == 2 * (10 + 4 * 2) * 2  # 2 steps × (body + head) × bytes
    assert f["bytes_total"] == 84 + 48 + 72
    assert f["tokens_processed"] == 4
    assert f["flops_linear"] == 2 * 10 * 4 + 2 * 8 * 2  # head only on the 2 sampled rows
    assert f["flops_attention"] == 4 * 3 * 2 * 1 * (1 + 2 + 3 + 4)
    assert (f["t_memory_s"], f["t_compute_s"]) == pytest.approx((204, 352))
    assert f["floor_s"] == pytest.approx(352) and f["bound"] == "compute"
    assert common.physical_floor(tiny_stats(), [3], [2], [3, 1], 2, ceil, num_devices=2)["floor_s"] \
        == pytest.approx(176)
    done = common.with_achieved(f, measured_s=704, output_tokens=2)
    assert done["achieved_fraction"] == pytest.approx(0.5)
    assert done["floor_output_tokens_per_s"] == pytest.approx(2 / 352)


def test_floor_moe_counts_touched_and_active_experts():
    s = tiny_stats(expert_params=40, num_experts=4, top_k=2)
    assert s.step_weight_params(1) == pytest.approx(10 + 8 + 40 * 0.5)
    assert s.step_weight_params(3) == pytest.approx(10 + 8 + 40 * (1 - 0.5 ** 3))
    assert s.active_params_per_token == pytest.approx(10 + 40 * 2 / 4)


def test_engine_steps_are_observed():
    from rankserve.runtime.bench.throughput import observe_steps, run_engine
    from rankserve.runtime.llm import LLM
    llm = LLM(STORIES, enable_prefix_caching=False, kv_cache_memory_gb=0.01)
    log = observe_steps(llm)
    wl = common.Workload(prompts=[[5] * 5, [7] * 7], output_lens=[3, 4])
    elapsed, out_lens = run_engine(llm, wl)
    assert out_lens == [3, 4] and elapsed > 0
    # both prefills in one step, then one decode token per unfinished request
    assert log.tokens == [12, 2, 2, 1]


def test_workload_is_seeded_and_in_range():
    a = common.make_workload(16, (5, 9), (2, 3), vocab_size=50, seed=1)
    assert a == common.make_workload(16, (5, 9), (2, 3), vocab_size=50, seed=1)
    assert a != common.make_workload(16, (5, 9), (2, 3), vocab_size=50, seed=2)
    assert all(5 <= n <= 9 for n in a.prompt_lens) and all(2 <= n <= 3 for n in a.output_lens)
    assert all(0 <= t < 50 for p in a.prompts for t in p)
    assert len({tuple(p[:4]) for p in a.prompts}) == 16  # no shared prefixes to cache


@pytest.mark.parametrize("name,billions,arch", [
    ("qwen3-0.6b", 0.596, "Qwen3ForCausalLM"),  # tied embedding counted once
    ("llama-3.1-8b", 8.03, "LlamaForCausalLM"),
    ("llama-3.1-70b", 70.55, "LlamaForCausalLM"),
    ("qwen3-30b-a3b", 30.53, "Qwen3MoeForCausalLM"),
    # quantized: the floor counts logical weights (times the measured bytes per weight), not the
    # packed int32 / scale tensors (a 4-bit model's floor was 8x too low)
    ("llama-3.1-8b-gptq", 8.03, "LlamaForCausalLM"),
    ("llama-3.1-8b-fp8block", 8.03, "LlamaForCausalLM"),
])
def test_shipped_configs_build_on_meta(name, billions, arch):
    from transformers import AutoConfig
    path, named = common.resolve_model(name)
    assert named and os.path.isfile(os.path.join(path, "config.json"))
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == [arch]
    stats = common.model_stats(cfg)  # builds rankserve's model on the meta device
    assert stats.num_params / 1e9 == pytest.approx(billions, rel=2e-3)
    if name.startswith("llama"):
        from rankserve.models.llama import rope_params
        assert rope_params(cfg)["rope_type"] == "llama3" and rope_params(cfg)["factor"] == 8.0
    if name == "qwen3-30b-a3b":
        assert (stats.num_experts, stats.top_k) == (128, 8)
        assert 3.0e9 < stats.active_params_per_token + stats.head_params < 3.4e9  # "A3B"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_an_output_path_no_file_can_be_made_in_is_refused_before_the_run():
    """os.access says yes to root everywhere, /proc included: the run went ahead and its JSON
    was lost to a FileNotFoundError at the end."""
    from rankserve.runtime.bench.common import check_writable
    with pytest.raises(ValueError, match="--output-json /proc/x/y.json: cannot write there"):
        check_writable("/proc/x/y.json", "--output-json")
    check_writable(os.path.join(os.path.dirname(__file__), "new-dir", "y.json"), "--output-json")


@pytest.mark.parametrize("bench", ["throughput", "latency", "sleep", "multiturn"])
@pytest.mark.parametrize("flags", [["--generation-config", "vllm"],
                                   ["--override-generation-config", '{"temperature": 0.5}']])
def test_generation_config_flags_are_refused_by_the_benches(bench, flags):
    """A bench's requests set their own sampling, so these engine flags (in every bench's --help)
    changed nothing: refused by name before the run, never silently ignored."""
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["bench", bench, STORIES, *flags, *SMALL])
    assert r.exit_code == 2 and flags[0] in r.output and "generate and serve" in r.output, r.output


def test_named_model_implies_dummy_weights_and_bad_names_fail():
    from rankserve.launch.cli import _bench_config, main
    cfg, name = _bench_config({"model": "llama-3.1-8b"})
    assert name == "llama-3.1-8b" and cfg.load.load_format == "dummy"
    assert os.path.isfile(os.path.join(cfg.model.model, "config.json"))
    r = CliRunner().invoke(main, ["bench", "throughput", "no-such-model"])
    assert r.exit_code == 2 and "shipped config" in r.output
    r = CliRunner().invoke(main, ["bench", "throughput", STORIES, "--input-len", "9", "3"])
    assert r.exit_code == 2 and "LO <= HI" in r.output


def test_throughput_lengths_take_one_value_as_vllm_does(monkeypatch):
    """`bench throughput --input-len 128 --output-len 64` (vLLM's form: fixed lengths) is
    LO = HI; `--input-len LO HI` stays a range."""
    from rankserve.launch import cli
    from rankserve.runtime.bench import throughput
    seen = []
    monkeypatch.setattr(cli, "_run_bench", lambda module, cfg, args: seen.append(args))
    for argv, want in ((["--input-len", "12", "--output-len", "5"], ((12, 12), (5, 5))),
                       (["--input-len", "8", "40", "--output-len", "7"], ((8, 40), (7, 7))),
                       (["--output-len", "3", "9", "--input-len", "6"], ((6, 6), (3, 9)))):
        r = CliRunner().invoke(cli.main, ["bench", "throughput", STORIES, *argv])
        assert r.exit_code == 0, r.output
        assert (seen[-1].input_len, seen[-1].output_len) == want
    assert throughput  # (the module the command runs)
    r = CliRunner().invoke(cli.main, ["bench", "throughput", STORIES, "--input-len", "x"])
    assert r.exit_code == 2 and "--input-len" in r.output


def test_config_only_model_runs_with_dummy_weights(tmp_path):
    # what the shipped configs resolve to: a directory with config.json alone (no tokenizer)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((STORIES_EMBEDDED / "config.json").read_text())
    out_json = tmp_path / "w2.json"
    invoke_cli("throughput", str(model), "--load-format", "dummy", "--workload", "w2",
               "--output-len", "6", "6", "--output-json", str(out_json))
    rec = json.loads(out_json.read_text())
    wl = rec["workload"]
    assert (wl["num_requests"], wl["prompt_len_max"], wl["output_tokens"]) == (1, 128, 6)  # W2 prompt
    r = rec["results"]["rankserve"]
    assert r["output_tokens"] == 6 and r["floor"]["num_steps"] == 6
    check_floor(r["floor"])


def test_compile_time_bench_runs_both_ways():
    p = subprocess.run([sys.executable, "-m", "rankserve.runtime.bench.compile_time", "--layers", "2"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith(("whole", "regional"))]
    assert [r[0] for r in rows] == ["whole", "regional"]
    assert all(float(r[1]) > 0 and float(r[-1]) < 1e-4 for r in rows)  # seconds, |compiled - eager|


def test_sleep_and_multiturn_bench_cli(tmp_path):
    """`bench sleep` (same tokens after both levels) and `bench multiturn` with a host tier that
    serves the prefixes a small device KV cache lost."""
    out = tmp_path / "s.json"
    stdout = invoke_cli("sleep", STORIES, "--num-prompts", "2", "--output-len", "4",
                        "--output-json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["level"] for r in rows] == [1, 2] and all(r["same_tokens"] for r in rows)
    assert "wake-up phases" in stdout
    out = tmp_path / "m.json"
    invoke_cli("multiturn", STORIES, "--num-conversations", "4", "--prefix-len", "64", "--turns", "2",
               "--turn-len", "8", "--output-len", "4", "--concurrency", "1", "--block-size", "16",
               "--num-gpu-blocks-override", "12", "--max-model-len", "128", "--kv-offload-size", "0.001",
               "--output-json", str(out))
    rec = json.loads(out.read_text())
    assert rec["requests"] == 8 and rec["host_hit_tokens"] > 0 and rec["ttft_p50_s"] > 0


def test_latency_temperature(tmp_path, monkeypatch):
    """`--temperature T` samples every request at T (what measures speculative decoding at an
    acceptance below 1 on the echo configs); the hf backend (greedy) refuses it."""
    from rankserve.runtime.bench import throughput
    seen = []
    real = throughput.engine_params
    monkeypatch.setattr(throughput, "engine_params", lambda *a: seen.append(a) or real(*a))
    out_json = tmp_path / "t.json"
    invoke_cli("latency", STORIES, "--batch-size", "1", "--input-len", "8", "--output-len", "4",
               "--num-iters", "1", "--num-iters-warmup", "0", "--temperature", "0.7",
               "--output-json", str(out_json))
    assert seen and all(a[2] == 0.7 for a in seen)
    w = json.loads(out_json.read_text())["workload"]
    assert w["temperature"] == 0.7 and w["greedy"] is False
    from rankserve.launch.cli import main
    r = CliRunner().invoke(main, ["bench", "latency", STORIES, "--temperature", "0.7", "--backend", "hf"])
    assert r.exit_code == 2 and "rankserve backend only" in r.output
