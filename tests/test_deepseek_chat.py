"""DeepSeek chat: the `deepseek_v3` renderer against the real DeepSeek-V3.1 template in
../shared/tokenizers/deepseek-v3 (tools, tool calls, tool results, reasoning), and the
deepseek_v3 parsers on what that template writes (tool calls streamed at every split point,
R1-style <think> reasoning)."""
from __future__ import annotations

import copy
import json

import pytest

from rankserve.runtime.parse import make_parser
from rankserve.runtime.render import get_renderer
from rankserve.runtime.render.deepseek_v3 import tool_description

from test_parse import HfStream, check
from test_render import SHARED, TOOLS, hf_ids

pytestmark = pytest.mark.skipif(not (SHARED / "deepseek-v3").is_dir(),
                                reason="../shared/tokenizers/deepseek-v3 not present")

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}
ARGS_W = '{"city": "Paris", "unit": "celsius"}'
ARGS_S = '{"q": "café \\"quoted\\" {brace} [x] 東京", "n": 3}'


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


CONVS = {
    "tool_call": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, "get_weather", ARGS_W)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}],
    "parallel_calls_and_answer": [
        {"role": "user", "content": "Paris weather, and search for cafés"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [call(1, "get_weather", ARGS_W), call(2, "search", ARGS_S)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "[\"Café A\"]"},
        {"role": "assistant", "content": "22 C; Café A is nice."},
        {"role": "user", "content": "Thanks! And tomorrow?"}],
    "reasoning_history": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>Again a sum.</think>6"},
        {"role": "user", "content": "Weather?"}],
}


@pytest.fixture(scope="module")
def tok():
    return HfStream("deepseek-v3").tok


def with_tool_prompt(messages, tools):
    """The model card's convention, written out by hand: the tool description follows the system
    prompt (the template itself ignores `tools`)."""
    msgs = copy.deepcopy(messages)
    desc = tool_description(tools)
    if msgs[0]["role"] == "system":
        msgs[0]["content"] += "\n\n" + desc
    else:
        msgs.insert(0, {"role": "system", "content": desc})
    return msgs


@pytest.mark.parametrize("conv", sorted(CONVS))
@pytest.mark.parametrize("thinking", [False, True])
def test_renderer_equals_template(tok, conv, thinking):
    r = get_renderer(None, tok, "deepseek_v3")
    msgs = CONVS[conv]
    kw = {"thinking": thinking}
    tools = [TOOLS[0], SEARCH] if conv != "reasoning_history" else None
    got = r.render_chat(msgs, tools=tools, chat_template_kwargs=kw)
    ref = hf_ids(tok, with_tool_prompt(msgs, tools) if tools else msgs, tools=tools, **kw)
    assert got == ref, (tok.decode(got), tok.decode(ref))
    text = tok.decode(got)
    assert "Simple sum." not in text and "Again a sum." not in text  # old reasoning dropped
    if conv == "tool_call":  # after tool results the template continues without a new turn
        assert text.endswith("<｜tool▁output▁begin｜>22 C, sunny<｜tool▁output▁end｜>")


@pytest.mark.parametrize("n_calls", [1, 2])
def test_tool_calls_round_trip_through_the_parser(tok, n_calls):
    """What the template writes for an assistant's tool calls, parsed back (streamed at every
    split point): the same names and arguments."""
    calls = [call(1, "get_weather", ARGS_W), call(2, "search", ARGS_S)][:n_calls]
    user = [{"role": "user", "content": "Paris?"}]
    turn = user + [{"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    r = get_renderer(None, tok, "deepseek_v3")
    prompt = r.render_chat(user, tools=TOOLS)
    full = r.render_chat(turn, tools=TOOLS, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    eos = tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    out = full[len(prompt):]
    assert out[-1] == eos
    out = out[:-1]  # the engine stops on (and drops) the end-of-sentence token
    expected = ("Checking.", None, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    whole = check(lambda: make_parser(tok, "deepseek_v3", "deepseek_v3", prompt_token_ids=prompt),
                  _stream(tok), out, expected)
    for c, (_, args) in zip(whole.tool_calls, expected[2]):
        assert json.loads(c.arguments) == json.loads(args)


def _stream(tok):
    """test_parse's token stream over the module's tokenizer."""
    s = HfStream.__new__(HfStream)
    s.tok = tok
    return s


@pytest.mark.parametrize("prompt_opens", [True, False])
def test_r1_style_reasoning(tok, prompt_opens):
    """DeepSeek-R1: `<think>\\n...\\n</think>\\n\\nanswer`, the opening tag either written by the
    prompt (R1-0528's template ends with <think>\\n) or generated."""
    prompt = tok.encode("<｜User｜>2+2?<｜Assistant｜>" + ("<think>\n" if prompt_opens else ""),
                        add_special_tokens=False)
    text = ("" if prompt_opens else "<think>\n") + "Two plus two.\nIt is 4.\n</think>\n\nThe answer is 4."
    check(lambda: make_parser(tok, "deepseek_v3", "deepseek_r1", prompt_token_ids=prompt),
          _stream(tok), tok.encode(text, add_special_tokens=False),
          ("The answer is 4.", "Two plus two.\nIt is 4.", []))
