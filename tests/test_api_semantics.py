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
    out; the greedy story's first "." (after "Lily") is within 12 tokens: min_tokens=12 skips it."""
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


def test_prompt_logprobs_of_a_one_token_request(http):
    """A request that ends on its first token (max_tokens 1, or EOS at once) got
    prompt_logprobs null: the scheduler added the step's prompt logprobs after the request
    was finished and gone."""
    for max_tokens in (1, 2):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens,
                                                "prompt_logprobs": 0}).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert plp is not None and len(plp) == 5 and plp[0] is None, r


def test_completion_echo(client, http):
    """echo=true (OpenAI; lm-eval's loglikelihood requests: echo, logprobs, max_tokens 0 or 1,
    token-id prompts): the prompt comes back before the completion, and with logprobs its
    tokens' logprobs too (the first token's null), so a prompt can be scored."""
    greedy = complete(client, max_tokens=6).choices[0].text
    r = complete(client, max_tokens=6, echo=True)
    assert r.choices[0].text == PROMPT + greedy and r.usage.prompt_tokens == 5
    ids = [1, 403, 407, 261, 378]  # <s> Once upon a time
    for max_tokens in (0, 1):
        r = complete(client, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1)
        c = r.choices[0]
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and r.usage.completion_tokens == max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(p < 0 for p in lp.token_logprobs[1:])
        assert all(lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
                   for i in range(1, len(lp.tokens)))
        assert c.text.startswith(PROMPT) and c.text[len(PROMPT):] == greedy[:len(c.text) - len(PROMPT)]
        assert lp.text_offset == sorted(lp.text_offset)
        if max_tokens == 1:  # the completion's token sits where its text starts
            assert lp.text_offset[-1] == len(PROMPT) and lp.tokens[-1] == greedy[:len(lp.tokens[-1])]
            assert c.finish_reason == "length"
    # the prompt scored from inside the sequence equals the same prompt's prompt_logprobs
    plp = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                             "prompt_logprobs": 0}).json()
    scored = [e[str(t)]["logprob"] for e, t in zip(plp["choices"][0]["prompt_logprobs"][1:], ids[1:])]
    assert lp.token_logprobs[1:5] == pytest.approx(scored)
    # streamed: the first chunk of each choice carries the prompt; n and batches line up
    chunks = list(complete(client, prompt=[PROMPT, "Lily"], max_tokens=4, n=2, echo=True,
                           stream=True))
    texts = ["", "", "", ""]
    for ch in chunks:
        texts[ch.choices[0].index] += ch.choices[0].text
    batch = complete(client, prompt=[PROMPT, "Lily"], max_tokens=4, n=2, echo=True)
    assert texts == [c.text for c in batch.choices]
    assert [t[:len(p)] for t, p in zip(texts, [PROMPT, PROMPT, "Lily", "Lily"])] == \
        [PROMPT, PROMPT, "Lily", "Lily"]
    # max_tokens 0 is for echo only
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_responses_cut_by_max_output_tokens(client, http):
    """OpenAI Responses: a response cut by max_output_tokens is `incomplete`, and so is its
    message item (not `completed`), streamed or not; an empty `input` list is a 400 on `input`."""
    r = client.responses.create(model="s", input=PROMPT, max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.status for o in r.output] == ["incomplete"] and r.output_text
    events = list(client.responses.create(model="s", input=PROMPT, max_output_tokens=4,
                                          temperature=0, stream=True))
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [o.status for o in events[-1].response.output] == ["incomplete"]
    err = http.post("/v1/responses", json={"model": "s", "input": []}).json()["error"]
    assert err["param"] == "input" and "input" in err["message"], err


