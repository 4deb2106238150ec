"""OpenAI / vLLM / Anthropic semantics a client relies on, through the official clients and raw
HTTP on a live server (the embedded stories260K, whose greedy text is known; a one-line chat
template so the chat, Messages and Responses routes serve it too)."""
from __future__ import annotations

import httpx
import pytest

from test_server import STORIES_TEXT, Server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    s = Server("--chat-template", TEMPLATE, "--max-num-seqs", "32", "--served-model-name", "s")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def complete(client, **kw):
    return client.completions.create(**{"model": "s", "prompt": PROMPT, "temperature": 0, **kw})


def test_min_tokens_holds_back_stop_strings(client):
    """vLLM: stop strings (like EOS and stop_token_ids) count only once min_tokens tokens are
    out; the greedy story has a "." after 8 tokens, and min_tokens=12 must not stop there."""
    plain = complete(client, max_tokens=30, stop=["."]).choices[0]
    assert plain.text == ", there was a little girl named Lily" and plain.finish_reason == "stop"
    c = complete(client, max_tokens=30, stop=["."], extra_body={"min_tokens": 12}).choices[0]
    assert c.text == STORIES_TEXT.split(" park.")[0] + " park", c.text
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == "."
    streamed = complete(client, max_tokens=30, stop=["."], extra_body={"min_tokens": 12},
                        stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == c.text


def test_completion_top_logprobs_include_the_sampled_token(client):
    """OpenAI completions: "the API will always return the logprob of the sampled token, so
    there may be up to logprobs+1 elements" (vLLM too; logprobs=0 gives the sampled one)."""
    for k in (0, 1):
        r = complete(client, max_tokens=40, temperature=1.5, seed=3, logprobs=k)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 40
        for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[tok] == pytest.approx(p), (tok, top)
            assert k <= len(top) <= k + 1
        if k == 1:  # at this temperature some sampled tokens are not the most likely one
            assert any(len(top) == 2 for top in lp.top_logprobs)
