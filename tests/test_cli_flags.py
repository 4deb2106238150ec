"""The command line as a vLLM user meets it: vLLM's flag spellings, `--config config.yaml`,
several --served-model-name, bad values as errors naming the flag (no traceback)."""
import types

import pytest
from click.testing import CliRunner

import rankserve.launch.cli as cli
from rankserve.runtime.serve.args import ServerArgs

from conftest import STORIES_EMBEDDED

MODEL = str(STORIES_EMBEDDED)


class _Stop(Exception):
    pass


_BUILD, _VALIDATE = cli.build_config, ServerArgs.validate


def parsed(argv, monkeypatch):
    """(result, EngineConfig, ServerArgs or None) of a command line, stopped before any engine."""
    seen = {}

    def build(kwargs):
        seen["cfg"] = _BUILD(kwargs)
        raise _Stop

    def validate(self):
        seen["server"] = self
        return _VALIDATE(self)
    monkeypatch.setattr(cli, "build_config", build)
    monkeypatch.setattr(ServerArgs, "validate", validate)
    r = CliRunner().invoke(cli.main, argv)
    if "cfg" in seen:
        assert isinstance(r.exception, _Stop), r.output
    return r, seen.get("cfg"), seen.get("server")


def refused(argv, *words):
    r = CliRunner().invoke(cli.main, argv)
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    for w in words:
        assert w in r.output, r.output
    return r.output


def test_dtype_takes_vllms_half_and_float(monkeypatch):
    for given, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        r, cfg, _ = parsed(["generate", MODEL, "--prompt", "x", "--dtype", given], monkeypatch)
        assert cfg is not None and cfg.model.dtype == dtype, (r.output, r.exception)
    from rankserve.runtime.config import EngineConfig
    assert EngineConfig.from_kwargs(model=MODEL, dtype="half").model.dtype == "float16"
    refused(["generate", MODEL, "--prompt", "x", "--dtype", "float64"], "--dtype", "half")


def test_token_counts_as_vllm(monkeypatch):
    """Decimal suffixes take fractions (25.6k), binary ones whole numbers (32K; 1.5K is an
    error, as vLLM); t/T too; inf/nan with a suffix is an error naming the flag, not a traceback."""
    for given, n in (("25.6k", 25600), ("32K", 32768), ("1t", 10 ** 12), ("2T", 2 ** 41)):
        r, cfg, _ = parsed(["generate", MODEL, "--prompt", "x", "--max-num-batched-tokens", given],
                           monkeypatch)
        assert cfg.scheduler.max_num_batched_tokens == n, (given, r.output)
    for bad in ("infk", "nank", "1.5K", "1e999k", "k", ""):
        refused(["generate", MODEL, "--prompt", "x", "--max-model-len", bad], "--max-model-len")


def test_several_served_model_names(monkeypatch):
    """vLLM's `--served-model-name a b`: requests may name either, responses report the first;
    a model directory after the names is MODEL."""
    r, cfg, _ = parsed(["serve", "--served-model-name", "a", "b", MODEL, "--port", "8123"], monkeypatch)
    assert cfg.model.served_model_name == ("a", "b") and cfg.model.model == MODEL, r.output
    r, cfg, _ = parsed(["serve", "--served-model-name", "a", "org/b"], monkeypatch)
    assert cfg.model.served_model_name == ("a", "org/b"), r.output
    # a path after the names is MODEL: one that is not there is an error naming it, not a name
    refused(["serve", "--served-model-name", "a", "/no/such/model"], "MODEL '/no/such/model'")
    r, cfg, _ = parsed(["serve", MODEL, "--served-model-name", "a"], monkeypatch)
    assert cfg.model.served_names == ["a"]
    r, cfg, _ = parsed(["serve", MODEL], monkeypatch)
    assert cfg.model.served_names == [MODEL]
    refused(["serve", MODEL, "--served-model-name", "a", "a"], "--served-model-name")

    from rankserve.runtime.serve import anthropic_api, openai_api
    from rankserve.runtime.serve.context import APIError, ServeContext
    ctx = ServeContext(ServerArgs(), ["a", "b"], MODEL, None,
                       types.SimpleNamespace(model_info={"max_model_len": 512}))
    for name in ("a", "b", MODEL, None):
        ctx.check_model(name)
    with pytest.raises(APIError, match="does not exist"):
        ctx.check_model("c")
    assert ctx.served_name("b") == "a"  # the first name, as vLLM documents
    assert openai_api.model_card(ctx, "b")["id"] == "b"
    assert openai_api.model_card(ctx, None)["id"] == "a"
    assert anthropic_api.model_info(ctx, "b")["id"] == "b"


