"""Sampler and stopping: seeds, penalties, top-k/top-p/min-p, logprobs, n, stop conditions."""
import math

import pytest
import torch

from rankserve import SamplingParams
from rankserve.runtime.sampler import SamplingMetadata, argmax_rows, sample


def md(B, **kw):
    temp = kw.pop("temperature", torch.ones(B))
    return SamplingMetadata(temperature=temp, all_greedy=False, **kw)


def test_seeded_sampling_is_reproducible(stories_llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    a = stories_llm.generate("Once upon a time", sp)[0].outputs[0].token_ids
    # same seed inside a different batch gives the same tokens
    b = stories_llm.generate(["The cat", "Once upon a time"], [SamplingParams(temperature=1.0,
                             max_tokens=30), sp])[1].outputs[0].token_ids
    c = stories_llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=99,
                             max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    assert a == b and a != c


def test_rows_that_all_have_seeds_draw_no_shared_noise():
    """A batch whose rows all carry their own generator draws each row's noise once, from its
    own generator: the shared draw for the whole batch (every row's overwritten at once) cost
    half of a seeded step at a 152k vocabulary on the CPU. The seeded tokens stay the same."""
    logits = torch.randn(3, 50)
    gens = {r: torch.Generator().manual_seed(7 + r) for r in range(3)}
    want = []
    for r in range(3):  # each row alone: only its own generator's noise
        q = torch.empty(50).exponential_(generator=torch.Generator().manual_seed(7 + r))
        want.append(int((logits[r].softmax(-1) / q).argmax()))
    state = torch.random.get_rng_state()
    ids, _ = sample(logits, md(3, generators=gens))
    assert ids.tolist() == want
    assert torch.equal(torch.random.get_rng_state(), state)  # the shared generator untouched


def test_top_k_1_is_greedy_and_top_k_limits_support():
    logits = torch.randn(3, 50)
    ids, _ = sample(logits, md(3, top_k=torch.tensor([1, 1, 1])))
    assert ids.tolist() == logits.argmax(-1).tolist()
    top3 = logits.topk(3, -1).indices
    for _ in range(20):
        ids, _ = sample(logits, md(3, top_k=torch.tensor([3, 3, 3])))
        assert all(ids[i] in top3[i] for i in range(3))


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = set()
    for _ in range(200):
        ids, _ = sample(logits, md(1, top_p=torch.tensor([0.75])))
        seen.add(ids.item())
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    seen = set()
    for _ in range(200):
        ids, _ = sample(probs.log(), md(1, min_p=torch.tensor([0.2])))
        seen.add(ids.item())
    assert seen == {0, 1}


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    counts = torch.tensor([[3, 0, 0, 0]])
    none = torch.zeros(1, 4, dtype=torch.bool)
    greedy = torch.zeros(1)
    base = dict(temperature=greedy, output_counts=counts, prompt_mask=none)
    # frequency penalty 0.1 * 3 pushes token 0 below token 1
    ids, _ = sample(logits, md(1, frequency_penalty=torch.tensor([0.1]),
                               presence_penalty=torch.tensor([0.0]), **base))
    assert ids.item() == 1
    ids, _ = sample(logits, md(1, frequency_penalty=torch.tensor([0.0]),
                               presence_penalty=torch.tensor([0.2]), **base))
    assert ids.item() == 1
    # repetition penalty divides positive logits of seen tokens (prompt included)
    ids, _ = sample(logits, md(1, repetition_penalty=torch.tensor([1.2]),
                               frequency_penalty=torch.tensor([0.0]),
                               presence_penalty=torch.tensor([0.0]), **base))
    assert ids.item() == 1


def test_penalties_end_to_end_reduce_repetition(stories_llm):
    p = "Once upon a time"
    plain = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    pen = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                 frequency_penalty=1.5))
    a, b = plain[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert len(set(b)) > len(set(a))


def test_logprobs_and_prompt_logprobs(stories_llm):
    """vLLM's offline shape: per position a dict token id → Logprob(logprob, rank, decoded_token)
    holding the top k and the chosen token (k + 1 entries when it is not among them)."""
    from rankserve import Logprob
    out = stories_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2))[0]
    c = out.outputs[0]
    tok_text = stories_llm.tokenizer.decode
    assert len(c.logprobs) == 5
    for tok, d in zip(c.token_ids, c.logprobs):
        assert isinstance(d, dict) and len(d) == 3 and isinstance(d[tok], Logprob)
        assert d[tok].rank == 1 and d[tok].decoded_token == tok_text([tok])  # greedy picks rank 1
        assert sorted(x.rank for x in d.values()) == [1, 2, 3]
        assert d[tok].logprob == max(x.logprob for x in d.values())
        assert sum(math.exp(x.logprob) for x in d.values()) <= 1 + 1e-5
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in d and len(d) in (2, 3)  # the prompt's token, and the top 2 (it may be one)
        assert (len(d) == 2) == (d[tok].rank <= 2)


def test_n_choices(stories_llm):
    out = stories_llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=7,
                                                                 max_tokens=10))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeded choices still differ
    assert all(len(c.token_ids) == 10 or c.finish_reason == "stop" for c in out.outputs)


