"""CPU benchmark of the online path without a GPU: how many output tokens per second the API
process can carry, and what each stage costs per token.

`python -m rankserve.runtime.bench.frontend --tokenizer ../shared/tokenizers/qwen3`

- `e2e`: the real API process (`python -m rankserve.runtime.serve.app`: uvicorn, the OpenAI
  handlers, the output processor and detokenizer, SSE) against a fake engine core on the same
  ZMQ protocol that emits one token per running request every `--step-ms` (as fast as the GPU
  would: W1's decode step on an H200 is ~5 ms at 256 requests), driven by a light raw-socket
  client keeping `--concurrency` streams open (W1's lengths by default), or with
  `--client bench-serve` through `rankserve bench serve`'s own client. Reports the output
  tokens/s that reach the clients against the tokens/s the engine offered, the API process's CPU
  time per token, chunks per token, and the gaps between chunks; `fraction_of_ideal` is the
  run's time with an API that cost nothing over its measured time (the issue's "online as fast
  as offline", with the engine's speed taken out). `--profile FILE` runs the API
  process under cProfile.
- `stages`: the same per-step messages through the API side's stages in one process, timed one
  by one: msgpack decode, output processor (detokenization), the client's hand-out (updates,
  metrics, queues), and the OpenAI handlers through the ASGI app (chunks, SSE framing), without
  the HTTP server, in CPU µs per token; then `intake`: a burst of `--concurrency` requests
  through the app until the last reaches the engine client (wall ms, CPU ms per request).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

TEXT_VOCAB = 151643  # Qwen3's ordinary tokens (the specials follow)


def _lengths(rng, n: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi + 1, n)]


# ---- the fake engine core ---------------------------------------------------------------------
def fake_engine(address: str, step_ms: float, vocab: int, seed: int = 0) -> None:
    """An engine core on the real protocol (runtime/serve/engine_proc.py) that decodes every
    running request by one random token each step, on a fixed clock (it never waits for the
    API, as a GPU would not). The first token of a request comes with the step after it arrived."""
    import zmq

    from ..messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType,
                            FinishReason, SchedulerStats, encoder, request_decoder)
    import msgspec
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)
    sock.bind(address)
    rng = np.random.default_rng(seed)
    running: dict[str, int] = {}  # request id → tokens left
    peer, period, steps, tokens = None, step_ms / 1000, 0, 0
    next_step = time.monotonic()
    while True:
        timeout = max(0.0, next_step - time.monotonic()) if running else 0.1
        if sock.poll(int(timeout * 1000)):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                peer, kind, payload = frames[0], EngineCoreRequestType(frames[1]), frames[2]
                if kind == EngineCoreRequestType.ADD:
                    req = request_decoder.decode(payload)
                    running[req.request_id] = req.sampling_params.max_tokens
                elif kind == EngineCoreRequestType.ABORT:
                    for rid in msgspec.msgpack.decode(payload, type=list[str]):
                        running.pop(rid, None)
                elif kind == EngineCoreRequestType.UTILITY:
                    call_id, method, args = msgspec.msgpack.decode(payload)
                    result = {"get_model_info": {"max_model_len": 4096, "vocab_size": 151936,
                                                 "num_blocks": 100000, "block_size": 16},
                              "ready": True, "stats": [steps, tokens]}.get(method)
                    sock.send_multipart([peer, encoder.encode(
                        EngineCoreOutputs(utility_result=(call_id, result, None)))])
                elif kind == EngineCoreRequestType.SHUTDOWN:
                    return
            if not running:
                next_step = time.monotonic()
            continue
        if not running or time.monotonic() < next_step:
            continue
        next_step = max(next_step + period, time.monotonic())  # late steps are not made up
        ids = rng.integers(0, vocab, len(running)).tolist()
        outs = []
        for (rid, left), tok in zip(list(running.items()), ids):
            done = left <= 1
            outs.append(EngineCoreOutput(rid, [tok], finish_reason=FinishReason.LENGTH if done else None))
            if done:
                del running[rid]
            else:
                running[rid] = left - 1
        steps, tokens = steps + 1, tokens + len(outs)
        sock.send_multipart([peer, encoder.encode(EngineCoreOutputs(
            outputs=outs, stats=SchedulerStats(num_running=len(running), num_generation_tokens=len(outs)),
            timestamp=time.monotonic()))], copy=False)


# ---- the client -------------------------------------------------------------------------------
async def _one(port: int, body: bytes, path: str) -> tuple[int, list[float], int, float]:
    """One streamed request over a raw socket: (completion tokens, arrival times of the reads
    that carried chunks, output chunks, start time)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
    times, chunks, tail = [], 0, b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        n = data.count(b"data: {")
        if n:
            times.append(time.perf_counter())
            chunks += n
        tail = (tail + data)[-4096:]
    writer.close()
    i = tail.rfind(b'"completion_tokens":')
    if i < 0 or b"[DONE]" not in tail:
        raise RuntimeError(f"a stream ended badly: {tail[-300:]!r}")
    tokens = int(tail[i + 20:].split(b",")[0].split(b"}")[0])
    return tokens, times, chunks - 1 - (path.endswith("chat/completions")), start  # usage (+ role)


