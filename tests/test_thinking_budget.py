"""thinking_token_budget: the end of reasoning is forced once the budget is spent (engine level on
stories260K, with two of its tokens standing in for the reasoning tags; HTTP level on a tiny
Qwen3 with the real tokenizer)."""
import json

import pytest
import torch

from rankserve import LLM, SamplingParams
from rankserve.runtime.sampling_params import StructuredOutputsParams
from rankserve.runtime.thinking_budget import ThinkingBudget

from conftest import STORIES_EMBEDDED

START, END, SEP = 509, 510, 13  # stand-ins for <think>, </think>, "\n\n"
BUDGETS = [5, 0, 9, 3, 5]
CUDA = {"num_gpu_blocks_override": 256} if torch.cuda.is_available() else {}


def think(budget, max_tokens=20, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          thinking_token_budget=budget, thinking_start_token_id=START,
                          thinking_end_token_ids=[END, SEP], **kw)


def greedy(llm, ids, n):
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n,
                                                                  ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def expected(llm, prompt, budget, n):
    """The prompt opened the reasoning: `budget` free tokens, the forced end, then the answer."""
    head = greedy(llm, prompt, budget) if budget else []
    assert END not in head
    tail = greedy(llm, prompt + head + [END, SEP], n - budget - 2)
    return head + [END, SEP] + tail


def prompts(llm):
    texts = ["Once upon a time", "The little dog ran to the park and saw a big tree",
             "Lily and Tom were friends. One day they", "Sam had a red ball",
             # repeats: the n-gram proposer drafts over the forced tokens
             "Once upon a time, there was a little girl named Lily. Once upon a time, there was a "
             "little girl named"]
    return [llm.tokenizer(t).input_ids + [START] for t in texts]


@pytest.fixture(scope="module")
def reference(stories_llm):
    return [expected(stories_llm, p, b, 20) for p, b in zip(prompts(stories_llm), BUDGETS)]


def test_state_machine():
    sp = think(2)
    b = ThinkingBudget(sp, [1, 2])  # the prompt did not open the reasoning
    assert not b.open and b.forced([]) is None and not b.can_run_ahead(3) and b.can_run_ahead(2)
    b.read([START, 7], 0)
    assert b.forced([]) is None and b.forced([8]) == [-1, END]
    b.read([START, 7, 8], 0)
    assert b.forced([]) == [END] and not b.can_run_ahead(1)
    b.read([START, 7, 8, END], 0)
    assert b.forced([SEP, 9]) == [SEP, -1, -1]
    b.read([START, 7, 8, END, SEP], 0)
    assert b.forced([START, 5]) == [-1, END, END] and not b.can_run_ahead(1)  # (spent)
    # the model closes on its own: no separator forced
    b = ThinkingBudget(sp, [1, START])
    b.read([7, END], 0)
    assert b.forced([]) is None and b.count == 1


@pytest.mark.parametrize("kwargs", [
    {},
    dict(async_scheduling=True),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                             "prompt_lookup_min": 1}),
    dict(num_gpu_blocks_override=8, block_size=8, max_model_len=64),  # preemption
    dict(max_num_batched_tokens=7),  # chunked prompts
    dict(async_scheduling=True, num_gpu_blocks_override=8, block_size=8, max_model_len=64),
])
def test_budget_forces_the_end_of_reasoning(stories_llm, reference, kwargs):
    llm = stories_llm if not kwargs else LLM(str(STORIES_EMBEDDED), **{**CUDA, **kwargs})
    ps = prompts(llm)
    plans = []  # the forced tokens of verify steps (speculative decoding)
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], [think(b) for b in BUDGETS])
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    if "speculative_config" in kwargs:
        assert llm.engine.scheduler.spec.num_accepted_tokens > 0
        assert any(len(f) > 1 for p in plans for f in p.forced_token_ids.values())
    del llm.engine.scheduler.schedule
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_opened_by_the_model_with_logprobs(stories_llm):
    """The model opens the reasoning itself (its own first greedy token stands in for the
    opening tag): the budget counts from the token after it; a forced token's logprob is the
    model's own; the finish reason is max_tokens'."""
    llm = stories_llm
    prompt = llm.tokenizer("Once upon a time").input_ids
    free = greedy(llm, prompt, 6)
    assert END not in free
    tail = greedy(llm, prompt + free[:4] + [END, SEP], 2)
    assert free[0] not in tail  # (it would open the reasoning again)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                        thinking_token_budget=3, thinking_start_token_id=free[0],
                        thinking_end_token_ids=[END, SEP])
    out = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0]
    assert list(out.token_ids) == free[:4] + [END, SEP] + tail
    assert out.finish_reason == "length" and len(out.logprobs) == 8
    e = out.logprobs[4]  # the forced END: not the model's first choice
    best = next(x for x in e.values() if x.rank == 1)
    assert list(e)[0] == END and e[END].rank > 1 and e[END].logprob < best.logprob
    # without the opener in the output or the prompt nothing is forced
    assert list(llm.generate({"prompt_token_ids": prompt}, think(0, 6))[0].outputs[0].token_ids) == free


