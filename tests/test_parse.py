"""The streaming parser gives the same message however the output is chunked, and the expected
content / reasoning / tool calls for each family, on token streams of the real tokenizers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rankserve.runtime.parse import (PARSERS, ContentDelta, ReasoningDelta, ToolCallDelta,
                                     accumulate, make_parser)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "tokenizers"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/tokenizers not present")


# tokenizers and token streams --------------------------------------------------------------------
class HfStream:
    def __init__(self, folder):
        transformers = pytest.importorskip("transformers")
        self.tok = transformers.AutoTokenizer.from_pretrained(SHARED / folder)

    def ids(self, text):  # markers such as <tool_call> in the text become their special tokens
        return self.tok.encode(text, add_special_tokens=False)

    def pieces(self, ids):
        """Per-token text deltas from an incremental decoder, special tokens kept."""
        from tokenizers.decoders import DecodeStream
        ds = DecodeStream(skip_special_tokens=False)
        return [ds.step(self.tok._tokenizer, i) or "" for i in ids]


class MistralStream:
    def __init__(self, tok):
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        self.tok, self.keep = tok, SpecialTokenPolicy.KEEP
        self.inner = tok.instruct_tokenizer.tokenizer

    def ids(self, parts):  # parts: strings, or ("[TOOL_CALLS]",)-style control tokens
        out = []
        for p in parts:
            out += [self.inner.get_special_token(p[0])] if isinstance(p, tuple) else \
                self.inner.encode(p, bos=False, eos=False)
        return out

    def pieces(self, ids):
        """Text deltas by decoding prefixes, holding back an incomplete character."""
        out, done = [], ""
        for i in range(1, len(ids) + 1):
            text = self.inner.decode(ids[:i], special_token_policy=self.keep)
            if text.endswith("\ufffd"):
                out.append("")
                continue
            out.append(text[len(done):])
            done = text
        return out


@pytest.fixture(scope="module")
def qwen3():
    return HfStream("qwen3")


@pytest.fixture(scope="module")
def llama3():
    return HfStream("llama3")


@pytest.fixture(scope="module")
def deepseek():
    return HfStream("deepseek-v3")


def _mistral_data():
    pytest.importorskip("mistral_common")
    import mistral_common
    return Path(mistral_common.__file__).parent / "data"


@pytest.fixture(scope="module")
def mistral_v3():
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    return MistralStream(MistralTokenizer.from_file(str(_mistral_data() / "tekken_240911.json")))


@pytest.fixture(scope="module")
def mistral_v11(tmp_path_factory):
    """mistral-common ships no v11 file: the same Tekken vocabulary declared v11, with [ARGS]."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    data = json.loads((_mistral_data() / "tekken_240911.json").read_text())
    special = [dict(t, token_str=str(t["token_str"])) for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    special += [{"rank": len(special), "token_str": "[ARGS]", "is_control": True},
                {"rank": len(special) + 1, "token_str": "[CALL_ID]", "is_control": True}]
    special += [{"rank": i, "token_str": f"<SPECIAL_{i}>", "is_control": True}
                for i in range(len(special), data["config"]["default_num_special_tokens"])]
    data["special_tokens"], data["config"]["version"] = special, "v11"
    path = tmp_path_factory.mktemp("tekken") / "tekken_v11.json"
    path.write_text(json.dumps(data))
    return MistralStream(MistralTokenizer.from_file(str(path)))


# checking ----------------------------------------------------------------------------------------
def view(msg):
    """A message without the random tool-call ids."""
    return msg.content, msg.reasoning, [(c.name, c.arguments) for c in msg.tool_calls]


def chunkings(n):
    yield [1] * n  # token by token
    for k in range(1, n):  # every single split point
        yield [k, n - k]
    for size in (2, 3, 7):
        yield [size] * (n // size) + ([n % size] if n % size else [])


def run_stream(make, ids, pieces, sizes):
    p, deltas, at = make(), [], 0
    for size in sizes:
        deltas += p.feed(ids[at:at + size], "".join(pieces[at:at + size]))
        at += size
    deltas += p.finish()
    return p, deltas


OPENAI_ID = r"call_[A-Za-z0-9]{24}"
MISTRAL_ID = r"[A-Za-z0-9]{9}"  # Mistral's chat templates refuse history with other call ids


def check(make, stream, ids, expected, well_formed=True, call_id=OPENAI_ID):
    pieces = stream.pieces(ids)
    whole = make().parse(ids, "".join(pieces))
    assert view(whole) == expected
    assert all(re.fullmatch(call_id, c.id) for c in whole.tool_calls)
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    for sizes in chunkings(len(ids)):
        p, deltas = run_stream(make, ids, pieces, sizes)
        assert view(p.result()) == expected, sizes
        streamed = accumulate(deltas)
        if well_formed:
            assert view(streamed) == expected, sizes
            assert [c.id for c in streamed.tool_calls] == [c.id for c in p.result().tool_calls]
        else:
            assert streamed.content == expected[0], sizes
    return whole


ARGS1 = '{"city": "Paris", "unit": "celsius"}'
ARGS2 = '{"query": "caf\\u00e9 \\"quoted\\" {brace} [x]", "n": [1, -2.5e3, true, null], "o": {}}'


# qwen3 / hermes --------------------------------------------------------------------------------
@needs_shared
def test_qwen3_reasoning_content_and_tool_calls(qwen3):
    out = ("<think>\nThe user wants the weather in Paris — and a search. 東京 too?\n</think>\n\n"
           "Let me check that for you.\n"
           f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS1}}}\n</tool_call>\n'
           f'<tool_call>\n{{"name": "search", "arguments": {ARGS2}}}\n</tool_call>')
    whole = check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3, qwen3.ids(out), (
        "Let me check that for you.",
        "The user wants the weather in Paris — and a search. 東京 too?",
        [("get_weather", ARGS1), ("search", ARGS2)]))
    assert json.loads(whole.tool_calls[1].arguments)["query"] == 'café "quoted" {brace} [x]'


