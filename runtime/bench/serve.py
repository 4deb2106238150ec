"""`rankserve bench serve`: an online benchmark against any OpenAI-compatible server.

The flags and the numbers follow vLLM's `vllm bench serve`, so results compare across servers:

- Arrivals: `--request-rate R` requests/s with gaps drawn from a gamma distribution of shape
  `--burstiness` (1: Poisson; < 1 burstier, > 1 more regular; the mean gap stays 1/R), or all at
  once (`inf`, the default); `--max-concurrency N` caps requests in flight either way.
- Datasets (a registry, `DATASETS`): `random` (random token ids, lengths uniform in
  [len·(1-ratio), len·(1+ratio)], sent as token-id prompts or, with `--random-prompt-format text`
  or a chat endpoint, as their decoded text), `sharegpt` (ShareGPT-format JSON/JSONL: the first
  human turn is the prompt, the first reply's length the output length) and `prefix_repetition`
  (shared-prefix workload: N prefixes, each request one of them plus a suffix of its own).
- Every request streams (`/v1/completions` or `/v1/chat/completions`, with
  `stream_options.include_usage`): TTFT = time to the first chunk with output in a choice (a
  chat stream's opening role-only chunk does not count), ITL = gaps between such chunks,
  TPOT = (E2E - TTFT) / (output tokens - 1), E2EL = end to end.
- Nothing may be lost: a request counts as failed on an HTTP error, a stream that ends without a
  finish reason or without `[DONE]`, or (with `--ignore-eos`) fewer or more output tokens than
  asked for; the run prints them and exits with 1.
- Goodput (`--goodput ttft:MS tpot:MS e2el:MS`): completed requests per second that met every
  given SLO (milliseconds).

No torch import: this runs on a login node or a laptop as well as beside the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

import numpy as np

from ..serve import event_loop_factory

METRICS = ("ttft", "tpot", "itl", "e2el")
# the flags each dataset reads (another dataset's are refused, not ignored)
DATASET_FLAGS = {
    **dict.fromkeys(("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"),
                    ("random",)),
    **dict.fromkeys(("random_vocab_size", "random_prompt_format"), ("random", "prefix_repetition")),
    **dict.fromkeys(("dataset_path", "sharegpt_output_len"), ("sharegpt",)),
    **dict.fromkeys(("prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                     "prefix_repetition_num_prefixes", "prefix_repetition_output_len"), ("prefix_repetition",)),
}


@dataclass
class ServeBenchArgs:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # the `model` field of every request (default: the server's first)
    tokenizer: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    num_warmups: int = 0  # requests sent (all at once, under max_concurrency) before the measured run
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_vocab_size: int | None = None
    random_prompt_format: str = "ids"  # ids | text
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)  # metric → SLO in ms
    seed: int = 0
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    plot: str | None = None
    disable_tqdm: bool = False
    profile: bool = False  # POST /start_profile before the measured run, /stop_profile after
    lora_modules: tuple[str, ...] = ()  # adapter names: each request's model drawn from them
    api_key: str | None = None
    request_timeout: float = 6 * 3600.0

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint

    def validate(self) -> ServeBenchArgs:
        from urllib.parse import urlsplit
        try:  # (every request failed with aiohttp's InvalidUrlClientError)
            url = urlsplit(self.base_url)
            ok = url.scheme in ("http", "https") and url.hostname and (url.port or 1) > 0
        except ValueError:  # a port out of range
            ok = False
        if not ok:
            raise ValueError(f"--base-url must be http(s)://HOST[:PORT] (--host / --port: a port in "
                             f"1..65535), got {self.base_url!r}")
        if not self.endpoint.startswith("/"):  # it is appended to --base-url as it is
            raise ValueError(f"--endpoint must be a path such as /v1/completions, got {self.endpoint!r}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}; got {self.dataset_name!r}")
        # another dataset's flags would be ignored: the run would not be the one asked for
        defaults = {f.name: f.default for f in fields(self)}
        for name, datasets in DATASET_FLAGS.items():
            if getattr(self, name) != defaults[name] and self.dataset_name not in datasets:
                raise ValueError(f"--{name.replace('_', '-')} goes with --dataset-name "
                                 f"{' or '.join(datasets)}, not {self.dataset_name}")
        if self.burstiness != 1.0 and self.request_rate == float("inf"):
            raise ValueError("--burstiness shapes the gaps between arrivals: it needs a finite "
                             "--request-rate (inf sends every request at once)")
        if not self.request_rate > 0:  # (nan too: the gaps would be nan, a crash mid-run)
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not 0 < self.burstiness < float("inf"):
            raise ValueError(f"--burstiness must be > 0 (and finite), got {self.burstiness}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        bad = [m for m in (*self.percentile_metrics, *self.goodput) if m not in METRICS]
        if bad:
            raise ValueError(f"unknown metric(s) {', '.join(bad)}: choose from {', '.join(METRICS)} "
                             "(--percentile-metrics, --goodput)")
        if any(not 0 < p <= 100 for p in self.metric_percentiles):
            raise ValueError(f"--metric-percentiles must be in (0, 100], got {self.metric_percentiles}")
        if self.random_prompt_format not in ("ids", "text"):
            raise ValueError("--random-prompt-format must be ids or text")
        return self


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,99` → (50.0, 90.0, 99.0); errors name the flag."""
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], got {text!r}") from None


