"""Offline beam search (vLLM's LLM.beam_search) against the same search run on transformers'
logits of the same checkpoint: the same beams, in the same order, with the same scores."""
from __future__ import annotations

import pytest
import torch

from rankserve import BeamSearchParams, SamplingParams
from conftest import STORIES_EMBEDDED


def hf_beam_search(model, ids, width, max_tokens, eos, length_penalty, ignore_eos=False):
    """The reference: every candidate of every beam from the full log-softmax (the engine ranks
    each beam's top 2 x width, which holds every candidate that can survive)."""
    def score(toks, cum):
        n = len(toks) - (1 if toks[-1] == eos else 0)
        return cum / n ** length_penalty
    live, done = [(list(ids), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for toks, cum in live:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([toks])).logits[0, -1].double(), -1)
            top = lp.topk(2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (done if t == eos and not ignore_eos else grown).append((toks + [t], cum + v))
        live = sorted(grown, key=lambda s: score(*s), reverse=True)[:width]
    return sorted(done + live, key=lambda s: score(*s), reverse=True)[:width]


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_search_matches_transformers(stories_llm, width, length_penalty):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(STORIES_EMBEDDED), torch_dtype=torch.float32)
    llm = stories_llm
    prompt = "Once upon a time, there was a"
    ids = llm.get_tokenizer()(prompt).input_ids
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=6,
                                                     length_penalty=length_penalty))
    assert len(out) == 1 and len(out[0].sequences) == width
    want = hf_beam_search(model, ids, width, 6, llm.eos_token_id, length_penalty)
    for got, (toks, cum) in zip(out[0].sequences, want):
        assert got.tokens == toks
        # (CUDA runs the fp32 checkpoint in 16 bits by default: logprobs a few 1e-3 apart)
        assert got.cum_logprob == pytest.approx(cum, abs=3e-2 if torch.cuda.is_available() else 1e-3)
        assert got.tokens[:len(ids)] == ids and len(got.logprobs) == len(toks) - len(ids)
        assert got.text == llm.get_tokenizer().decode(toks[len(ids):], skip_special_tokens=True)
        assert got.finish_reason in ("stop", "length")
    if width == 1:  # one beam is greedy decoding
        greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        assert out[0].sequences[0].tokens[len(ids):] == greedy.token_ids


def test_beam_search_eos_context_and_errors(stories_llm, monkeypatch):
    llm = stories_llm
    # stories260K's greedy stories run past 400 tokens: "." stands in for EOS (complete beams:
    # finish_reason stop, the stop token's text only with include_stop_str_in_output)
    dot = llm.get_tokenizer()("a.").input_ids[-1]
    monkeypatch.setattr(llm, "eos_token_id", dot)
    for keep in (False, True):
        out = llm.beam_search(["Once upon a time"], BeamSearchParams(
            beam_width=2, max_tokens=30, include_stop_str_in_output=keep))
        stop = [s for s in out[0].sequences if s.finish_reason == "stop"]
        assert stop and all(s.tokens[-1] == dot and s.text.endswith(".") == keep for s in stop)
    monkeypatch.undo()
    # the context length ends a beam as max_tokens would, never an error
    limit = llm.engine.max_model_len
    long = [1] + [403] * (limit - 3)
    out = llm.beam_search([long], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert all(len(s.tokens) == limit and s.finish_reason == "length" for s in out[0].sequences)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=0, max_tokens=2))