def test_structured_output_after_the_forced_end(stories_llm):
    """A grammar that starts after the closing tag: the reasoning is cut at the budget, then the
    answer follows the grammar (no separator is forced: the grammar decides what follows)."""
    llm = stories_llm
    prompt = llm.tokenizer("Once upon a time").input_ids + [START]
    so = StructuredOutputsParams(choice=["yes", "no"], start_after_token_id=END)
    sp = SamplingParams(temperature=0, max_tokens=30, thinking_token_budget=4,
                        thinking_start_token_id=START, thinking_end_token_ids=[END],
                        structured_outputs=so)
    out = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0]
    ids = list(out.token_ids)
    assert ids[4] == END and out.finish_reason == "stop"
    assert llm.tokenizer.decode(ids[5:], skip_special_tokens=True).strip() in ("yes", "no")


def test_refused_without_reasoning_tags(stories_llm):
    with pytest.raises(ValueError, match="thinking_token_budget"):  # stories has no <think>
        stories_llm.generate("Once upon a time", SamplingParams(thinking_token_budget=4))
    with pytest.raises(ValueError, match="thinking_token_budget"):
        stories_llm.generate("Once upon a time", think(-1))


# ---- HTTP ----------------------------------------------------------------------------------------
THINK, UNTHINK, NL2 = 151667, 151668, 271  # Qwen3's <think>, </think>, "\n\n"


@pytest.fixture(scope="module")
def server(qwen3_chat_dir, tmp_path_factory):
    """The tiny random Qwen3 (it never closes its reasoning by itself) with a template that opens
    the reasoning in the generation prompt, as Qwen3-*-Thinking-2507's and DeepSeek-R1's do."""
    from test_server import Server
    template = (qwen3_chat_dir / "chat_template.jinja").read_text()
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
                              "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is "
                              "not defined or enable_thinking %}{{- '<think>\\n' }}{%- endif %}"
                              "\n    {%- if enable_thinking")
    assert opened != template
    path = tmp_path_factory.mktemp("tmpl") / "thinking.jinja"
    path.write_text(opened)
    s = Server(str(qwen3_chat_dir), "--served-model-name", "q", "--max-model-len", "2048",
               "--reasoning-parser", "qwen3", "--chat-template", str(path))
    yield s
    s.stop()


def post(server, path, body):
    import requests
    return requests.post(server.url + path, json=body, timeout=120)