async def _drive(port: int, bodies: list[bytes], path: str, concurrency: int) -> dict:
    todo = list(reversed(bodies))
    results = []

    async def worker():
        while todo:
            results.append(await _one(port, todo.pop(), path))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(t) for _, t, _, _ in results if len(t) > 1])
    out = _gap_stats(gaps, wall, sum(r[0] for r in results), sum(r[2] for r in results))
    # the first `concurrency` requests arrive at once: the API's share of a burst's TTFT (the
    # fake engine's first token comes one step after a request arrived)
    first = sorted(results, key=lambda r: r[3])[:concurrency]
    ttft = np.array([r[1][0] - r[3] for r in first]) * 1000
    return {**out, "burst_ttft_ms_mean": float(ttft.mean()), "burst_ttft_ms_p99": float(np.percentile(ttft, 99))}


def _gap_stats(gaps_s, wall: float, tokens: int, chunks: int) -> dict:
    gaps = np.asarray(gaps_s) * 1000
    return {"wall_s": wall, "output_tokens": tokens, "chunks": chunks,
            "gap_ms_p50": float(np.percentile(gaps, 50)), "gap_ms_p99": float(np.percentile(gaps, 99)),
            "gap_ms_mean": float(gaps.mean())}


async def _drive_bench_serve(port: int, bodies: list[bytes], path: str, concurrency: int) -> dict:
    """The same requests through `rankserve bench serve`'s client (aiohttp, a JSON parse per chunk)."""
    from .serve import SampleRequest, ServeBenchArgs, run_requests
    args = ServeBenchArgs(base_url=f"http://127.0.0.1:{port}", endpoint=path, model="bench",
                          max_concurrency=concurrency, ignore_eos=True, disable_tqdm=True)
    reqs = []
    for b in map(json.loads, bodies):
        prompt = b.get("prompt") or b["messages"][0]["content"]
        reqs.append(SampleRequest(prompt, None, b["max_tokens"]))
    results, wall = await run_requests(args, "bench", reqs, np.random.default_rng(0))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    return _gap_stats([g for r in results for g in r.itl], wall,
                      sum(r.output_tokens for r in results), sum(r.chunks for r in results))


def client(kind: str, port: int, bodies: list[bytes], path: str, concurrency: int, out) -> None:
    drive = _drive if kind == "raw" else _drive_bench_serve
    out.put(asyncio.run(drive(port, bodies, path, concurrency)))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ideal_s(outs: list[int], concurrency: int, step_ms: float) -> float:
    """The run's time with an API that costs nothing: each of `concurrency` clients sends its
    next request when the last one ends, and a request of L tokens takes L engine steps."""
    import heapq
    free = [0] * concurrency
    for n in outs:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free) * step_ms / 1000


