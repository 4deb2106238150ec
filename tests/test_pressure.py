"""A live server under KV pressure (stories260K, 13 blocks of 8 tokens, a 16-token step budget,
async scheduling, priorities, the host KV tier): many concurrent streaming clients, greedy, with
n = 2, stop strings and logprobs, a quarter of them hanging up mid-stream. Every stream that
runs to its end carries exactly the tokens, text and finish_reason of an unconstrained offline
run (no token lost or repeated across preemptions) and the right usage; afterwards nothing is
running or waiting and no KV block is held (/metrics)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from rankserve import LLM, SamplingParams
from test_server import Server, metric

STOPS = ["e ", "the", "."]


def jobs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    out = []
    for i in range(count):
        prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + \
            [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
        out.append(dict(prompt=prompt, max_tokens=rng.randrange(1, 40), n=rng.choice((1, 1, 2)),
                        stop=[rng.choice(STOPS)] if rng.random() < 0.3 else [],
                        include_stop_str_in_output=rng.random() < 0.5,
                        logprobs=rng.choice((None, 1)), priority=i % 3, hang_up=rng.random() < 0.25,
                        delay=rng.random() * 2))
    return out


async def stream(c: httpx.AsyncClient, job: dict) -> dict | None:
    """The choices' tokens, text, finish_reason and logprob count, and the usage; None if the
    client hung up."""
    await asyncio.sleep(job["delay"])
    body = {k: job[k] for k in ("prompt", "max_tokens", "n", "stop", "include_stop_str_in_output",
                                "logprobs", "priority")}
    body.update(temperature=0, ignore_eos=True, stream=True, return_token_ids=True,
                stream_options={"include_usage": True})
    got = {i: dict(tokens=[], text="", finish=None, logprobs=0) for i in range(job["n"])}
    usage, chunks = None, 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage") and not event["choices"]:
                usage = event["usage"]
            for ch in event["choices"]:
                g = got[ch["index"]]
                g["tokens"] += ch.get("token_ids") or []
                g["text"] += ch["text"]
                g["finish"] = ch["finish_reason"] or g["finish"]
                g["logprobs"] += len(ch["logprobs"]["tokens"]) if ch.get("logprobs") else 0
            chunks += 1
            if job["hang_up"] and chunks > 2:
                return None  # leaving the block closes the connection mid-stream
    return dict(choices=got, usage=usage)


def test_streams_under_kv_pressure_with_hang_ups_match_an_unconstrained_run():
    todo = jobs(0, 48)
    offline = LLM(max_model_len=96).generate(
        [{"prompt_token_ids": j["prompt"]} for j in todo],
        [SamplingParams(temperature=0, ignore_eos=True, **{k: j[k] for k in (
            "max_tokens", "n", "stop", "include_stop_str_in_output")}) for j in todo])
    server = Server("--max-model-len", "96", "--block-size", "8", "--num-gpu-blocks-override", "13",
                    "--max-num-batched-tokens", "16", "--async-scheduling", "--scheduling-policy",
                    "priority", "--kv-offload-size", "0.0001")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            results = await asyncio.gather(*[stream(c, j) for j in todo])
            for _ in range(100):  # the engine takes in the hang-ups' aborts
                m = (await c.get("/metrics")).text
                if metric(m, "rankserve:num_requests_running") == 0 and \
                        metric(m, "rankserve:num_requests_waiting") == 0:
                    break
                await asyncio.sleep(0.1)
            return results, m
    try:
        results, m = asyncio.run(main())
    finally:
        server.stop()
    done = 0
    for k, (job, res, want) in enumerate(zip(todo, results, offline)):
        if res is None:
            continue
        done += 1
        for i, w in enumerate(want.outputs):
            g = res["choices"][i]
            assert (g["tokens"], g["text"], g["finish"]) == (w.token_ids, w.text, w.finish_reason), (k, i)
            assert g["logprobs"] == (len(w.token_ids) if job["logprobs"] else 0), (k, i)
        assert res["usage"]["prompt_tokens"] == len(job["prompt"]), k
        assert res["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want.outputs), k
    assert done >= 30
    assert metric(m, "rankserve:num_preemptions_total") > 0
    assert metric(m, "rankserve:num_requests_running") == metric(m, "rankserve:num_requests_waiting") == 0
    assert metric(m, "rankserve:kv_cache_usage_perc") == 0 and metric(m, "rankserve:kv_cache_blocks_used") == 0