@needs_shared
def test_qwen3_streams_arguments_incrementally(qwen3):
    ids = qwen3.ids(f'<tool_call>\n{{"name": "search", "arguments": {ARGS2}}}\n</tool_call>')
    p, pieces = make_parser(qwen3.tok, "hermes"), qwen3.pieces(ids)
    deltas = [d for i, t in zip(ids, pieces) for d in p.feed([i], t)] + p.finish()
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert calls[0].name == "search" and calls[0].id and all(d.name is None for d in calls[1:])
    assert len(calls) > 10  # arguments arrive as they are generated, not at the end
    assert "".join(d.arguments for d in calls) == ARGS2


@needs_shared
def test_qwen3_starts_in_reasoning(qwen3):
    out = "Thinking already.\n</think>\n\nThe answer is 4."
    expected = ("The answer is 4.", "Thinking already.", [])
    check(lambda: make_parser(qwen3.tok, None, "qwen3", starts_in_reasoning=True), qwen3,
          qwen3.ids(out), expected)
    prompt = qwen3.ids("<|im_start|>assistant\n<think>\n")  # a template that opens thinking
    check(lambda: make_parser(qwen3.tok, None, "qwen3", prompt_token_ids=prompt), qwen3,
          qwen3.ids(out), expected)
    closed = qwen3.ids("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert make_parser(qwen3.tok, None, "qwen3", prompt_token_ids=closed).state == "content"


@needs_shared
def test_a_think_tag_in_the_user_text_does_not_open_the_reasoning(qwen3):
    """A "<think>" typed in a user message is the tag's token too: only the generation prompt's
    own tag says the output starts inside the reasoning (the answer's reasoning began with a
    stray "<think>", and an answer without tags was all reasoning)."""
    prompt = qwen3.tok.apply_chat_template(
        [{"role": "user", "content": "What does the <think> tag do?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert 151667 in prompt
    make = lambda: make_parser(qwen3.tok, "hermes", "qwen3", prompt_token_ids=prompt)  # noqa: E731
    check(make, qwen3, qwen3.ids("<think>\nA tag.\n</think>\n\nIt marks reasoning."),
          ("It marks reasoning.", "A tag.", []))
    check(make, qwen3, qwen3.ids("It marks reasoning."), ("It marks reasoning.", None, []))


@needs_shared
def test_qwen3_reasoning_only_and_tools_only(qwen3):
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS1}}}\n</tool_call>'
    out = f"<think>\nHmm.\n</think>\n\nSure.\n{call}"
    ids = qwen3.ids(out)
    check(lambda: make_parser(qwen3.tok, None, "qwen3"), qwen3, ids,
          (f"Sure.\n{call}", "Hmm.", []))
    check(lambda: make_parser(qwen3.tok, "hermes", None), qwen3, ids,
          ("<think>\nHmm.\n</think>\n\nSure.", None, [("get_weather", ARGS1)]))


@needs_shared
def test_qwen3_text_on_both_sides_of_a_call_keeps_its_separator(qwen3):
    """Content before and after a tool call is one text: the whitespace that opens the second
    part stays ("Sure.Done here." ran the sentences together)."""
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS1}}}\n</tool_call>'
    check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3,
          qwen3.ids(f"Sure.\n{call}\nDone here.\n{call}\n\nAnd more."),
          ("Sure.\nDone here.\n\nAnd more.", None, [("get_weather", ARGS1)] * 2))