def test_config_file_as_vllm(tmp_path, monkeypatch):
    """`--config config.yaml` (vLLM's): long flag names (dashes or underscores), `model:` is
    MODEL, YAML lists / mappings for repeatable and JSON flags; the command line wins."""
    f = tmp_path / "config.yaml"
    f.write_text(f"model: {MODEL}\nmax-model-len: 1k\nmax_num_seqs: 4\nenable-prefix-caching: false\n"
                 "dtype: half\nserved-model-name: [a, b]\nport: 8123\nuvicorn-log-level: trace\n"
                 "speculative-config: {method: ngram, num_speculative_tokens: 2}\n"
                 "allowed-origins: ['http://x']\n")
    r, cfg, server = parsed(["serve", "--config", str(f)], monkeypatch)
    assert (cfg.model.model, cfg.model.max_model_len, cfg.scheduler.max_num_seqs) == (MODEL, 1000, 4), r.output
    assert not cfg.cache.enable_prefix_caching and cfg.model.dtype == "float16"
    assert cfg.model.served_model_name == ("a", "b") and cfg.spec.num_speculative_tokens == 2
    assert (server.port, server.uvicorn_log_level) == (8123, "trace")
    assert server.cors()["allowed_origins"] == ["http://x"]
    other = tmp_path / "m"
    other.mkdir()
    (other / "config.json").write_text((STORIES_EMBEDDED / "config.json").read_text())
    r, cfg, server = parsed(["serve", str(other), f"--config={f}", "--max-num-seqs", "9",
                             "--enable-prefix-caching", "--port", "8124"], monkeypatch)
    assert (cfg.model.model, cfg.scheduler.max_num_seqs, server.port) == (str(other), 9, 8124), r.output
    assert cfg.cache.enable_prefix_caching and cfg.model.max_model_len == 1000
    # generate and the benches read it too
    g = tmp_path / "g.yaml"
    g.write_text("prompt: [hello]\nmax-tokens: 3\nmax-num-seqs: 2\n")
    r, cfg, _ = parsed(["generate", MODEL, "--config", str(g)], monkeypatch)
    assert cfg.scheduler.max_num_seqs == 2, r.output
    b = tmp_path / "b.yaml"
    b.write_text("max-num-seqs: 3\nbatch-size: 2\n")
    r, cfg, _ = parsed(["bench", "latency", MODEL, "--config", str(b)], monkeypatch)
    assert cfg.scheduler.max_num_seqs == 3, r.output


@pytest.mark.parametrize("text,words", [
    ("swap-space: 4\n", ["'swap-space' is not a flag of `serve`"]),
    ("max-num-seqs: abc\n", ["--max-num-seqs", "abc"]),
    ("max-num-seqs: true\n", ["--max-num-seqs takes a value"]),
    ("- a\n", ["must be a YAML mapping"]),
    ("a: [\n", ["is not valid YAML"]),
    ("config: other.yaml\n", ["cannot name another one"]),
    ("speculative-config: '{bad'\n", ["--speculative-config must be a JSON object"]),
    ("gpu-memory-utilization: 1.5\n", ["--gpu-memory-utilization must be in (0, 1]"]),
])
def test_config_file_errors_name_the_key(tmp_path, text, words):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    refused(["serve", MODEL, "--config", str(f)], *words)


def test_config_file_missing_is_a_flag_error(tmp_path):
    refused(["serve", "--config", str(tmp_path / "nope.yaml")], "--config", "nope.yaml")


