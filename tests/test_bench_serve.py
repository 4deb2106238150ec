"""`rankserve bench serve` against a live rankserve server (embedded stories260K): its request and
token counts equal the server's own /metrics counters, shared prefixes hit the prefix cache,
ShareGPT files work, lost tokens and failed requests are counted (exit code 1), the JSON feeds
`bench scaling`."""
from __future__ import annotations

import contextlib
import http.server
import json
import threading

import httpx
import numpy as np
import pytest

from rankserve.runtime.bench import scaling
from rankserve.runtime.bench.serve import ServeBenchArgs, arrivals, parse_goodput, run
from test_server import Server, metric

from conftest import STORIES_EMBEDDED

TOK = str(STORIES_EMBEDDED)


# stories260K is a base model: a minimal chat template lets the chat endpoint serve it
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "16", "--chat-template", CHAT_TEMPLATE)
    yield s
    assert s.stop() == 0


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    names = ("request_success_total", "generation_tokens_total", "prompt_tokens_total",
             "request_prompt_tokens_sum", "request_generation_tokens_sum", "prefix_cache_hits_total")
    # a labelled counter has no sample before its first request
    return {n: metric(text, "rankserve:" + n) if "rankserve:" + n + "{" in text else 0.0 for n in names}


def bench(server, tmp_path, **kw) -> tuple[int, dict, dict]:
    """(exit code, the saved JSON record, the server counters' increase during the run)."""
    before = counters(server.url)
    kw = {"tokenizer": TOK, **kw}
    args = ServeBenchArgs(base_url=server.url, disable_tqdm=True, result_dir=str(tmp_path),
                          result_filename="r.json", **kw)
    code = run(args)
    after = counters(server.url)
    record = json.loads((tmp_path / "r.json").read_text())
    return code, record, {k: after[k] - before[k] for k in after}


def test_counts_match_server_metrics(server, tmp_path):
    code, rec, delta = bench(
        server, tmp_path, num_prompts=24, random_input_len=24, random_output_len=12,
        random_range_ratio=0.5, ignore_eos=True, request_rate=200.0, burstiness=0.5, max_concurrency=6,
        percentile_metrics=("ttft", "tpot", "itl", "e2el"), metric_percentiles=(50.0, 90.0),
        goodput={"e2el": 60_000.0}, plot=str(tmp_path / "p.png"))
    assert code == 0 and rec["completed"] == 24 and rec["failed"] == 0, rec["errors"]
    # the benchmark's numbers are the server's: requests, generated and prompt tokens
    assert delta["request_success_total"] == 24
    assert delta["generation_tokens_total"] == rec["total_output_tokens"]
    assert delta["request_generation_tokens_sum"] == rec["total_output_tokens"]
    assert delta["request_prompt_tokens_sum"] == rec["total_input_tokens"] == sum(rec["input_lens"])
    assert delta["prompt_tokens_total"] <= rec["total_input_tokens"]  # minus prefix-cache hits
    # ignore_eos: every request got exactly the lengths it asked for, drawn in [6, 18]
    assert rec["output_lens"] == [len_ for len_ in rec["output_lens"] if 6 <= len_ <= 18]
    assert sum(rec["output_lens"]) == rec["total_output_tokens"]
    assert 1 <= rec["max_concurrent_requests"] <= 6
    d = rec["duration"]
    assert rec["output_throughput"] == pytest.approx(rec["total_output_tokens"] / d)
    assert rec["request_goodput"] == pytest.approx(rec["request_throughput"])  # a 60 s SLO
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < rec[f"median_{m}_ms"] <= rec[f"p90_{m}_ms"]
    assert rec["p90_ttft_ms"] <= rec["p90_e2el_ms"]
    # one ITL per chunk after the first: at least as many as tokens beyond the first, per request
    assert all(len(itl) <= n - 1 for itl, n in zip(rec["itls"], rec["output_lens"]))
    assert (tmp_path / "p.png").stat().st_size > 0
    assert rec["env"]["client_event_loop"] == "uvloop"  # the cheaper client loop (a dependency)