def parse_goodput(items) -> dict[str, float]:
    """`ttft:500 tpot:50` (vLLM's form, milliseconds) → {"ttft": 500.0, "tpot": 50.0}."""
    out = {}
    for item in items or ():
        for part in item.split():
            name, sep, value = part.partition(":")
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {part!r} is not METRIC:MILLISECONDS") from None
            if not sep or not out[name] >= 0:  # (nan: no request could meet it)
                raise ValueError(f"--goodput: {part!r} is not METRIC:MILLISECONDS")
    return out


# ---- datasets ----------------------------------------------------------------------------------
@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int | None  # known when it was built from tokens
    output_len: int
    model: str | None = None  # its adapter (--lora-modules), else the run's model


def with_adapters(args: ServeBenchArgs, requests: list[SampleRequest], rng) -> list[SampleRequest]:
    """--lora-modules: each request asks for one adapter, drawn uniformly (as vLLM's bench)."""
    if args.lora_modules:
        for r, i in zip(requests, rng.integers(len(args.lora_modules), size=len(requests))):
            r.model = args.lora_modules[i]
    return requests


def _vocab(args: ServeBenchArgs, tokenizer) -> int:
    if args.random_vocab_size:
        return args.random_vocab_size
    if tokenizer is not None:
        return len(tokenizer)
    raise ValueError(f"--dataset-name {args.dataset_name} draws random token ids: give --tokenizer DIR "
                     "(the served model's tokenizer) or --random-vocab-size N")


def _ids_prompt(ids: list[int], args: ServeBenchArgs, tokenizer) -> str | list[int]:
    if args.random_prompt_format == "ids" and not args.chat:
        return ids
    if tokenizer is None:
        raise ValueError("text prompts from random token ids (--random-prompt-format text, or a chat "
                         "endpoint) need --tokenizer DIR to decode them")
    return tokenizer.decode(ids)


def _lens(rng, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_dataset(args: ServeBenchArgs, rng, tokenizer) -> list[SampleRequest]:
    vocab = _vocab(args, tokenizer)
    n = args.num_prompts
    prefix = rng.integers(0, vocab, size=args.random_prefix_len).tolist()
    out = []
    for il, ol in zip(_lens(rng, args.random_input_len, args.random_range_ratio, n),
                      _lens(rng, args.random_output_len, args.random_range_ratio, n)):
        ids = prefix + rng.integers(0, vocab, size=il).tolist()
        out.append(SampleRequest(_ids_prompt(ids, args, tokenizer), len(ids), ol))
    return out


def prefix_repetition_dataset(args: ServeBenchArgs, rng, tokenizer) -> list[SampleRequest]:
    """Shared prefixes: request i uses prefix i mod N plus a random suffix of its own."""
    vocab = _vocab(args, tokenizer)
    prefixes = [rng.integers(0, vocab, size=args.prefix_repetition_prefix_len).tolist()
                for _ in range(args.prefix_repetition_num_prefixes)]
    out = []
    for i in range(args.num_prompts):
        ids = prefixes[i % len(prefixes)] + rng.integers(0, vocab, size=args.prefix_repetition_suffix_len).tolist()
        out.append(SampleRequest(_ids_prompt(ids, args, tokenizer), len(ids),
                                 args.prefix_repetition_output_len))
    rng.shuffle(out)
    return out


def _sharegpt_rows(path: str) -> list:
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        pass
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"--dataset-path {path} is neither JSON nor JSONL (line {i}: {e})") from None
    return rows