def test_host_that_is_no_address_here_names_host():
    with pytest.raises(ValueError, match="--host not.a.host.invalid is not an address"):
        ServerArgs(host="not.a.host.invalid", port=8123).check_port()
    from rankserve.runtime.serve.app import public_url
    assert public_url("::1", 8000) == "http://[::1]:8000"
    assert public_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"


def test_vllms_one_dash_short_flags(monkeypatch):
    """vLLM's -tp / -pp / -dp / -ep (and serve's -asc) mean what their long forms do; they were
    `No such option '-t'`, naming no flag the user typed."""
    r, cfg, _ = parsed(["generate", MODEL, "--prompt", "x", "-tp", "2", "-pp", "1", "-dp", "1", "-ep"],
                       monkeypatch)
    assert cfg.parallel.enable_expert_parallel, r.output  # (a model without experts: refused at load)
    r, cfg, _ = parsed(["generate", MODEL, "--prompt", "x", "-tp", "2", "-pp", "3", "-dp", "4"],
                       monkeypatch)
    p = cfg.parallel
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (2, 3, 4), r.output
    refused(["serve", MODEL, "-asc", "2"], "--api-server-count 2")


@pytest.mark.parametrize("argv,words", [
    (["--cuda-graph-max-bs", "0"], ["--cuda-graph-max-bs must be >= 1"]),  # was accepted
    (["--seed", str(2 ** 70)], ["--seed must be an integer"]),  # was "Overflow when unpacking"
    (["--top-k", "-5"], ["--top-k"]),  # these three were errors after the model loaded
    (["--regex", "("], ["--regex", "parenthesis"]),
    (["--json-schema", "{bad"], ["--json-schema"]),
])
def test_generate_bad_values_name_the_flag_before_loading(argv, words, monkeypatch):
    import rankserve.launch.startup as startup
    monkeypatch.setattr(startup, "run_on_ranks", lambda *a: pytest.fail("the model was loaded"))
    refused(["generate", MODEL, "--prompt", "x", *argv], *words)


@pytest.mark.parametrize("address", ["tcp://", "tcp://127.0.0.1", "tcp://h:99999", "ipc://", "http://x"])
def test_engine_address_forms(address):
    """zmq's own error came after the model loaded (a traceback)."""
    with pytest.raises(ValueError, match="--engine-address must be ipc://PATH or tcp://HOST:PORT"):
        ServerArgs(engine_address=address).validate()


def test_engine_address_not_of_this_machine_is_refused_before_loading():
    import socket
    with socket.socket() as s, socket.socket() as free:  # a port in use, and a free one
        s.bind(("127.0.0.1", 0))
        s.listen()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        busy = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"--engine-address {busy} cannot be bound"):
            ServerArgs(port=port, engine_address=busy).validate().check_port()


@pytest.mark.parametrize("argv,words", [
    (["--port", "99999"], ["--port"]),
    (["--base-url", "foo"], ["--base-url must be http(s)://HOST[:PORT]"]),
    (["--base-url", "http://127.0.0.1:99999"], ["--base-url"]),
])
def test_bench_serve_url_checked_before_sending(argv, words):
    """Every request failed with aiohttp's InvalidUrlClientError (exit 1, 'N requests failed')."""
    r = CliRunner().invoke(cli.main, ["bench", "serve", *argv, "--model", "m", "--num-prompts", "2",
                                      "--random-vocab-size", "100", "--disable-tqdm"])
    assert r.exit_code in (1, 2) and "request(s) failed" not in r.output, r.output
    for w in words:
        assert w in r.output, r.output


@pytest.mark.parametrize("override,words", [
    ('{"top_p": 2}', ["--override-generation-config: top_p must be in (0, 1]"]),
    ('{"top_p": "a"}', ["--override-generation-config: top_p must be a number"]),  # was a TypeError
    ('{"max_new_tokens": 0}', ["--override-generation-config: max_tokens must be >= 1"]),
    ('{"temperature": true}', ["--override-generation-config: temperature must be a number"]),
])
def test_override_generation_config_values_checked_at_start(override, words, monkeypatch):
    """Bad values were taken: the server's every request then failed (offline: a traceback)."""
    for cmd in (["serve", MODEL], ["generate", MODEL, "--prompt", "x"]):
        refused([*cmd, "--override-generation-config", override], *words)