def test_anthropic_budget_cuts_the_thinking_and_the_answer_follows(server, qwen3_chat_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_chat_dir)
    # Anthropic's rules: a budget of at least 1024, below max_tokens; adaptive: no budget
    body = {"model": "q", "max_tokens": 1060, "temperature": 0,
            "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    free = post(server, "/v1/messages", {**body, "thinking": {"type": "adaptive"}}).json()
    assert [b["type"] for b in free["content"]] == ["thinking"]  # thinks to max_tokens
    assert free["stop_reason"] == "max_tokens"
    for stream in (False, True):
        r = post(server, "/v1/messages", {**body, "stream": stream,
                                          "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
            thinking = "".join(e["delta"].get("thinking", "") for e in events
                               if e["type"] == "content_block_delta")
            text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        else:
            msg = r.json()
            blocks = [b["type"] for b in msg["content"]]
            thinking, text = msg["content"][0]["thinking"], msg["content"][1]["text"]
        assert blocks == ["thinking", "text"], r.text
        # cut: a prefix of the unbudgeted reasoning, about budget tokens long (the random model's
        # text does not re-tokenize exactly; exact ids: the chat test below)
        assert thinking in free["content"][0]["thinking"] and len(thinking) < len(free["content"][0]["thinking"])
        assert 1024 - 16 <= len(tok.encode(thinking)) <= 1024 + 16
        assert text.strip()
    for budget in (-1, 16, 1060):  # negative, below Anthropic's 1024, not below max_tokens
        bad = post(server, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": budget}})
        assert bad.status_code == 400 and "budget_tokens" in bad.text
    bad = post(server, "/v1/messages", {**body, "thinking": {"type": "disabled", "budget_tokens": 8}})
    assert bad.status_code == 400 and "budget_tokens" in bad.text


def test_chat_and_completions_take_thinking_token_budget(server):
    body = {"model": "q", "max_tokens": 30, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    r = post(server, "/v1/chat/completions", {**body, "thinking_token_budget": 10})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    assert UNTHINK not in ids[:10] and ids[10:12] == [UNTHINK, NL2]
    assert choice["message"]["reasoning"] and choice["message"]["content"]
    # 0: the answer at once; completions: the prompt opened the reasoning
    r = post(server, "/v1/chat/completions", {**body, "thinking_token_budget": 0})
    assert r.json()["choices"][0]["token_ids"][:2] == [UNTHINK, NL2]
    r = post(server, "/v1/completions", {"model": "q", "prompt": [1, 2, 3, THINK, 198],
                                         "max_tokens": 10, "temperature": 0,
                                         "return_token_ids": True, "thinking_token_budget": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"][3:5] == [UNTHINK, NL2]
    r = post(server, "/v1/chat/completions", {**body, "thinking_token_budget": -1})
    assert r.status_code == 400 and "thinking_token_budget" in r.text


def test_budget_needs_a_reasoning_parser():
    """Without --reasoning-parser the engine cannot tell where the reasoning ends: a 400."""
    import transformers
    from rankserve.runtime.serve.args import ServerArgs
    from rankserve.runtime.serve.context import ServeContext
    from rankserve.runtime.serve.protocol import APIError
    from conftest import SHARED
    tok = transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    ctx = ServeContext(ServerArgs(), "m", "/m", tok, None)
    with pytest.raises(APIError, match="--reasoning-parser") as e:
        ctx.with_thinking(SamplingParams(), 8, "thinking.budget_tokens")
    assert e.value.status == 400 and e.value.param == "thinking.budget_tokens"
    ctx = ServeContext(ServerArgs(reasoning_parser="qwen3"), "m", "/m", tok, None)
    sp = ctx.with_thinking(SamplingParams(), 8)
    assert (sp.thinking_token_budget, sp.thinking_start_token_id, sp.thinking_end_token_ids) == \
        (8, THINK, [UNTHINK, NL2])
    so = StructuredOutputsParams(json_object=True)
    assert ctx.with_thinking(SamplingParams(structured_outputs=so), 8).thinking_end_token_ids == [UNTHINK]


def test_offline_llm_takes_the_tags_from_the_tokenizer(qwen3_chat_dir):
    llm = LLM(str(qwen3_chat_dir), max_model_len=256, **CUDA)
    sp = SamplingParams(temperature=0, max_tokens=8, thinking_token_budget=3)
    out = llm.generate({"prompt_token_ids": [1, 2, 3, THINK, 198]}, sp)[0].outputs[0]
    assert list(out.token_ids)[3:5] == [UNTHINK, NL2]
