"""Engine-side request state."""
from __future__ import annotations

import enum

from .messages import EngineCoreRequest, FinishReason
from .sampling_params import SamplingParams
from .thinking_budget import ThinkingBudget


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    def __init__(self, req: EngineCoreRequest, max_model_len: int):
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params: SamplingParams = req.sampling_params
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.eos_token_id = req.eos_token_id
        self.lora_request = req.lora_request
        self.all_token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        sp = req.sampling_params
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        self.status = RequestStatus.WAITING
        # scheduling state: read and written by the scheduler alone
        self.num_computed_tokens = 0  # tokens whose KV is (or is being) computed
        self.num_pending = 0  # tokens that in-flight steps will sample
        self.num_in_flight = 0  # scheduled steps whose results are not back
        self.num_sent: int | None = None  # tokens the runners know; None: they hold no state
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.block_hashes: list[bytes] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # engine clock (time.monotonic): entered the waiting queue, first scheduled (a preempted
        # request keeps it, as vLLM's); sent with the first output for the phase histograms
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        # prompt logprobs are gathered chunk by chunk and sent with the first output
        self.prompt_logprobs: list = []
        # structured outputs: compilation future, then the grammar matcher (structured_output.py)
        self.grammar = None
        # thinking_token_budget: the reasoning tokens so far (the scheduler reads the outputs in)
        self.thinking = (ThinkingBudget(sp, self.prompt_token_ids)
                         if sp.thinking_token_budget is not None else None)
        # speculative decoding: the proposer's guesses of the next tokens, verified next step
        self.spec_token_ids: list[int] = []
        self.spec_misses = 0  # verify passes in a row that accepted nothing
        self.spec_rejects = 0  # verify passes that accepted nothing, while none ever did (-1: one did)
        self.spec_pause = 0  # steps left without drafts (backoff after misses)
        self.spec_in_flight = 0  # drafts of a step in flight (verified when it returns)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def preempt(self) -> None:
        """Back to the queue; its KV is recomputed when it is scheduled again. Only a request
        with no step in flight is preempted, so nothing is pending."""
        assert self.num_in_flight == 0 and self.num_pending == 0, self.request_id
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_sent = None
        self.spec_token_ids = []
        # recomputed from its first token (such a request reads no cached prefix): gathered anew
        # (a fresh list: one already sent with its first output stays as it was)
        self.prompt_logprobs = []
        self.num_preemptions += 1

    def sort_key(self, policy: str):
        """Order in which requests are served (and the reverse: preemption victims)."""
        if policy == "priority":
            return (self.priority, self.arrival_time)
        return (self.arrival_time,)
