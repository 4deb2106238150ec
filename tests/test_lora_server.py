"""LoRA adapters through the server: listed as models with a parent, selected by `model`,
loaded and unloaded at runtime (API key guarded), unknown adapter → 404 OpenAI error body."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from rankserve import LLM, LoRARequest, SamplingParams
from lora_utils import ADAPTERS, make_adapter
from test_server import API_KEY, Server

PROMPT = [1, 5, 9, 200, 31, 7]


@pytest.fixture(scope="module")
def lora_setup(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-server")
    base = str(d / "base")  # the tiny checkpoint plus a chat template (chat, messages, responses)
    shutil.copytree(checkpoint("LlamaForCausalLM"), base)
    tc = json.loads((d / "base" / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (d / "base" / "tokenizer_config.json").write_text(json.dumps(tc))
    paths = [make_adapter(base, d / name, r, a, rs, t, seed=i)
             for i, (name, r, a, rs, t) in enumerate(ADAPTERS[:2])]
    s = Server(base, "--dtype", "float32", "--api-key", API_KEY, "--enable-lora", "--max-loras", "2",
               "--lora-modules", f"a={paths[0]}")
    yield base, paths, s
    assert s.stop() == 0


def test_lora_server(lora_setup):
    base, paths, s = lora_setup
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert "a" in models and models["a"].parent == base

    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = [llm.generate([PROMPT], sp, lora_request=lr)[0].outputs[0].text
             for lr in (None, LoRARequest("a", 1, paths[0]), LoRARequest("b", 2, paths[1]))]

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert complete("a") == texts[1] != texts[0]
    # responses name the model the request selected, as vLLM does: the adapter, not the base
    assert client.completions.create(model="a", prompt=PROMPT, max_tokens=1).model == "a"
    assert complete(base) == texts[0]
    with pytest.raises(openai.NotFoundError) as e:
        complete("b")
    assert e.value.body["code"] == "model_not_found"

    body = {"lora_name": "b", "lora_path": paths[1]}
    assert httpx.post(s.url + "/v1/load_lora_adapter", json=body).status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(s.url + "/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert httpx.post(s.url + "/v1/load_lora_adapter", json=body, headers=auth).status_code == 400
    bad = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nope"},
                     headers=auth)
    assert bad.status_code == 400 and "error" in bad.json()
    assert complete("b") == texts[2]
    chat_model = client.models.retrieve("b")
    assert chat_model.parent == base
    r = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete("b")
    assert 'rankserve:lora_requests_info{max_lora="2"' in httpx.get(s.url + "/metrics",
                                                                       headers=auth).text
    r = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_unload_while_streaming_and_other_apis(lora_setup):
    """An adapter unloaded while a request streams with it: the request finishes unchanged.
    Anthropic and Responses requests select adapters by `model` too."""
    base, paths, s = lora_setup
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths[1]},
                   headers=auth)
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    kw = dict(prompt=PROMPT, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(model="c", **kw).choices[0].text
    stream = client.completions.create(model="c", stream=True, **kw)
    text = next(iter(stream)).choices[0].text
    r = httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=auth)
    assert r.status_code == 200
    text += "".join(c.choices[0].text for c in stream if c.choices)
    assert text == want

    msgs = [{"role": "user", "content": "Once upon a time"}]
    chat = client.chat.completions.create(model="a", messages=msgs, max_tokens=6, temperature=0)
    h = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    m = httpx.post(s.url + "/v1/messages", headers=h, json={
        "model": "a", "max_tokens": 6, "temperature": 0, "messages": msgs}).json()
    assert m["content"][0]["text"] == chat.choices[0].message.content
    assert chat.model == m["model"] == "a"
    resp = httpx.post(s.url + "/v1/responses", headers=auth, json={
        "model": "a", "max_output_tokens": 6, "temperature": 0, "input": "Once upon a time"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "a"
    for path, body in (("/v1/messages", {"model": "nope", "max_tokens": 2, "messages": msgs}),
                       ("/v1/responses", {"model": "nope", "input": "x"})):
        assert httpx.post(s.url + path, headers={**h, **auth}, json=body).status_code == 404


def test_adapter_of_another_model_refused_at_load(lora_setup, checkpoint, tmp_path):
    """/v1/load_lora_adapter with an adapter trained on another base: a 400 naming the
    mismatch (the engine checks its tensor shapes), not a 200 and then an engine that fails on
    the first request using it (503 for every client from then on)."""
    base, paths, s = lora_setup
    other = make_adapter(checkpoint("LlamaForCausalLM", hidden_size=32, num_attention_heads=2,
                                    num_key_value_heads=1), tmp_path / "other", 8, 16, False,
                         ["q_proj"], seed=0)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": other},
                   headers=auth)
    assert r.status_code == 400, r.text
    assert "another base model" in r.json()["error"]["message"]
    assert "other" not in {m["id"] for m in httpx.get(s.url + "/v1/models", headers=auth).json()["data"]}
    broken = tmp_path / "broken"  # a truncated adapter_model.safetensors: 400, not 500
    shutil.copytree(paths[0], broken)
    st = broken / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)},
                   headers=auth)
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"], r.text
    # a hand-written adapter_config.json: 400 naming it, not a 500 (or, for lora_alpha, a 200 and
    # an engine that fails on the adapter's first request: 503 for every client from then on)
    valid = json.loads((broken / "adapter_config.json").read_text())
    for name, cfg in (("no-r", {"peft_type": "LORA"}), ("r0", {"r": 0}), ("list", [8]), ("x", None),
                      ("alpha", {**valid, "lora_alpha": None})):
        shutil.copytree(paths[0], tmp_path / name)
        (tmp_path / name / "adapter_config.json").write_text("{" if cfg is None else json.dumps(cfg))
        r = httpx.post(s.url + "/v1/load_lora_adapter", headers=auth,
                       json={"lora_name": name, "lora_path": str(tmp_path / name)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
    r = httpx.post(s.url + "/v1/completions", headers=auth,
                   json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
