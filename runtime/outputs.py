"""Frontend output processing shared by the offline LLM and the API server: turns
EngineCoreOutputs into RequestOutputs (detokenized text, stop strings, logprobs), and fans a
request with n > 1 out into n engine requests."""
from __future__ import annotations

from dataclasses import dataclass, field

from .detokenize import IncrementalDetokenizer
from .messages import EngineCoreOutput, FinishReason, LogprobsEntry
from .sampling_params import SamplingParams


@dataclass
class Logprob:
    """vLLM's offline logprob of one token at one position."""
    logprob: float
    rank: int | None = None  # 1-based, in the whole distribution
    decoded_token: str | None = None


def logprob_dict(e: LogprobsEntry | None, decode) -> dict[int, Logprob] | None:
    """One position's entry (the chosen token, then the top k) in vLLM's offline shape: token
    id → Logprob, the chosen token first (k + 1 entries when it is not in the top k)."""
    if e is None:
        return None
    return {t: Logprob(lp, r, decode(t)) for t, lp, r in zip(e.token_ids, e.logprobs, e.ranks)}


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # the engine's entries; offline (LLM.generate) vLLM's dict[token id, Logprob] per position
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # offline, with logprobs: the sampled tokens' sum (vLLM's)
    # what the last update added (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[LogprobsEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class RequestState:
    """One engine request (one of the n choices) as the frontend tracks it."""

    def __init__(self, parent: "ParentState", index: int, tokenizer, params: SamplingParams):
        self.parent = parent
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detok = None
        if params.detokenize and tokenizer is not None:
            self.detok = IncrementalDetokenizer(tokenizer, parent.output.prompt_token_ids,
                                                params.skip_special_tokens, params.stop,
                                                params.include_stop_str_in_output,
                                                params.min_tokens, params.kept_special_token_ids)


class ParentState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer):
        self.params = params
        self.output = RequestOutput(request_id, prompt, prompt_token_ids, [])
        self.children = [RequestState(self, i, tokenizer, params) for i in range(params.n)]
        self.output.outputs = [c.out for c in self.children]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # engine request id → state

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Register a request; returns the engine request ids (n of them)."""
        parent = ParentState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        ids = []
        for i, child in enumerate(parent.children):
            cid = child_request_id(request_id, i, params.n)
            self.states[cid] = child
            ids.append(cid)
        return ids

    def abort(self, engine_request_ids: list[str]) -> None:
        for cid in engine_request_ids:
            self.states.pop(cid, None)

    def process(self, o: EngineCoreOutput) -> tuple[RequestOutput | None, bool]:
        """Apply one engine output. Returns (the parent's RequestOutput or None if unknown,
        whether the engine must be told to abort this child — a stop string matched)."""
        st = self.states.get(o.request_id)
        if st is None:
            return None, False
        out, parent = st.out, st.parent
        out.delta_token_ids = list(o.new_token_ids)
        out.token_ids.extend(o.new_token_ids)
        out.delta_logprobs = o.new_logprobs
        if out.logprobs is not None and o.new_logprobs:
            out.logprobs.extend(o.new_logprobs)
        if o.prompt_logprobs is not None:
            parent.output.prompt_logprobs = [None] + list(o.prompt_logprobs)
        parent.output.num_cached_tokens = max(parent.output.num_cached_tokens, o.num_cached_tokens)
        abort = False
        out.delta_text = ""
        if st.detok is not None:
            ids = o.new_token_ids
            # the EOS / stop token that ended the request is no text (vLLM semantics)
            if (o.finish_reason == FinishReason.STOP and not isinstance(o.stop_reason, str)
                    and not parent.params.include_stop_str_in_output):
                ids = ids[:-1]
            _, stop_str, used = st.detok.push(ids)
            out.text = st.detok.text
            engine_done = o.finish_reason is not None
            if stop_str is not None and used < len(o.new_token_ids) and not o.error:
                # several tokens arrived at once (speculative decoding): those after the one that
                # completed the stop string, an EOS / stop token included, are not output
                del out.token_ids[len(out.token_ids) - len(o.new_token_ids) + used:]
                out.delta_token_ids = out.delta_token_ids[:used]
                if o.new_logprobs and out.logprobs is not None:
                    del out.logprobs[len(out.logprobs) - len(o.new_logprobs) + used:]
                    out.delta_logprobs = o.new_logprobs[:used]
                o.finish_reason = None
            if stop_str is not None and o.finish_reason is None:
                o.finish_reason, o.stop_reason, abort = FinishReason.STOP, stop_str, not engine_done
            elif stop_str is not None:
                o.finish_reason, o.stop_reason = FinishReason.STOP, stop_str
            out.delta_text = st.detok.take_delta(final=o.finish_reason is not None)
        if o.finish_reason is not None:
            out.finish_reason = o.finish_reason.value if isinstance(o.finish_reason, FinishReason) else o.finish_reason
            out.stop_reason = o.stop_reason
            if o.error:
                out.finish_reason = "error"
            del self.states[o.request_id]
        return parent.output, abort