@needs_shared
def test_qwen3_plain_marker_text_is_content(qwen3):
    # the model spelling "<tool_call>" in ordinary tokens is not the special token
    text = "Use the <tool_call> tag."
    ids = [t for part in ("Use the <", "tool_call", "> tag.") for t in qwen3.ids(part)]
    assert 151657 not in ids
    check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3, ids, (text, None, []))


@needs_shared
def test_plain_marker_text_and_the_marker_token_in_one_feed(qwen3):
    """The non-streamed parse (and a streamed update of several tokens) holds the model spelling
    a marker in plain tokens and the marker token itself: the token is the marker, wherever the
    plain text is (the plain one was taken: the call was lost, the reasoning cut short)."""
    def plain(*parts):
        return [t for part in parts for t in qwen3.ids(part)]
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS1}}}\n</tool_call>'
    ids = plain("Use the <", "tool_call", "> tag.\n") + qwen3.ids(call)
    assert ids.count(151657) == 1
    check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3, ids,
          ("Use the <tool_call> tag.", None, [("get_weather", ARGS1)]))
    ids = plain("I think </", "think", "> is a tag.") + qwen3.ids("</think>\n\nAnswer.")
    check(lambda: make_parser(qwen3.tok, None, "qwen3", starts_in_reasoning=True), qwen3, ids,
          ("Answer.", "I think </think> is a tag.", []))
    # a finished call closed by the marker's text in plain tokens (a strict tool's structural
    # tag writes it so) ends there in any chunking
    ids = qwen3.ids(call.removesuffix("</tool_call>")) + plain("</", "tool_call", ">\nDone.")
    check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3, ids,
          ("Done.", None, [("get_weather", ARGS1)]))


@needs_shared
@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    "<tool_call>\n</tool_call> done",
    # a name no response can carry (a lone surrogate: JSON encoding of the reply would fail)
    '<tool_call>\n{"name": "get_\\ud83d", "arguments": {}}\n</tool_call>',
    # two argument values: no one JSON text of arguments ('{"a": 1}{"b": 2}' was given)
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}\n</tool_call>',
])
def test_qwen3_malformed_tool_call_is_content(qwen3, bad):
    out = "I will call a tool.\n" + bad
    check(lambda: make_parser(qwen3.tok, "hermes", "qwen3"), qwen3, qwen3.ids(out),
          (out, None, []), well_formed=False)


# llama3_json -----------------------------------------------------------------------------------
@needs_shared
def test_llama3_json_single_call(llama3):
    out = f'{{"name": "get_weather", "parameters": {ARGS1}}}'
    check(lambda: make_parser(llama3.tok, "llama3_json"), llama3, llama3.ids(out),
          (None, None, [("get_weather", ARGS1)]))


@needs_shared
def test_llama3_json_python_tag_and_several(llama3):
    out = (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS1}}}; '
           f'{{"name": "search", "parameters": {ARGS2}}}')
    ids = llama3.ids(out)
    assert 128010 in ids
    check(lambda: make_parser(llama3.tok, "llama3_json"), llama3, ids,
          (None, None, [("get_weather", ARGS1), ("search", ARGS2)]))


