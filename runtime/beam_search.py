"""Offline beam search (vLLM's `LLM.beam_search`): each step asks the engine for one token of
every live beam with its top 2 x beam_width logprobs (the prefix cache keeps the beams' prompts),
extends each beam by those candidates and keeps the beam_width best by length-penalised
cumulative logprob. A beam that samples EOS is complete; the best beam_width of the complete and
live beams are returned."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # of each step's sampling (vLLM's); beams are ranked by logprobs
    length_penalty: float = 1.0  # score = cum_logprob / length ** length_penalty
    include_stop_str_in_output: bool = False  # keep EOS's text in a complete beam's text

    def validate(self, max_logprobs: int) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if max_logprobs != -1 and 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width {self.beam_width} ranks 2 x beam_width candidates per "
                             f"beam: more than max_logprobs ({max_logprobs}); raise "
                             "LLM(max_logprobs=...)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones
    logprobs: list[dict] = field(default_factory=list)  # per generated token: id -> Logprob
    cum_logprob: float = 0.0
    text: str | None = None  # the generated tokens' text (filled on return)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def score(seq: BeamSearchSequence, eos: int | None, length_penalty: float) -> float:
    """vLLM's ranking: EOS does not count towards the length."""
    n = len(seq.tokens) - (1 if eos is not None and seq.tokens[-1] == eos else 0)
    return seq.cum_logprob / (n ** length_penalty)


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    from tqdm import tqdm

    from .sampling_params import SamplingParams
    params.validate(llm.config.model.max_logprobs)
    eos = llm.eos_token_id
    limit = llm.engine.max_model_len
    prompts = prompts if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) \
        else [prompts]
    loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
    starts = [llm._to_token_ids(p)[1] for p in prompts]
    live = [[BeamSearchSequence(ids)] for ids in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    sp = SamplingParams(temperature=params.temperature, max_tokens=1, ignore_eos=True,
                        logprobs=2 * params.beam_width, detokenize=False)
    key = lambda s: score(s, eos, params.length_penalty)  # noqa: E731
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        # a beam at the context length cannot grow: it ends as if max_tokens were reached
        flat = [(i, b) for i, beams in enumerate(live) for b in beams if len(b.tokens) < limit]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in flat], sp,
                            lora_request=[loras[i] for i, _ in flat])
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, b), out in zip(flat, outs):
            cands = out.outputs[0].logprobs[0]
            for tok, lp in cands.items():
                s = BeamSearchSequence(b.tokens + [tok], b.logprobs + [cands],
                                       b.cum_logprob + lp.logprob)
                if tok == eos and not params.ignore_eos:
                    s.finish_reason, s.stop_reason = "stop", None
                    done[i].append(s)
                else:
                    grown[i].append(s)
        live = [sorted(g, key=key, reverse=True)[:params.beam_width] for g in grown]
    tok = llm.tokenizer
    results = []
    for i, ids in enumerate(starts):
        for s in live[i]:
            s.finish_reason = "length"
        best = sorted(done[i] + live[i], key=key, reverse=True)[:params.beam_width]
        for s in best:
            gen = s.tokens[len(ids):]
            if s.finish_reason == "stop" and not params.include_stop_str_in_output:
                gen = gen[:-1]
            s.text = tok.decode(gen, skip_special_tokens=True) if tok is not None else None
        results.append(BeamSearchOutput(best))
    return results