def _bodies(args, chat: bool) -> list[bytes]:
    rng = np.random.default_rng(args.seed)
    outs = _lengths(rng, args.num_requests, *args.output_len)
    args.ideal_s = _ideal_s(outs, args.concurrency, args.step_ms)
    ins = _lengths(rng, args.num_requests, *args.input_len)
    bodies = []
    for i, o in zip(ins, outs):
        body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": o, "ignore_eos": True, "temperature": 0.0}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi " * (i // 2)}]
        else:
            body["prompt"] = rng.integers(0, TEXT_VOCAB, i).tolist()
        bodies.append(json.dumps(body).encode())
    return bodies


def run_e2e(args) -> dict:
    chat = args.endpoint == "chat"
    address = f"ipc://{tempfile.gettempdir()}/rankserve-frontend-bench-{uuid.uuid4().hex[:8]}"
    spawn = mp.get_context("spawn")
    engine = spawn.Process(target=fake_engine, args=(address, args.step_ms, TEXT_VOCAB), daemon=True)
    engine.start()
    port = _free_port()
    settings = {"server_args": {"port": port}, "engine_address": address, "model": args.tokenizer,
                "tokenizer": args.tokenizer, "served_model_name": "bench", "engine_pid": None}
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    api = subprocess.Popen([sys.executable, *prof, "-m", "rankserve.runtime.serve.app"],
                           stdin=subprocess.PIPE)
    api.stdin.write(json.dumps(settings).encode())
    api.stdin.close()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if api.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the API process did not start") from None
                time.sleep(0.2)
        bodies = _bodies(args, chat)
        q = spawn.Queue()
        cpu0 = _cpu_s(api.pid)
        cl = spawn.Process(target=client, args=(args.client, port, bodies, "/v1/chat/completions" if chat
                                                else "/v1/completions", args.concurrency, q))
        cl.start()
        res = q.get()
        cl.join()
        cpu = _cpu_s(api.pid) - cpu0
    finally:
        api.terminate()
        api.wait(30)
        engine.kill()
    offered = args.concurrency * 1000 / args.step_ms
    tok = res["output_tokens"]
    return {"stage": "e2e", "endpoint": args.endpoint, "client": args.client,
            "concurrency": args.concurrency,
            "step_ms": args.step_ms, "offered_tok_s": offered,
            "output_tok_s": tok / res["wall_s"], "ideal_tok_s": tok / args.ideal_s,
            "fraction_of_ideal": args.ideal_s / res["wall_s"],
            "api_cpu_us_per_token": cpu / tok * 1e6, "api_cpu_busy": cpu / res["wall_s"],
            "tokens_per_chunk": tok / max(res["chunks"], 1),
            "gap_p99_over_step": res["gap_ms_p99"] / args.step_ms, **res}


# ---- stages, in one process -------------------------------------------------------------------
def run_stages(args) -> dict:
    """Per-token cost of each API-side stage for `--concurrency` streams over `--steps` steps."""
    from ..inputs import load_tokenizer
    from ..messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats, encoder, outputs_decoder
    from ..outputs import OutputProcessor
    from ..sampling_params import SamplingParams
    tokenizer = load_tokenizer(args.tokenizer)
    gc.collect()
    gc.freeze()  # as the API process does after its start-up (runtime/serve/app.py)
    n, steps = args.concurrency, args.steps
    rng = np.random.default_rng(args.seed)
    ids = [f"r{i}" for i in range(n)]
    msgs = []
    for s in range(steps):
        last = s == steps - 1
        toks = rng.integers(0, TEXT_VOCAB, n).tolist()
        msgs.append(encoder.encode(EngineCoreOutputs(
            outputs=[EngineCoreOutput(r, [t], finish_reason=FinishReason.LENGTH if last else None)
                     for r, t in zip(ids, toks)], stats=SchedulerStats(), timestamp=time.monotonic())))
    tokens = n * steps
    out = {"stage": "stages", "concurrency": n, "steps": steps}

    def timed(name, fn):  # CPU time: steadier than wall time on a shared machine
        t0 = time.process_time()
        fn()
        out[name + "_us_per_token"] = (time.process_time() - t0) / tokens * 1e6

    decoded = []
    timed("decode", lambda: decoded.extend(outputs_decoder.decode(m) for m in msgs))
    decoded = [outputs_decoder.decode(m) for m in msgs]
    prompt = rng.integers(0, TEXT_VOCAB, 500).tolist()
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    proc = OutputProcessor(tokenizer)
    for r in ids:
        proc.add_request(r, None, prompt, params)
    timed("detokenize", lambda: [proc.process(o) for d in decoded for o in d.outputs])
    asyncio.run(_asgi_stages(args, tokenizer, msgs, prompt, out, tokens))
    return out


async def _asgi_stages(args, tokenizer, msgs, prompt, out, tokens) -> None:
    """The client's hand-out alone, then with the OpenAI handlers consuming through the app."""
    from ..messages import outputs_decoder
    from ..serve.app import ServeState, build_app
    from ..serve.args import ServerArgs
    from ..serve.client import EngineClient
    from ..serve.context import ServeContext
    from ..serve.metrics import Metrics
    n = args.concurrency

    def make_client():
        c = EngineClient("inproc://none", tokenizer, [151645], Metrics("bench", 1))
        c._send = lambda *a, **k: None
        c.model_info = {"max_model_len": 4096, "vocab_size": 151936, "block_size": 16}
        return c

    # the hand-out alone: requests registered as the handlers would, queues left unread
    from ..sampling_params import SamplingParams
    c = make_client()
    params = SamplingParams(max_tokens=len(msgs), ignore_eos=True)
    streams = [c.generate(prompt, params, request_id=f"r{i}") for i in range(n)]
    t0 = time.process_time()
    for m in msgs:
        c._handle(outputs_decoder.decode(m))
    out["handout_us_per_token"] = (time.process_time() - t0) / tokens * 1e6
    del streams

    # the whole app: n streamed requests through the ASGI app, one engine message per step
    c = make_client()
    ctx = ServeContext(ServerArgs(), "bench", args.tokenizer, tokenizer, c)
    app = build_app(ctx, Metrics("bench", 1), ServeState())
    sent = [0]
    endpoint = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    chat = args.endpoint == "chat"

    async def request(i):
        body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": len(msgs), "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = prompt
        raw = json.dumps(body).encode()
        done = asyncio.Event()
        msgs_in = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if msgs_in:
                return msgs_in.pop()
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                sent[0] += message.get("body", b"").count(b"data: {")
                if not message.get("more_body"):
                    done.set()
        await app(_scope(endpoint, raw), receive, send)
    orig_generate = c.generate
    rid_of = {}

    def generate(*a, **k):  # the engine's request ids follow the fake messages' r0..rN
        k["request_id"] = f"r{len(rid_of)}"
        rid_of[k["request_id"]] = True
        return orig_generate(*a, **k)
    c.generate = generate
    tasks = [asyncio.create_task(request(i)) for i in range(n)]
    while len(rid_of) < n:
        await asyncio.sleep(0)
    for _ in range(50):
        await asyncio.sleep(0)
    t0 = time.process_time()
    for m in msgs:
        c._handle(outputs_decoder.decode(m))
        await asyncio.sleep(0)  # each handler takes its update, as between two engine messages
    await asyncio.gather(*tasks)
    out["app_total_us_per_token"] = (time.process_time() - t0) / tokens * 1e6
    out["app_chunks_per_token"] = sent[0] / tokens
    await _intake(args, app, c, out)


async def _intake(args, app, client, out) -> None:
    """A burst of `--concurrency` requests (W1's prompt lengths, token ids or a chat message)
    through the app, timed until the last one is handed to the engine client: the API's share of
    a burst's TTFT, and its CPU time per request (the tokenizer threads included)."""
    rng = np.random.default_rng(args.seed)
    chat, n = args.endpoint == "chat", args.concurrency
    bodies = []
    for i in _lengths(rng, n, *args.input_len):
        body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi " * (i // 2)}]
        else:
            body["prompt"] = rng.integers(0, TEXT_VOCAB, i).tolist()
        bodies.append(json.dumps(body).encode())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    handed, all_in = [], asyncio.Event()
    generate = client.generate

    def counting(*a, **k):
        handed.append(1)
        if len(handed) == n:
            all_in.set()
        return generate(*a, **k)
    client.generate = counting

    async def request(raw: bytes):
        msgs_in = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if msgs_in:
                return msgs_in.pop()
            await asyncio.Event().wait()  # never disconnects; cancelled at the end

        async def send(message):
            if message["type"] == "http.response.start" and message["status"] != 200:
                raise RuntimeError(f"intake: HTTP {message['status']}")
        await app(_scope(path, raw), receive, send)
    t0, c0 = time.perf_counter(), time.process_time()
    requests = asyncio.gather(*(request(b) for b in bodies))  # they wait for tokens: never end
    await asyncio.wait([asyncio.ensure_future(all_in.wait()), requests],
                       return_when=asyncio.FIRST_COMPLETED)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    if requests.done():
        requests.result()  # a request failed: raise its error
    requests.cancel()
    await asyncio.gather(requests, return_exceptions=True)
    out["intake_requests"] = n
    out["intake_ms"] = wall * 1000  # the last request reaches the engine client
    out["intake_cpu_ms_per_request"] = cpu * 1000 / n


def _scope(path: str, raw: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "scheme": "http",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(raw)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rankserve.runtime.bench.frontend",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "../../../shared/tokenizers/qwen3"))
    p.add_argument("--mode", choices=("e2e", "stages", "both"), default="both")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--client", choices=("raw", "bench-serve"), default="raw",
                   help="e2e: a raw-socket client that only counts chunks, or `rankserve bench "
                        "serve`'s own (to see what the measuring client costs)")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--input-len", type=int, nargs=2, default=(100, 1023), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(100, 1023), metavar=("MIN", "MAX"))
    p.add_argument("--steps", type=int, default=100, help="stages: engine steps per stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="e2e: cProfile output of the API process")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    args.tokenizer = os.path.abspath(args.tokenizer)
    results = []
    if args.mode in ("stages", "both"):
        results.append(run_stages(args))
        print(json.dumps(results[-1], indent=1), flush=True)
    if args.mode in ("e2e", "both"):
        results.append(run_e2e(args))
        print(json.dumps(results[-1], indent=1), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