def test_warmups_run_first_and_stay_out_of_the_results(server, tmp_path):
    """--num-warmups N (as vLLM's): N requests before the measured run, at its concurrency, left
    out of its numbers; drawn like the measured ones from another seed, so the measured prompts
    find nothing of theirs in the prefix cache."""
    code, rec, delta = bench(server, tmp_path, num_prompts=6, num_warmups=5, random_input_len=40,
                             random_output_len=4, ignore_eos=True, max_concurrency=3)
    assert code == 0 and rec["completed"] == 6 and rec["num_warmups"] == 5
    assert delta["request_success_total"] == 6 + 5  # the server saw both
    assert delta["generation_tokens_total"] == rec["total_output_tokens"] + 5 * 4
    assert len(rec["output_lens"]) == 6
    assert delta["prefix_cache_hits_total"] == 0
    with pytest.raises(ValueError, match="--num-warmups"):
        ServeBenchArgs(num_warmups=-1).validate()


def test_shared_prefixes_hit_and_tight_goodput(server, tmp_path):
    code, rec, delta = bench(
        server, tmp_path, dataset_name="prefix_repetition", num_prompts=12, prefix_repetition_prefix_len=64,
        prefix_repetition_suffix_len=8, prefix_repetition_num_prefixes=2, prefix_repetition_output_len=4,
        ignore_eos=True, max_concurrency=2, goodput={"ttft": 0.001})
    assert code == 0 and rec["completed"] == 12
    assert delta["prefix_cache_hits_total"] >= 10 * 64 - 2 * 16  # all but the first of each prefix
    assert delta["prompt_tokens_total"] < rec["total_input_tokens"]
    assert rec["request_goodput"] == 0  # nobody gets a first token in a microsecond


def test_sharegpt_text_prompts(server, tmp_path):
    path = tmp_path / "sg.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Once upon a time there was a {w} who"},
                               {"from": "gpt", "value": "lived in a small house by the sea and sang."}]}
            for w in ("cat", "dog", "bird")]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    code, rec, delta = bench(server, tmp_path, dataset_name="sharegpt", dataset_path=str(path),
                             num_prompts=5, request_rate=50.0)
    assert code == 0 and rec["completed"] == 5 and delta["request_success_total"] == 5
    assert delta["request_prompt_tokens_sum"] == rec["total_input_tokens"] > 5 * 8


def test_chat_endpoint(server, tmp_path):
    """Chat: text prompts (decoded random ids) in a user message; the opening role chunk is not
    a token (TTFT and ITL count only chunks with output)."""
    code, rec, delta = bench(server, tmp_path, endpoint="/v1/chat/completions", num_prompts=6,
                             random_input_len=12, random_output_len=8, ignore_eos=True, max_concurrency=2)
    assert code == 0 and rec["completed"] == 6 and rec["backend"] == "openai-chat", rec["errors"]
    assert rec["output_lens"] == [8] * 6 and delta["generation_tokens_total"] == 48
    assert delta["request_prompt_tokens_sum"] == rec["total_input_tokens"]
    assert all(len(itl) <= 7 for itl in rec["itls"])