def test_empty_chat_answer_is_an_empty_string(client):
    """An answer that ends before any text (a stop string or EOS at once) has content "" as
    OpenAI's and vLLM's do, not null: null is for a message with tool calls only, and
    `message.content.strip()` must not fail on it."""
    kw = dict(model="s", messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
              temperature=0)
    assert client.chat.completions.create(**kw).choices[0].message.content.startswith("A")
    c = client.chat.completions.create(stop=["A"], **kw).choices[0]
    assert c.message.content == "" and c.finish_reason == "stop"
    assert c.message.tool_calls is None


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system"}, {"role": "tool", "tool_call_id": "c"}])
def test_message_without_content_is_400(http, message):
    """OpenAI requires content on user, system and tool messages (an assistant's may be null
    beside tool calls): one without it was rendered as if empty and answered with a 200."""
    body = {"model": "s", "messages": [message, {"role": "user", "content": "hi"}],
            "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert "messages[0]" in r.json()["error"]["message"] and "content" in r.json()["error"]["message"]


def test_priority_needs_the_priority_policy(http):
    """vLLM: a request priority other than 0 on an engine scheduling first-come-first-served is
    an error (here it was silently ignored); 0 passes."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json={"model": "s", "max_tokens": 2, "priority": 5, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
        assert http.post(path, json={"model": "s", "max_tokens": 2, "priority": 0,
                                     **body}).status_code == 200


@pytest.mark.parametrize("choice", [{"type": "function", "name": "f"},
                                    {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}])
def test_chat_tool_choice_of_another_shape_says_which_shape(http, choice):
    """A Responses-style flat {"type": "function", "name"} or an allowed_tools choice in a chat
    request was refused as naming "the function None": the 400 now shows the shape chat takes."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = http.post("/v1/chat/completions", json={"model": "s", "max_tokens": 2, "tools": tools,
                                                "tool_choice": choice,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "None" not in r.json()["error"]["message"]
    assert '{"type": "function", "function": {"name": ...}}' in r.json()["error"]["message"]


EMOJI = "😀 a 中文 end"  # stories' byte-fallback tokens: 4 for 😀, 3 for each CJK character


def test_logprobs_of_byte_tokens_line_up_with_the_text(client):
    """A character made of several byte tokens (each decodes to "�" alone): completions'
    text_offset counted one character per byte token, so every later offset was off (the "d"
    of "end" at 16 in a 13-character text), and streamed chunks carried other tokens than their
    text's (the tokens of "😀" came with " a", those of " a" with "文"); chat's `bytes` were
    those of "�" for each, so the bytes did not add up to the content (OpenAI: they do)."""
    kw = dict(max_tokens=20, extra_body={"guided_choice": [EMOJI]})
    c = complete(client, logprobs=0, **kw).choices[0]
    lp = c.logprobs
    assert c.text == EMOJI and lp.tokens[-1] == "</s>"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] == len(c.text)
    for tok, start in zip(lp.tokens[:-1], lp.text_offset):
        assert tok == "\ufffd" or c.text[start:start + len(tok)] == tok, (tok, lp.text_offset)
    assert lp.text_offset[:5] == [0, 0, 0, 0, 1]  # the bytes of 😀, then " a"
    done, tokens, offsets = "", [], []
    for ch in complete(client, logprobs=0, stream=True, **kw):
        ch = ch.choices[0]
        tokens += ch.logprobs.tokens
        offsets += ch.logprobs.text_offset
        assert all(len(done) <= o <= len(done) + len(ch.text) for o in ch.logprobs.text_offset)
        if ch.text.strip():  # the chunk of a character carries the tokens that made it
            assert ch.logprobs.tokens, ch
        done += ch.text
    assert done == c.text and tokens == lp.tokens and offsets == lp.text_offset
    msg = client.chat.completions.create(
        model="s", messages=[{"role": "user", "content": PROMPT}], temperature=0, logprobs=True,
        **kw).choices[0]
    content = msg.logprobs.content
    assert content[-1].token == "</s>" and msg.message.content == EMOJI
    assert bytes(b for e in content[:-1] for b in e.bytes).decode() == EMOJI


@pytest.mark.parametrize("prompt", ["<s>Once upon a time", "  Lily went", "Once upon a time"])
def test_echo_text_offset_points_into_the_prompt_as_sent(client, prompt):
    """echo gives back the prompt's own text, but text_offset counted the decoded tokens: when
    that text differs from the prompt (special-token text as in a prompt already in its chat
    template, leading spaces), every later offset pointed elsewhere ("O" of "<s>Once" at 0)."""
    r = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    lp = r.logprobs
    assert r.text == prompt and lp.text_offset == sorted(lp.text_offset)
    for tok, start in list(zip(lp.tokens, lp.text_offset))[1:]:  # (the first: the added BOS)
        if start == 0 and tok.startswith(" ") and not prompt.startswith(" "):
            tok = tok[1:]  # (SentencePiece's space before the text's first word)
        assert prompt[start:start + len(tok)] == tok, (tok, start, lp.text_offset)


def test_unknown_message_fields_are_400_and_sdk_round_trips_pass(client, http):
    """A message field the server does not know was dropped without a word (Mistral's
    `prefix: true` asking to continue the message, an Ollama-style `images` list): now a 400
    naming it. An answer's message as the openai SDK dumps it back into the history (refusal,
    annotations, audio, function_call null) still passes."""
    for extra in ({"prefix": True}, {"images": ["aGk="]}, {"refusal": "no"}):
        body = {"model": "s", "max_tokens": 2, "messages": [
            {"role": "user", "content": PROMPT}, {"role": "assistant", "content": "x", **extra}]}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and next(iter(extra)) in r.json()["error"]["message"], r.text
    answer = client.chat.completions.create(model="s", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": PROMPT}]).choices[0].message
    again = client.chat.completions.create(model="s", max_tokens=3, messages=[
        {"role": "user", "content": PROMPT}, answer.model_dump(), {"role": "user", "content": "x"}])
    assert again.choices[0].message.content is not None