@needs_shared
def test_llama3_json_call_with_a_type_key(llama3):
    """Llama 3.2 often writes {"type": "function", "name": ..., "parameters": ...}: a call (as
    vLLM's llama3_json and hermes parsers read it), not content."""
    out = f'{{"type": "function", "name": "get_weather", "parameters": {ARGS1}}}'
    check(lambda: make_parser(llama3.tok, "llama3_json"), llama3, llama3.ids(out),
          (None, None, [("get_weather", ARGS1)]))


@needs_shared
@pytest.mark.parametrize("out", [
    "The weather in Paris is sunny: {\"city\": \"Paris\"} ☀️.",
    '{"answer": 42, "name": "not a call"}',  # JSON content is not a tool call
    '{"name": "get_weather", "parameters": {"city": ',  # cut off
])
def test_llama3_json_content(llama3, out):
    check(lambda: make_parser(llama3.tok, "llama3_json"), llama3, llama3.ids(out),
          (out, None, []), well_formed=not out.startswith('{"name"'))


# mistral ---------------------------------------------------------------------------------------
def test_mistral_v3_list(mistral_v3):
    calls = (f'[{{"name": "get_weather", "arguments": {ARGS1}, "id": "abcDEF123"}}, '
             f'{{"name": "search", "arguments": {ARGS2}, "id": "xyz987654"}}]')
    ids = mistral_v3.ids(["Let me check. ", ("[TOOL_CALLS]",), calls])
    check(lambda: make_parser(mistral_v3.tok, "mistral"), mistral_v3, ids,
          ("Let me check.", None, [("get_weather", ARGS1), ("search", ARGS2)]), call_id=MISTRAL_ID)


def test_mistral_v3_malformed(mistral_v3):
    ids = mistral_v3.ids([("[TOOL_CALLS]",), '[{"name": "get_weather", "arguments": {"city": 1}'])
    whole = check(lambda: make_parser(mistral_v3.tok, "mistral"), mistral_v3, ids,
                  ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 1}', None, []),
                  well_formed=False)
    assert whole.tool_calls == []


def test_mistral_v11_name_args(mistral_v11):
    ids = mistral_v11.ids(["Checking both.", ("[TOOL_CALLS]",), "get_weather", ("[ARGS]",), ARGS1,
                           ("[TOOL_CALLS]",), "search", ("[ARGS]",), ARGS2])
    check(lambda: make_parser(mistral_v11.tok, "mistral"), mistral_v11, ids,
          ("Checking both.", None, [("get_weather", ARGS1), ("search", ARGS2)]), call_id=MISTRAL_ID)


def test_mistral_v11_call_ids(mistral_v11):
    """v11 models write the call id their history shows (mistral-common encodes
    [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}): the id is skipped, the call kept."""
    ids = mistral_v11.ids([("[TOOL_CALLS]",), "get_weather", ("[CALL_ID]",), "abc123XYZ",
                           ("[ARGS]",), ARGS1, ("[TOOL_CALLS]",), "search", ("[CALL_ID]",),
                           "k9L2m3N4p", ("[ARGS]",), ARGS2])
    check(lambda: make_parser(mistral_v11.tok, "mistral"), mistral_v11, ids,
          (None, None, [("get_weather", ARGS1), ("search", ARGS2)]), call_id=MISTRAL_ID)


def test_mistral_v11_bad_name_is_content(mistral_v11):
    ids = mistral_v11.ids([("[TOOL_CALLS]",), "get weather now", ("[ARGS]",), "{}"])
    check(lambda: make_parser(mistral_v11.tok, "mistral"), mistral_v11, ids,
          ("[TOOL_CALLS]get weather now[ARGS]{}", None, []), well_formed=False)


# deepseek_v3 (V3.1) ----------------------------------------------------------------------------
DS_CALLS = ("<｜tool▁calls▁begin｜>"
            f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS1}<｜tool▁call▁end｜>"
            "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")


@needs_shared
def test_deepseek_thinking_then_tools(deepseek):
    # thinking mode: the prompt ends with <think>, so the output starts in reasoning
    prompt = deepseek.ids("<｜User｜>Weather?<｜Assistant｜><think>")
    out = "The user asks about Paris.</think>I'll look it up." + DS_CALLS
    check(lambda: make_parser(deepseek.tok, "deepseek_v3", "deepseek_v3", prompt_token_ids=prompt),
          deepseek, deepseek.ids(out),
          ("I'll look it up.", "The user asks about Paris.",
           [("get_weather", ARGS1), ("get_time", "{}")]))