def _pair(row) -> tuple[str, str] | None:
    """(first human turn, first reply) of a ShareGPT row; None for a row without them (as
    vLLM, such rows are left out rather than stopping the run)."""
    conv = (row.get("conversations") or row.get("conversation")) if isinstance(row, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    turns = [t.get("value") if isinstance(t, dict) else None for t in conv[:2]]
    return tuple(turns) if all(isinstance(t, str) for t in turns) else None


def sharegpt_dataset(args: ServeBenchArgs, rng, tokenizer) -> list[SampleRequest]:
    """ShareGPT JSON or JSONL: {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    "value": ...}, ...]}. The output length is the reply's token count (needs --tokenizer) or
    --sharegpt-output-len; as vLLM, pairs with < 4 tokens or > 1024 prompt / 2048 total are left out
    when their lengths are known."""
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (JSON or JSONL)")
    if tokenizer is None and args.sharegpt_output_len is None:
        raise ValueError("--dataset-name sharegpt needs --tokenizer DIR (output lengths from the "
                         "replies) or --sharegpt-output-len N")
    pairs = []
    for row in _sharegpt_rows(args.dataset_path):
        if (pair := _pair(row)) is not None:
            pairs.append(pair)
    order = rng.permutation(len(pairs)).tolist()
    out = []
    for i in order:
        prompt, reply = pairs[i]
        plen = len(tokenizer(prompt).input_ids) if tokenizer is not None else None
        olen = args.sharegpt_output_len or len(tokenizer(reply).input_ids)
        if plen is not None and (plen < 4 or olen < 4 or plen > 1024 or plen + olen > 2048):
            continue
        out.append(SampleRequest(prompt, plen, olen))
        if len(out) == args.num_prompts:
            break
    if not out:
        raise ValueError(f"no usable conversation in {args.dataset_path}")
    if len(out) < args.num_prompts:  # as vLLM: repeat to reach --num-prompts
        out = (out * -(-args.num_prompts // len(out)))[:args.num_prompts]
    return out


DATASETS: dict[str, Callable] = {"random": random_dataset, "sharegpt": sharegpt_dataset,
                                 "prefix_repetition": prefix_repetition_dataset}


# ---- one request -------------------------------------------------------------------------------
@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    expected_output: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # seconds since the benchmark started
    finish_reason: str | None = None
    chunks: int = 0  # stream chunks that carried output
    text: str = ""  # the generated text (vLLM's generated_texts)


def _payload(args: ServeBenchArgs, model: str, req: SampleRequest) -> dict:
    body = {"model": req.model or model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": args.temperature, "max_tokens": req.output_len}
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, understood by rankserve
    if args.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = req.prompt
    return body


def _has_output(choice: dict, chat: bool) -> bool:
    """A chunk that carries generated tokens (or ends the choice)."""
    if not chat or choice.get("finish_reason"):
        return True
    return any(v for k, v in (choice.get("delta") or {}).items() if k != "role")


async def send_request(client, url: str, body: dict, req: SampleRequest, chat: bool, t0: float,
                       ignore_eos: bool) -> RequestResult:
    res = RequestResult(expected_output=req.output_len, prompt_len=req.prompt_len or 0)
    start = time.perf_counter()
    res.start = start - t0
    last = None
    done = False
    usage = None
    chunks = 0
    try:
        async with client.post(url, json=body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {text[:300]}"
                return res
            buf = b""
            async for raw in r.content.iter_any():  # SSE: "data: {...}\n\n" events
                buf += raw
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    ev = ev.strip()
                    if not ev.startswith(b"data:"):
                        continue
                    data = ev[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = f"error event: {msg['error']}"
                        return res
                    if msg.get("usage"):
                        usage = msg["usage"]
                    for choice in msg.get("choices") or ():
                        if not _has_output(choice, chat):
                            continue  # a chat stream's opening {"role": "assistant"} chunk
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.text += (choice.get("delta") or {}).get("content") or "" if chat \
                            else choice.get("text") or ""
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001  (a lost connection is a failed request, not a crash)
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.chunks = chunks
    if usage:
        res.output_tokens = usage.get("completion_tokens", 0)
        res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
    else:
        res.output_tokens = chunks  # a server without usage: one token a chunk at best
    if not done or res.finish_reason is None:
        res.error = ("the stream ended without a finish reason" if res.finish_reason is None
                     else "the stream ended without [DONE]")
    elif ignore_eos and res.output_tokens != req.output_len:
        res.error = f"lost tokens: asked for {req.output_len} (ignore_eos), got {res.output_tokens}"
    else:
        res.success = True
    return res


async def arrivals(n: int, rate: float, burstiness: float, rng):
    """Yield 0..n-1, spaced by gamma-distributed gaps of mean 1/rate (shape = burstiness)."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def run_requests(args: ServeBenchArgs, model: str, requests: list[SampleRequest], rng):
    # aiohttp, as vLLM's benchmark: the measuring client must cost far less per SSE chunk than
    # the server (256 streams read ~50,000 chunks a second); httpx did not (runtime/bench/
    # frontend.py --client bench-serve: 44 % of what the server sent, read in bursts)
    import aiohttp
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="requests", unit="req")
    session = aiohttp.ClientSession(
        headers=headers, timeout=aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=60.0),
        connector=aiohttp.TCPConnector(limit=args.max_concurrency or 0))
    async with session as client:
        t0 = time.perf_counter()

        async def one(req):
            async with sem or contextlib.nullcontext():
                out = await send_request(client, url, _payload(args, model, req), req, args.chat, t0,
                                         args.ignore_eos)
            if bar is not None:
                bar.update(1)
            return out
        tasks = []
        async for i in arrivals(len(requests), args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, duration


# ---- metrics -----------------------------------------------------------------------------------
def per_request_values(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric over the completed requests (ITL pooled over every gap)."""
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft for r in ok],
            "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
            "itl": [x for r in ok for x in r.itl],
            "e2el": [r.latency for r in ok]}


def _good(r: RequestResult, slo: dict[str, float]) -> bool:
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    value = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
    # ITL as an SLO: every gap of the request (vLLM takes TPOT for it; a gap is stricter)
    value["itl"] = max(r.itl, default=0.0)
    return all(value[m] * 1e3 <= ms for m, ms in slo.items())


def summarize(args: ServeBenchArgs, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = dict(duration=duration, completed=len(ok), failed=len(failed),
               lost_tokens=sum(1 for r in failed if r.error.startswith("lost tokens")),
               total_input_tokens=total_in, total_output_tokens=total_out,
               request_throughput=len(ok) / duration, output_throughput=total_out / duration,
               total_token_throughput=(total_in + total_out) / duration,
               max_concurrent_requests=_max_concurrent(ok), max_output_tokens_per_s=_peak_tokens_per_s(ok))
    out["request_goodput"] = sum(_good(r, args.goodput) for r in ok) / duration if args.goodput else None
    values = per_request_values(results)
    for m in args.percentile_metrics:
        ms = np.asarray(values[m], dtype=float) * 1e3
        out[f"mean_{m}_ms"] = float(ms.mean()) if ms.size else 0.0
        out[f"median_{m}_ms"] = float(np.median(ms)) if ms.size else 0.0
        out[f"std_{m}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in args.metric_percentiles:
            out[f"p{p:g}_{m}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def _peak_tokens_per_s(ok: list[RequestResult]) -> float:
    """vLLM's max_output_tokens_per_s: output chunks that arrived in the busiest whole second."""
    times = [t for r in ok for t in _chunk_times(r)]
    return float(np.bincount(np.floor(times).astype(int)).max()) if times else 0.0


def _max_concurrent(ok: list[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def format_summary(args: ServeBenchArgs, s: dict, errors: list[str]) -> str:
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]

    def row(label, value, fmt="{:<10}"):
        lines.append(f"{label:<40}" + fmt.format(value))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s["lost_tokens"]:
        row("  of which lost tokens (ignore_eos):", s["lost_tokens"])
    row("Maximum request concurrency:", args.max_concurrency if args.max_concurrency else "-")
    row("Benchmark duration (s):", s["duration"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    if s["request_goodput"] is not None:
        row("Request goodput (req/s):", s["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    row("Total token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in args.percentile_metrics:
        lines.append(f"{'-' * 15}{names[m]}{'-' * 15}")
        row(f"Mean {m.upper()} (ms):", s[f"mean_{m}_ms"], "{:<10.2f}")
        row(f"Median {m.upper()} (ms):", s[f"median_{m}_ms"], "{:<10.2f}")
        for p in args.metric_percentiles:
            row(f"P{p:g} {m.upper()} (ms):", s[f"p{p:g}_{m}_ms"], "{:<10.2f}")
    lines.append("=" * 66)
    for e in errors[:5]:
        lines.append(f"error: {e}")
    if len(errors) > 5:
        lines.append(f"... and {len(errors) - 5} more failed request(s)")
    return "\n".join(lines)


def _chunk_times(r: RequestResult) -> np.ndarray:
    """Seconds since the benchmark started at which the request's output chunks arrived."""
    return np.cumsum([r.start + r.ttft, *r.itl])


def tokens_over_time(ok: list[RequestResult], edges: np.ndarray) -> np.ndarray:
    """Output tokens per second in each bin, a request's tokens spread over its chunks' arrivals."""
    times = [_chunk_times(r) for r in ok]
    weights = [np.full(len(t), r.output_tokens / len(t)) for r, t in zip(ok, times)]
    sums, _ = np.histogram(np.concatenate(times), bins=edges, weights=np.concatenate(weights))
    return sums / np.diff(edges)


def plot(path: str, results: list[RequestResult], s: dict) -> bool:
    """TTFT / TPOT / ITL histograms and output tokens/s over time; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    values = per_request_values(results)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, m in zip(axes.flat, ("ttft", "tpot", "itl")):
        ms = np.asarray(values[m]) * 1e3
        if ms.size:
            ax.hist(ms, bins=40)
        ax.set_title(f"{m.upper()} (ms)", fontsize=9)
        ax.set_ylabel("count")
    ax = axes.flat[3]
    ok = [r for r in results if r.success]
    if ok:
        edges = np.linspace(0, max(s["duration"], 1e-9), 41)
        ax.step(edges[1:], tokens_over_time(ok, edges), where="pre")
    ax.set_title("output tok/s (by chunk arrival)", fontsize=9)
    ax.set_xlabel("seconds")
    fig.suptitle(f"{s['completed']} requests, {s['output_throughput']:.0f} output tok/s", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the command -------------------------------------------------------------------------------
def _server_model(args: ServeBenchArgs) -> str:
    import aiohttp
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def first_model() -> str:  # the streaming client's library, for one GET
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(args.base_url.rstrip("/") + "/v1/models") as r:
                r.raise_for_status()
                return (await r.json(content_type=None))["data"][0]["id"]
    try:
        return asyncio.run(first_model())
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot list the models of {args.base_url} ({e}); is the server up? "
                         "(or pass --model)") from None


async def _profile_call(args: ServeBenchArgs, action: str) -> dict:
    """POST /start_profile or /stop_profile (vLLM's); the server's error, if any, as a ValueError."""
    import aiohttp
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    # (stopping waits for every rank's trace to be written)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async with s.post(args.base_url.rstrip("/") + f"/{action}_profile") as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                msg = body.get("error", {}).get("message") if isinstance(body, dict) else body
                raise ValueError(f"--profile: POST /{action}_profile answered {r.status}: {msg}")
            return body


def _environment() -> dict:
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                host=platform.node(), python=platform.python_version(),
                client_event_loop="asyncio" if event_loop_factory() is None else "uvloop",
                command=" ".join(["rankserve"] + [shlex.quote(a) for a in sys.argv[1:]]),
                argv=list(sys.argv))


def warm_up(runner: asyncio.Runner, args: ServeBenchArgs, model: str, tokenizer) -> None:
    """--num-warmups: that many requests, drawn like the measured ones but from another seed
    (the measured prompts find none of theirs in the prefix cache), all at once under
    --max-concurrency, before the measured run; their numbers are not kept."""
    w = replace(args, num_prompts=args.num_warmups, request_rate=float("inf"), burstiness=1.0,
                disable_tqdm=True)
    rng = np.random.default_rng([args.seed, 1])
    warm = with_adapters(args, DATASETS[args.dataset_name](w, rng, tokenizer)[:args.num_warmups], rng)
    print(f"warming up with {len(warm)} requests", flush=True)
    results, seconds = runner.run(run_requests(w, model, warm, rng))
    if failed := sum(not r.success for r in results):
        print(f"warning: {failed} of {len(results)} warm-up request(s) failed", file=sys.stderr)
    print(f"warm-up done in {seconds:.1f} s", flush=True)



def _inf_as_string(x):
    """The infinite default rate as vLLM writes it ("inf"): strict JSON has no Infinity."""
    if isinstance(x, float) and x == float("inf"):
        return "inf"
    if isinstance(x, dict):
        return {k: _inf_as_string(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_inf_as_string(v) for v in x]
    return x

def run(args: ServeBenchArgs) -> int:
    """Run the benchmark, print the summary, save JSON / plot; 0, or 1 when requests failed."""
    args.validate()
    # where the results go, before the run that makes them
    if args.save_result or args.result_dir or args.result_filename:
        from .common import check_writable
        if args.result_filename:
            check_writable(os.path.join(args.result_dir or ".", args.result_filename), "--result-filename")
        else:
            check_writable(args.result_dir or ".", "--result-dir", directory=True)
    if args.plot:
        from .common import check_writable
        check_writable(args.plot, "--plot")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as e:  # (a path that is not there reads as a hub repo id)
            raise ValueError(f"--tokenizer {args.tokenizer}: cannot load a tokenizer from it "
                             f"({str(e).splitlines()[0]})") from None
    rng = np.random.default_rng(args.seed)
    requests = DATASETS[args.dataset_name](args, rng, tokenizer)[:args.num_prompts]
    with_adapters(args, requests, np.random.default_rng([args.seed, 2]))
    model = args.model or _server_model(args)
    print(f"{len(requests)} requests ({args.dataset_name}) to {args.base_url}{args.endpoint}, model "
          f"{'/'.join(args.lora_modules) or model}; rate {args.request_rate} req/s "
          f"(burstiness {args.burstiness}), max concurrency "
          f"{args.max_concurrency or '-'}", flush=True)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop: a cheaper client
        if args.num_warmups:
            warm_up(runner, args, model, tokenizer)
        if args.profile:
            runner.run(_profile_call(args, "start"))
            print("profiling the server (POST /start_profile)", flush=True)
        results, duration = runner.run(run_requests(args, model, requests, rng))
        if args.profile:
            for t in runner.run(_profile_call(args, "stop")).get("traces", []):
                print(f"trace: {t}", flush=True)
    s = summarize(args, results, duration)
    errors = [r.error for r in results if not r.success]
    print(format_summary(args, s, errors), flush=True)
    record = dict(kind="serve", date=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
                  env=_environment(), backend="openai-chat" if args.chat else "openai",
                  base_url=args.base_url, endpoint=args.endpoint, model_id=model,
                  tokenizer_id=args.tokenizer, num_prompts=len(requests), request_rate=args.request_rate,
                  burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                  num_warmups=args.num_warmups, goodput_slo_ms=args.goodput or None, metadata=args.metadata,
                  workload=workload(args), **s,
                  input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                  ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                  generated_texts=[r.text for r in results],
                  errors=errors, args={k: v for k, v in asdict(args).items() if k != "api_key"})
    if args.save_result or args.result_dir or args.result_filename:
        name = args.result_filename or (
            f"serve-{args.dataset_name}-{'inf' if args.request_rate == float('inf') else f'{args.request_rate:g}'}qps"
            f"{f'-c{args.max_concurrency}' if args.max_concurrency else ''}-"
            f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        path = os.path.join(args.result_dir or ".", name)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(_inf_as_string(record), f, indent=2, default=str)
        print(f"wrote {path}")
    if args.plot:
        if plot(args.plot, results, s):
            print(f"wrote {args.plot}")
        else:
            print("matplotlib is not installed (pip install 'rankserve[bench]'); no plot")
    ok = [r for r in results if r.success and r.output_tokens > 1]
    if ok and sum(r.chunks for r in ok) < 0.5 * sum(r.output_tokens for r in ok):
        # e.g. a model served without a tokenizer: no text, so no chunk until the last one
        print(f"warning: {sum(r.chunks for r in ok)} output chunks for {sum(r.output_tokens for r in ok)} "
              "tokens: TTFT, TPOT and ITL time chunks, not tokens (does the server stream text "
              "for every token?)", file=sys.stderr)
    if failed := s["failed"]:
        print(f"{failed} of {len(results)} request(s) failed or lost tokens", file=sys.stderr)
        return 1
    return 0


def workload(args: ServeBenchArgs) -> dict:
    """What makes two runs the same workload (bench scaling groups runs by it)."""
    w = dict(dataset=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed,
             request_rate=args.request_rate, burstiness=args.burstiness,
             max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, endpoint=args.endpoint)
    if args.dataset_name == "random":
        w.update(input_len=args.random_input_len, output_len=args.random_output_len,
                 range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len)
    elif args.dataset_name == "prefix_repetition":
        w.update(prefix_len=args.prefix_repetition_prefix_len, suffix_len=args.prefix_repetition_suffix_len,
                 num_prefixes=args.prefix_repetition_num_prefixes, output_len=args.prefix_repetition_output_len)
    else:
        w.update(dataset_path=os.path.basename(args.dataset_path or ""), output_len=args.sharegpt_output_len)
    return w
