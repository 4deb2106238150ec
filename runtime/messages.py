"""The messages that travel between the API/frontend side and the EngineCore (msgspec/msgpack).

These types are the only thing the two sides share.
"""
from __future__ import annotations

import enum

import msgspec

from .sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """An adapter for a request (vLLM's name and argument order): `lora_int_id` > 0 identifies it
    (prefix-cache keys, slots); `lora_path` is a PEFT adapter directory every rank can read."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower value is served first (vLLM semantics)
    cache_salt: str | None = None
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None


class LogprobsEntry(msgspec.Struct, array_like=True):
    """Logprobs at one position: index 0 is the chosen token, then the top-k alternatives."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the distribution


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    # one entry per prompt position after the first; delivered with the first output
    prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_status: int | None = None  # HTTP status of `error` when not 400 (503: the engine sleeps)
    # with a request's first output only (vLLM's QUEUED / SCHEDULED events): when it entered the
    # waiting queue and when it was first scheduled, on the clock of EngineCoreOutputs.timestamp
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_hits: int = 0  # of which were hits (cumulative)
    num_preemptions: int = 0  # cumulative
    num_preemptions_swap: int = 0  # of which swapped to the host tier (the rest recompute)
    num_prompt_tokens: int = 0  # computed this step
    num_generation_tokens: int = 0  # generated this step
    # structured outputs (cumulative seconds): grammar compilation (worker threads), and the
    # step loop's host time to fill token bitmasks and advance the matchers
    grammar_compile_seconds: float = 0.0
    grammar_mask_seconds: float = 0.0
    grammar_wait_seconds: float = 0.0  # the step loop waiting for a mask fill (not hidden)
    # host KV tier (--kv-offload-size): tokens looked up there (the device tier missed them) and
    # found (cumulative), blocks copied to / from it (cumulative), its blocks in use and in all
    host_prefix_queries: int = 0
    host_prefix_hits: int = 0
    host_blocks_stored: int = 0
    host_blocks_loaded: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    # LoRA (vLLM's lora_requests_info): --max-loras (0: LoRA off), adapter names, comma-separated
    max_lora: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    # speculative decoding (cumulative): verify passes with drafts, draft tokens, accepted ones,
    # and accepted ones by draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    # the engine's time.monotonic() when the outputs were made (vLLM's engine_core_timestamp): the
    # API takes a request's first and last token times from it (a clock that never steps back)
    timestamp: float = 0.0
    # reply to a utility call: (call_id, result or None, error or None)
    utility_result: tuple[int, object, str | None] | None = None
    engine_dead: str | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a message sent to the EngineCore."""
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