@needs_shared
def test_deepseek_non_thinking(deepseek):
    prompt = deepseek.ids("<｜User｜>Hi<｜Assistant｜><think></think>")
    check(lambda: make_parser(deepseek.tok, "deepseek_v31", "deepseek_v3", prompt_token_ids=prompt),
          deepseek, deepseek.ids("Hello! How can I help?"), ("Hello! How can I help?", None, []))


@needs_shared
def test_deepseek_v3_and_r1_call_format(deepseek):
    """DeepSeek-V3 (0324) and R1 write function<｜tool▁sep｜>name, then the arguments in a ```json
    block; vLLM's deepseek_v3 parser reads that format, so this one does too (next to V3.1's)."""
    def call(name, args):
        return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
                "<｜tool▁call▁end｜>")
    out = ("Let me check.<｜tool▁calls▁begin｜>" + call("get_weather", ARGS1)
           + call("search", ARGS2) + "<｜tool▁calls▁end｜>")
    check(lambda: make_parser(deepseek.tok, "deepseek_v3", "deepseek_r1"), deepseek,
          deepseek.ids(out), ("Let me check.", None, [("get_weather", ARGS1), ("search", ARGS2)]))
    bad = "<｜tool▁calls▁begin｜>" + call("get_weather", "{city}") + "<｜tool▁calls▁end｜>"
    check(lambda: make_parser(deepseek.tok, "deepseek_v3"), deepseek, deepseek.ids(bad),
          (bad, None, []), well_formed=False)


@needs_shared
def test_deepseek_malformed_arguments(deepseek):
    out = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
           "{city: Paris}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    check(lambda: make_parser(deepseek.tok, "deepseek_v3"), deepseek, deepseek.ids(out),
          (out, None, []), well_formed=False)


# construction ----------------------------------------------------------------------------------
def test_registry_and_toggles():
    assert {"qwen3", "hermes", "llama3_json", "mistral", "deepseek_v3"} <= set(PARSERS.names())
    with pytest.raises(ValueError, match="supported: .*hermes"):
        make_parser(None, "nonexistent")
    with pytest.raises(ValueError, match="no reasoning format"):
        make_parser(None, None, "llama3_json")
    # no tokenizer: markers are matched as plain text
    p = make_parser(None, "hermes", "qwen3")
    out = p.feed([], "<think>a</think>b") + p.finish()
    assert out == [ReasoningDelta("a"), ContentDelta("b")]
    # neither toggle: everything is content, untouched
    p = make_parser(None)
    assert p.parse([], "<think>a</think> b ") .content == "<think>a</think> b "


@needs_shared
def test_deepseek_text_after_a_finished_call_has_no_marker(deepseek):
    """A complete call's <｜tool▁call▁end｜> belongs to it: text after it (the model skipping
    <｜tool▁calls▁end｜>), or a broken second call given back as content, does not repeat it."""
    call = f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS1}<｜tool▁call▁end｜>"
    make = lambda: make_parser(deepseek.tok, "deepseek_v3", "deepseek_v3")  # noqa: E731
    check(make, deepseek, deepseek.ids("<｜tool▁calls▁begin｜>" + call + "Done."),
          ("Done.", None, [("get_weather", ARGS1)]))
    bad = "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{now}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    check(make, deepseek, deepseek.ids("<｜tool▁calls▁begin｜>" + call + bad),
          (bad, None, [("get_weather", ARGS1)]), well_formed=False)


@needs_shared
def test_text_after_calls_does_not_depend_on_chunking(llama3, deepseek):
    """Whitespace between a finished call and the text after it is dropped whether it arrives
    alone or with the text (it came back as content when it was its own token)."""
    check(lambda: make_parser(llama3.tok, "llama3_json"), llama3,
          llama3.ids(f'{{"name": "get_weather", "parameters": {ARGS1}}}\nThat is all.'),
          ("That is all.", None, [("get_weather", ARGS1)]))
    check(lambda: make_parser(deepseek.tok, "deepseek_v3"), deepseek,
          deepseek.ids("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
                       "<｜tool▁call▁end｜>\n\nDone."),
          ("Done.", None, [("get_time", "{}")]))
