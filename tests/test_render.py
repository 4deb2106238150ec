"""Renderers must produce exactly the ids of the model's own template (or mistral-common)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rankserve.runtime.render import RENDERERS, get_renderer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "tokenizers"
pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/tokenizers not present")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_abcdefghijklmnopqrstuvwx", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello, how can I help?"},
                   {"role": "user", "content": [{"type": "text", "text": "Tell a joke."}]}],
    "tool_call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": CALL["id"], "content": "22 C, sunny"}],
}


def _hf(name):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(SHARED / name)


@pytest.fixture(scope="module")
def qwen3():
    return _hf("qwen3")


@pytest.fixture(scope="module")
def llama3():
    return _hf("llama3")


@pytest.fixture(scope="module")
def deepseek():
    return _hf("deepseek-v3")


@pytest.fixture(scope="module", params=["tekken", "sentencepiece-v3"])
def mistral_tok(request):
    mc = pytest.importorskip("mistral_common.tokens.tokenizers.mistral")
    import mistral_common
    if request.param == "sentencepiece-v3":
        pytest.importorskip("sentencepiece")
        return mc.MistralTokenizer.v3()
    return mc.MistralTokenizer.from_file(
        str(Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"))


def template_form(messages):
    """What HF templates expect: arguments as dicts, text parts joined."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        for tc in m.get("tool_calls", []):
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    return out


def hf_ids(tok, messages, **kw):
    return list(tok.apply_chat_template(template_form(messages), tokenize=True, return_dict=False,
                                        add_generation_prompt=True, **kw))


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_matches_template(qwen3, conv, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    r = get_renderer(None, qwen3, "qwen3")
    tools = TOOLS if conv == "tool_call" else None
    assert r.render_chat(CONVERSATIONS[conv], tools=tools, chat_template_kwargs=kwargs) == \
        hf_ids(qwen3, CONVERSATIONS[conv], tools=tools, **kwargs)


def test_qwen3_reasoning_in_history(qwen3):
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Simple sum."},
            {"role": "user", "content": "and 3+3?"}]
    r = RENDERERS.get("hf")(qwen3)
    assert "<think>" not in qwen3.decode(r.render_chat(msgs))  # old reasoning is dropped
    # the last assistant turn keeps its reasoning (reasoning → reasoning_content)
    ids = r.render_chat(msgs[:2], add_generation_prompt=False)
    assert "<think>\nSimple sum.\n</think>\n\n4" in qwen3.decode(ids)


@pytest.mark.parametrize("conv", ["plain", "system", "multi_turn"])
def test_llama3_matches_template(llama3, conv):
    r = get_renderer(None, llama3, "llama")
    assert r.render_chat(CONVERSATIONS[conv]) == hf_ids(llama3, CONVERSATIONS[conv])


def test_llama3_tools(llama3):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    msgs += CONVERSATIONS["tool_call"][1:]
    r = get_renderer("hf", llama3, None)
    ids = r.render_chat(msgs, tools=TOOLS)
    assert ids == hf_ids(llama3, msgs, tools=TOOLS)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama3.decode(ids)


@pytest.mark.parametrize("conv", ["plain", "system", "multi_turn"])
@pytest.mark.parametrize("thinking", [True, False])
def test_deepseek_matches_template(deepseek, conv, thinking):
    r = get_renderer(None, deepseek, "deepseek_v3")
    assert type(r).__name__ == "DeepSeekV3Renderer"
    got = r.render_chat(CONVERSATIONS[conv], chat_template_kwargs={"thinking": thinking})
    assert got == hf_ids(deepseek, CONVERSATIONS[conv], thinking=thinking)
    assert deepseek.decode(got).endswith("<｜Assistant｜><think>" if thinking
                                         else "<｜Assistant｜><think></think>")
    # enable_thinking is accepted as the same switch
    assert r.render_chat(CONVERSATIONS[conv], chat_template_kwargs={"enable_thinking": thinking}) == got


def test_deepseek_tools(deepseek):
    msgs = [{"role": "system", "content": "Be brief."}] + CONVERSATIONS["tool_call"]
    r = get_renderer(None, deepseek, "deepseek_v3")
    text = deepseek.decode(r.render_chat(msgs, tools=TOOLS))
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert "### get_weather\nDescription: Current weather in a city\n\nParameters: " \
           '{"type": "object"' in text
    assert ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
            "<｜tool▁output▁begin｜>22 C, sunny<｜tool▁output▁end｜>") in text


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_mistral_matches_mistral_common(mistral_tok, conv):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    r = get_renderer(None, mistral_tok, "mistral")
    assert type(r).__name__ == "MistralRenderer"
    tools = TOOLS if conv == "tool_call" else None
    msgs = copy.deepcopy(CONVERSATIONS[conv])
    for m in msgs:  # mistral ids are 9 alphanumerics: the renderer keeps the last 9
        for tc in m.get("tool_calls", []):
            tc["id"] = tc["id"][-9:]
        if m["role"] == "tool":
            m["tool_call_id"] = m["tool_call_id"][-9:]
    expected = mistral_tok.encode_chat_completion(ChatCompletionRequest.from_openai(msgs, tools))
    assert r.render_chat(CONVERSATIONS[conv], tools=tools) == expected.tokens


def test_render_completion(llama3, qwen3, mistral_tok):
    assert get_renderer(None, llama3).render_completion("Hello") == llama3.encode("Hello")
    assert get_renderer(None, qwen3).render_completion([1, 2, 3]) == [1, 2, 3]
    ids = get_renderer(None, mistral_tok).render_completion("Hello")
    assert ids[0] == mistral_tok.instruct_tokenizer.tokenizer.bos_id and len(ids) > 1
    with pytest.raises(ValueError):
        get_renderer(None, qwen3).render_completion([])


def test_continue_final_message(qwen3):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    r = get_renderer(None, qwen3)
    ids = r.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert qwen3.decode(ids).endswith("Hello the")
    with pytest.raises(ValueError, match="cannot both"):
        r.render_chat(msgs, continue_final_message=True)


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "22C"}], "tool_call_id"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "unsupported content part 'image_url'"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "not valid JSON"),
])
def test_bad_input(qwen3, mistral_tok, messages, match):
    for tok in (qwen3, mistral_tok):
        with pytest.raises(ValueError, match=match):
            get_renderer(None, tok).render_chat(messages)


def test_no_chat_template_and_registry_errors():
    transformers = pytest.importorskip("transformers")
    base = Path(__file__).resolve().parents[1] / "models" / "default" / "stories260K"
    tok = transformers.AutoTokenizer.from_pretrained(base)
    # the error says how to give one (vLLM's users pass --chat-template)
    with pytest.raises(ValueError, match="no chat template: start the server with --chat-template "
                                         r".*, send chat_template in the request, or use /v1/completions"):
        get_renderer(None, tok).render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="supported: deepseek_v3, hf, mistral"):
        get_renderer("chatml", tok)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        get_renderer(None, tok).render_chat([{"role": "user", "content": "hi"}],
                                            chat_template_kwargs={"tokenize": False})


def test_deepseek_tool_description_without_description_or_parameters(deepseek):
    """A tool sent with `"description": null` (or none) and no parameters: the prompt says
    nothing about them ("Description: None" / "Parameters: null" were written)."""
    tools = [{"type": "function", "function": {"name": "ping", "description": None}}]
    text = deepseek.decode(get_renderer(None, deepseek, "deepseek_v3").render_chat(
        [{"role": "user", "content": "Ping?"}], tools=tools))
    assert "### ping\nDescription: \n\nParameters: {}\n" in text
    assert "None" not in text and "null" not in text