@contextlib.contextmanager
def sse_server(events):
    """An OpenAI-style SSE server (model "fake") that streams `events(request)`: the JSON objects
    of one completion stream, then [DONE] unless the list ends with None (a cut stream)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            msgs = events(req)
            for m in msgs:
                if m is not None:
                    self.wfile.write(b"data: " + json.dumps(m).encode() + b"\n\n")
            if not msgs or msgs[-1] is not None:
                self.wfile.write(b"data: [DONE]\n\n")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def _usage(req, n):
    return {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": n}}


def lossy_server():
    """Streams one token fewer than asked for, or (prompts whose first token id is even) cuts
    the stream after two chunks."""
    def events(req):
        n = req["max_tokens"] - 1
        if req["prompt"][0] % 2 == 0:
            return [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}] * 2 + [None]
        return [{"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                for i in range(n)] + [_usage(req, n)]
    return sse_server(events)


def test_failures_and_lost_tokens_are_counted(server, tmp_path):
    # a prompt and output longer than the context: an HTTP 400, counted as a failure
    code, rec, _ = bench(server, tmp_path, num_prompts=2, random_input_len=500, random_output_len=100,
                         ignore_eos=True)
    assert code == 1 and rec["completed"] == 0 and rec["failed"] == 2 and rec["lost_tokens"] == 0
    assert all(e.startswith("HTTP 400") for e in rec["errors"]), rec["errors"]
    # a server that drops a token, and one that cuts a stream: both caught
    with lossy_server() as url:
        args = ServeBenchArgs(base_url=url, random_vocab_size=100, num_prompts=8, random_input_len=4,
                              random_output_len=5, ignore_eos=True, disable_tqdm=True, seed=1,
                              result_dir=str(tmp_path), result_filename="lossy.json")
        assert run(args) == 1
        rec = json.loads((tmp_path / "lossy.json").read_text())
        lost = [e for e in rec["errors"] if e == "lost tokens: asked for 5 (ignore_eos), got 4"]
        cut = [e for e in rec["errors"] if e == "the stream ended without a finish reason"]
        assert rec["failed"] == 8 and lost and cut and len(lost) + len(cut) == 8
        assert rec["lost_tokens"] == len(lost)
    # a server that is not there: every request fails, none hangs
    args = ServeBenchArgs(base_url="http://127.0.0.1:9", model="m", random_vocab_size=100, num_prompts=2,
                          random_input_len=4, random_output_len=2, disable_tqdm=True)
    assert run(args) == 1


def test_scaling_reads_serve_records(server, tmp_path):
    for gpus in (1, 2):
        d = tmp_path / str(gpus)
        d.mkdir()
        code, rec, _ = bench(server, d, num_prompts=4, random_input_len=8, random_output_len=4,
                             ignore_eos=True, metadata={"gpus": str(gpus), "tp": str(gpus)})
        assert code == 0
        (tmp_path / f"serve-{gpus}.json").write_text(json.dumps(rec))
    groups = scaling.run([str(tmp_path / "serve-1.json"), str(tmp_path / "serve-2.json")],
                         str(tmp_path / "out"), make_plot=False)
    assert len(groups) == 1 and [r["gpus"] for r in groups[0]["runs"]] == [1, 2]
    assert groups[0]["runs"][0]["speedup"] == 1.0 and "online" in groups[0]["label"]


def test_args_and_arrivals():
    assert parse_goodput(["ttft:500 tpot:50", "e2el:2000"]) == {"ttft": 500, "tpot": 50, "e2el": 2000}
    with pytest.raises(ValueError, match="METRIC:MILLISECONDS"):
        parse_goodput(["ttft=5"])
    with pytest.raises(ValueError, match="unknown metric"):
        ServeBenchArgs(percentile_metrics=("ttfb",)).validate()
    # gamma gaps: mean 1/rate whatever the burstiness; burstier means more spread
    import asyncio
    gaps = {}
    for b in (0.25, 4.0):
        rng = np.random.default_rng(0)
        slept = []

        async def fake_sleep(s):
            slept.append(s)
        real, asyncio.sleep = asyncio.sleep, fake_sleep
        try:
            async def drain():
                return [i async for i in arrivals(4001, 100.0, b, rng)]
            assert asyncio.run(drain()) == list(range(4001))
        finally:
            asyncio.sleep = real
        gaps[b] = np.asarray(slept)
        assert gaps[b].mean() == pytest.approx(0.01, rel=0.1)
    assert gaps[0.25].std() > 3 * gaps[4.0].std()


def one_chunk_server():
    """Streams all of a request's text in its last chunk (as a server of a model without a
    tokenizer would): TTFT and ITL then time that chunk, which the bench must say."""
    return sse_server(lambda req: [{"choices": [{"index": 0, "text": "x" * req["max_tokens"],
                                                 "finish_reason": "length"}]},
                                   _usage(req, req["max_tokens"])])


def test_warns_when_chunks_are_not_tokens(tmp_path, capsys):
    with one_chunk_server() as url:
        args = ServeBenchArgs(base_url=url, model="m", disable_tqdm=True, num_prompts=3,
                              random_input_len=8, random_output_len=16, random_vocab_size=100,
                              ignore_eos=True)
        assert run(args) == 0
    assert "3 output chunks for 48 tokens" in capsys.readouterr().err


def test_saved_record_has_vllm_keys(server, tmp_path):
    """vLLM's result JSON also has `date` (its file-name stamp), `generated_texts` and
    `max_output_tokens_per_s`: scripts written against `vllm bench serve` read them."""
    import re
    code, rec, _ = bench(server, tmp_path, num_prompts=4, random_input_len=8, random_output_len=6,
                         ignore_eos=True, random_prompt_format="text")
    assert code == 0, rec["errors"]
    assert re.fullmatch(r"\d{8}-\d{6}", rec["date"]), rec.get("date")
    texts = rec["generated_texts"]
    assert len(texts) == 4 and all(isinstance(t, str) and t for t in texts)
    peak = rec["max_output_tokens_per_s"]
    # a peak per whole second: at least the tokens of the busiest second, at most all of them
    assert 0 < peak <= rec["total_output_tokens"]
    assert rec["request_goodput"] is None  # no --goodput: the key is there, as vLLM's (null)
    # strict JSON (JavaScript's JSON.parse, jq --strict): the default infinite rate is vLLM's
    # string "inf", never the token Infinity
    def no_constants(c):
        raise ValueError(f"not JSON: {c}")
    strict = json.loads((tmp_path / "r.json").read_text(), parse_constant=no_constants)
    assert strict["request_rate"] == "inf" and strict["workload"]["request_rate"] == "inf"


def test_plotted_tokens_per_second_follow_token_arrivals():
    """The plot's tok/s over time booked every token of a request at its end: one 10 s request
    of 100 tokens drew a spike at 10 s and nothing before. Its tokens arrive as it streams."""
    from rankserve.runtime.bench.serve import RequestResult, tokens_over_time
    r = RequestResult(success=True, output_tokens=100, start=0.0, ttft=0.1, itl=[0.1] * 99,
                      latency=10.0, chunks=100)
    edges = np.linspace(0, 10, 11)
    rate = tokens_over_time([r], edges)
    assert rate.sum() == pytest.approx(100)  # 1 s bins: tokens per bin = tok/s
    assert rate.min() >= 9 and rate.max() <= 11  # ~10 tok/s all along


def test_summary_prints_vllms_peak_rows():
    """vLLM's summary has "Peak output token throughput" and "Peak concurrent requests"."""
    from rankserve.runtime.bench.serve import RequestResult, format_summary, summarize
    args = ServeBenchArgs(percentile_metrics=("ttft",), metric_percentiles=(99.0,))
    rs = [RequestResult(success=True, prompt_len=4, output_tokens=3, start=0.1 * i, ttft=0.2,
                        itl=[0.1, 0.1], latency=0.4, chunks=3) for i in range(3)]
    text = format_summary(args, summarize(args, rs, 1.0), [])
    import re
    assert re.search(r"^Peak output token throughput \(tok/s\): +9\.00 *$", text, re.M), text
    assert re.search(r"^Peak concurrent requests: +3 *$", text, re.M), text


def test_lora_modules_spread_requests_over_adapters(tmp_path):
    """`--lora-modules a b` (vLLM's form, several names after one flag): every request's model is
    one of the adapters, drawn with the seed; warm-up requests too."""
    from click.testing import CliRunner

    from rankserve.launch.cli import main
    seen = []

    def events(req):
        seen.append(req["model"])
        return [{"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}, _usage(req, 1)]
    with sse_server(events) as url:
        r = CliRunner().invoke(main, ["bench", "serve", "--base-url", url, "--lora-modules", "a", "b",
                                      "--random-vocab-size", "100", "--num-prompts", "40",
                                      "--num-warmups", "4", "--random-input-len", "4",
                                      "--random-output-len", "1", "--disable-tqdm"])
        assert r.exit_code == 0, r.output
        assert len(seen) == 44 and set(seen) == {"a", "b"}
        first = list(seen)
        seen.clear()
        args = ServeBenchArgs(base_url=url, lora_modules=("a", "b"), random_vocab_size=100,
                              num_prompts=40, num_warmups=4, random_input_len=4, random_output_len=1,
                              disable_tqdm=True)
        assert run(args) == 0 and sorted(seen) == sorted(first)  # the same draw for the same seed