def test_stop_strings_and_token_ids(stories_llm):
    p = "Once upon a time"
    out = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    c = out.outputs[0]
    assert c.text == ", there was a little girl named " and c.finish_reason == "stop"
    assert c.stop_reason == "Lily"
    out = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=40, stop=["Lily"],
                                                 include_stop_str_in_output=True))[0]
    assert out.outputs[0].text.endswith("named Lily")
    full = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    tok = full.token_ids[5]
    out = stories_llm.generate(p, SamplingParams(temperature=0, max_tokens=40,
                                                 stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:6] and out.stop_reason == tok
    assert stories_llm.engine.scheduler.kv.num_free_blocks == stories_llm.engine.num_blocks


def run_engine(llm, ids, sp, eos):
    from rankserve.runtime.messages import EngineCoreRequest
    eng = llm.engine
    eng.add_request(EngineCoreRequest("eos-test", ids, sp, eos_token_id=eos))
    toks, reason = [], None
    while eng.has_work:
        for o in eng.step().outputs:
            toks += o.new_token_ids
            reason = o.finish_reason or reason
    return toks, reason.value


def test_eos_min_tokens_ignore_eos_and_length(stories_llm):
    ids = stories_llm.tokenizer("Once upon a time").input_ids
    full = stories_llm.generate({"prompt_token_ids": ids},
                                SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
    eos = full[5]  # pretend this token ends the sequence
    first = full.index(eos)
    toks, reason = run_engine(stories_llm, ids, SamplingParams(temperature=0, max_tokens=40), eos)
    assert toks == full[:first + 1] and reason == "stop"
    toks, reason = run_engine(stories_llm, ids, SamplingParams(temperature=0, max_tokens=40,
                                                               min_tokens=first + 3), eos)
    assert eos not in toks[:first + 3] and len(toks) >= first + 3
    toks, reason = run_engine(stories_llm, ids, SamplingParams(temperature=0, max_tokens=12,
                                                               ignore_eos=True), eos)
    assert len(toks) == 12 and reason == "length"


def test_streamed_deltas_never_contain_a_stop_string(stories_llm):
    """Deltas concatenate to the final text, and no delta shows part of the stop string."""
    from rankserve.runtime.outputs import OutputProcessor
    from rankserve.runtime.messages import EngineCoreRequest
    ids = stories_llm.tokenizer("Once upon a time").input_ids
    sp = SamplingParams(temperature=0, max_tokens=40, stop=["named Lily"])
    proc = OutputProcessor(stories_llm.tokenizer)
    proc.add_request("s", None, ids, sp)
    eng = stories_llm.engine
    eng.add_request(EngineCoreRequest("s", ids, sp, eos_token_id=stories_llm.eos_token_id))
    deltas, final = [], None
    while eng.has_work:
        for o in eng.step().outputs:
            ro, abort = proc.process(o)
            if abort:
                eng.abort_requests([o.request_id])
            if ro is not None:
                deltas.append(ro.outputs[0].delta_text)
                final = ro.outputs[0]
    assert final.text == ", there was a little girl " and final.finish_reason == "stop"
    assert "".join(deltas) == final.text, deltas
    assert not any("named" in d for d in deltas)


@pytest.mark.parametrize("V", [128256, 151936, 4096 * 3, 50257, 512])
def test_argmax_rows_is_argmax_first_max_on_ties(V):
    """The two-pass argmax of few long rows (the greedy sampler's on CUDA) equals torch's,
    the first maximum on ties, including ties across slices, -inf rows and bf16 logits."""
    g = torch.Generator().manual_seed(V)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, V, generator=g).to(dtype)
        x[1, V // 3] = x[1, V - 7] = x[1].max() + 1  # tie across slices: the first wins
        x[2, 5] = x[2, 6] = x[2].max() + 1           # tie within a slice
        x[3] = float("-inf")
        x[4] = x[4].round()                           # many ties
        x[5, -1] = x[5].max() + 1                     # the last token
        assert torch.equal(argmax_rows(x), x.argmax(-1)), dtype


def test_none_for_a_list_field_means_empty_as_in_vllm(stories_llm):
    """vLLM's SamplingParams default stop / stop_token_ids / bad_words to None; code written for
    it passes them so and must get the plain output (it raised TypeError inside generate)."""
    want = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    sp = SamplingParams(temperature=0, max_tokens=8, stop=None, stop_token_ids=None, bad_words=None)
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.bad_words == []
    got = stories_llm.generate("Once upon a time", sp)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_vllm_offline_api_extras(stories_llm):
    """What vLLM scripts use beside generate(): get_tokenizer(), each choice's cumulative_logprob
    (None without logprobs), SamplingParams(truncate_prompt_tokens=k) keeping the last k tokens."""
    llm = stories_llm
    assert llm.get_tokenizer() is llm.tokenizer
    ids = llm.get_tokenizer()("Once upon a time there was").input_ids
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    c = out.outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert c.cumulative_logprob < 0
    plain = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4))[0]
    assert plain.outputs[0].cumulative_logprob is None
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, truncate_prompt_tokens=3))
    assert cut[0].prompt_token_ids == ids[-3:]
    whole = llm.generate(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert whole[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=0))


def test_vllm_llm_options_at_their_only_value():
    from rankserve import LLM
    from conftest import STORIES_EMBEDDED
    LLM(str(STORIES_EMBEDDED), disable_log_stats=True, tokenizer_mode="auto", max_num_seqs=2)
    for kw in ({"disable_log_stats": False}, {"tokenizer_mode": "slow"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            LLM(str(STORIES_EMBEDDED), **kw)