def test_every_command_reads_a_config_file(tmp_path, monkeypatch):
    """`bench throughput` (a command class of its own) had no --config; its LO HI flags take a
    YAML list, or one N (N N, as on the command line)."""
    commands = [c for c in cli.main.commands.values() if c.name != "bench"] + list(cli.bench.commands.values())
    for c in commands:
        assert any("--config" in p.opts for p in c.params), c.name
    f = tmp_path / "t.yaml"
    f.write_text("input-len: [9, 12]\noutput-len: 2\nmax-num-seqs: 5\n")
    assert cli.read_config_file(str(f), cli.bench.commands["throughput"]) == {
        "input_len": ["9", "12"], "output_len": ["2", "2"], "max_num_seqs": "5"}
    r, cfg, _ = parsed(["bench", "throughput", MODEL, "--config", str(f)], monkeypatch)
    assert cfg.scheduler.max_num_seqs == 5, r.output


def test_nan_sampling_values_are_refused(monkeypatch):
    """--temperature nan generated (NaN passed `< 0`); repetition_penalty NaN too."""
    import rankserve.launch.startup as startup
    from rankserve.runtime.sampling_params import SamplingParams
    monkeypatch.setattr(startup, "run_on_ranks", lambda *a: pytest.fail("the model was loaded"))
    refused(["generate", MODEL, "--prompt", "x", "--temperature", "nan"], "--temperature")
    for field in ("temperature", "repetition_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: float("nan")}).validate()


@pytest.mark.parametrize("cmd", [["bench", "serve", "--model", "m", "--random-vocab-size", "100"],
                                 ["bench", "latency", MODEL]])
def test_bench_temperature_nan_is_a_flag_error(cmd):
    """bench serve sent NaN to the server (every request failed); bench latency failed after
    loading the model."""
    refused([*cmd, "--temperature", "nan"], "--temperature")


@pytest.mark.skipif(__import__("shutil").which("mpiexec") is None, reason="mpiexec not on PATH")
def test_a_bad_config_file_on_one_rank_ends_the_mpi_job_naming_it(tmp_path):
    """`mpiexec -n 2 rankserve serve --tp 2 --config c.yaml` where rank 1's file has a bad value:
    the job ends at once with one line naming the flag and the rank (no rank left waiting)."""
    import subprocess
    import sys
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqs: abc\n")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    common = [sys.executable, "-m", "rankserve.launch", "serve", MODEL, "--tp", "2", "--port", port]
    r = subprocess.run(["mpiexec", "-n", "1", *common, ":", "-n", "1", *common, "--config", str(bad)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    lines = [x for x in out.splitlines() if "rankserve: error:" in x]
    assert r.returncode != 0 and len(lines) == 1, out[-3000:]
    assert "rank 1 on" in lines[0] and "--max-num-seqs" in lines[0], out[-3000:]


@pytest.mark.parametrize("size", ["abc", "infK", "0", "-4K"])
def test_bench_comm_sizes_checked_before_the_ranks_start(size, monkeypatch):
    """A bad --sizes was found after the rendezvous ('Invalid value: ...', naming no flag; infK
    an OverflowError, 0 or negative sizes taken)."""
    import rankserve.launch.startup as startup
    monkeypatch.setattr(startup, "start_ranks", lambda *a: pytest.fail("the ranks were started"))
    refused(["bench", "comm", MODEL, "--sizes", f"64K,{size}"], "--sizes", repr(size))


def test_api_key_and_api_key_file_together_are_refused(tmp_path, monkeypatch):
    """The file was silently ignored (--api-key won)."""
    import rankserve.launch.startup as startup
    monkeypatch.setattr(startup, "start_ranks", lambda *a: pytest.fail("the server was started"))
    f = tmp_path / "key"
    f.write_text("secret\n")
    refused(["serve", MODEL, "--api-key", "other", "--api-key-file", str(f)], "--api-key-file")
