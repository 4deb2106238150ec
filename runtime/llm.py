"""Offline inference: `LLM(model, **config).generate(prompts, SamplingParams)`.

Drives the same EngineCore loop (schedule → execute → update) that the server drives.
"""
from __future__ import annotations

import itertools

import msgspec
from tqdm import tqdm

from . import envs, startup_clock
from .config import DEFAULT_MODEL, EngineConfig
from .engine_core import EngineCore
from .inputs import (TOKENIZER_FILES, engine_request, eos_token_ids_of, load_tokenizer,  # noqa: F401
                     sampling_defaults)
from .outputs import OutputProcessor, RequestOutput, child_request_id, logprob_dict
from .sampling_params import SamplingParams


# vLLM's LLM options whose value here can only be their default (offline runs log no stats, the
# tokenizer is the checkpoint's fast one): that value is accepted, any other refused by name
_FIXED = {"disable_log_stats": True, "tokenizer_mode": "auto"}


def _vllm_defaults(kwargs: dict) -> None:
    for name, only in _FIXED.items():
        if name in kwargs and kwargs.pop(name) != only:
            raise ValueError(f"{name}: only {only!r} is supported by the offline LLM")


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 executor=None, **kwargs):
        startup_clock.mark("imports")  # process start → here: interpreter, imports, CLI
        envs.check()  # a bad RANKSERVE_* value fails here, not at the first request that reads it
        _vllm_defaults(kwargs)
        self.config = config or EngineConfig.from_kwargs(model=model or DEFAULT_MODEL, **kwargs)
        m = self.config.model
        self.tokenizer = load_tokenizer(m.tokenizer or m.model, m.trust_remote_code)
        self.eos_token_ids = eos_token_ids_of(self.tokenizer, m.model)  # (no tokenizer: the config's)
        startup_clock.mark("tokenizer")
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._renderer = None  # (chat; made on first use)
        if executor is None:
            from .executor import UniprocExecutor
            executor = UniprocExecutor(self.config)
        self.engine = EngineCore(self.config, executor)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._dead: str | None = None  # the error of a step that failed (vLLM's dead engine)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams (as vLLM): the fields the
        model's generation_config.json sets (`max_new_tokens` as `max_tokens`), the rest default."""
        m = self.config.model
        return SamplingParams(**sampling_defaults(m.model, m.generation_config,
                                                  m.override_generation_config))

    def _to_token_ids(self, prompt) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and (isinstance(prompt, str) or "prompt_token_ids" not in prompt
                                       if isinstance(prompt, (str, dict)) else False):
            where = self.config.model.tokenizer or self.config.model.model
            raise ValueError(f"{where!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): give a "
                             "tokenizer directory (--tokenizer, LLM(tokenizer=...)) or pass prompt token ids")
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        return None, list(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings, token-id lists, or dicts with
        `prompt`/`prompt_token_ids`). `lora_request`: one LoRARequest for all prompts, or a list
        (one per prompt, None for the base model). Invalid requests raise ValueError before any
        is queued."""
        if self._dead:  # a failed step left the engine's state half updated: never run it again
            raise RuntimeError(f"the engine failed in an earlier step ({self._dead}); create a new LLM")
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single or (isinstance(prompts, list) and not prompts):
            prompts = [prompts] if single else prompts
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        for name, per_prompt in (("sampling_params", params), ("lora_request", loras),
                                 ("priority", priority)):
            if per_prompt is not None and len(per_prompt) != len(prompts):
                raise ValueError(f"{name}: {len(per_prompt)} entries for {len(prompts)} prompts")
        vocab = self.engine.vocab_size  # logprobs -1: the whole vocabulary (vLLM's), held to max_logprobs
        params = [msgspec.structs.replace(sp, **{f: vocab for f in ("logprobs", "prompt_logprobs")
                                                 if getattr(sp, f) == -1}) for sp in params]
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            text, ids = self._to_token_ids(p)
            if sp.truncate_prompt_tokens is not None:  # keep the last k (-1: max_model_len)
                keep = sp.truncate_prompt_tokens
                ids = ids[-(self.engine.max_model_len if keep == -1 else keep):]
            rid = str(next(self._ids))
            for cid in range(sp.n):
                reqs.append((rid, text, ids, sp, engine_request(
                    child_request_id(rid, cid, sp.n), ids, sp, self.eos_token_ids,
                    priority[i] if priority else 0, index=cid, tokenizer=self.tokenizer,
                    lora_request=loras[i])))
        for *_, r in reqs:
            self.engine.validate(r)
            if r.sampling_params.structured_outputs is not None:  # (refused before any is queued)
                self.engine.structured.validate(r.sampling_params.structured_outputs)
        order, results = [], {}
        for rid, text, ids, sp, r in reqs:
            if rid not in results:
                self.processor.add_request(rid, text, ids, sp)
                order.append(rid)
                results[rid] = None
            self.engine.add_request(r)
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        pending = set(order)
        while pending:
            try:
                outs = self.engine.step()
            except Exception as e:
                self._dead = f"{type(e).__name__}: {e}"
                raise
            for o in outs.outputs:
                ro, abort = self.processor.process(o)
                if abort:
                    self.engine.abort_requests([o.request_id])
                if ro is not None and ro.finished and ro.request_id in pending:
                    pending.discard(ro.request_id)
                    results[ro.request_id] = ro
                    bar.update(1)
        bar.close()
        return [self._vllm_logprobs(results[r]) for r in order]

    def _vllm_logprobs(self, ro: RequestOutput) -> RequestOutput:
        """Logprobs in vLLM's offline shape (runtime/outputs.py `logprob_dict`); the server
        formats the engine's entries itself."""
        tok = self.tokenizer
        decode = (lambda t: tok.decode([t])) if tok is not None else (lambda t: None)
        if ro.prompt_logprobs is not None:
            ro.prompt_logprobs = [logprob_dict(e, decode) for e in ro.prompt_logprobs]
        for c in ro.outputs:
            if c.logprobs is not None:
                c.logprobs = [logprob_dict(e, decode) for e in c.logprobs]
                c.cumulative_logprob = sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids))
        return ro

    def beam_search(self, prompts, params, lora_request=None, use_tqdm: bool = False):
        """vLLM's offline beam search (runtime/beam_search.py): `params` a BeamSearchParams; one
        BeamSearchOutput per prompt, its sequences best first."""
        from .beam_search import beam_search
        return beam_search(self, prompts, params, lora_request, use_tqdm)

    def get_tokenizer(self):
        """The tokenizer prompts are encoded with (vLLM's); None for a model without one."""
        return self.tokenizer

    # ---- sleep mode and weight updates (vLLM's / SGLang's names) -------------------------------
    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """vLLM's offline chat: `messages` is one conversation (OpenAI chat messages) or a list
        of them; each is rendered as the server renders chat requests (the model's chat
        template, or `chat_template`: a path or the template itself), then generated."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this model directory has none (--tokenizer)")
        if self._renderer is None:
            import json
            import os

            from .render import get_renderer
            with open(os.path.join(self.config.model.model, "config.json")) as f:
                model_type = json.load(f).get("model_type")
            self._renderer = get_renderer("auto", self.tokenizer, model_type)
        one = not messages or isinstance(messages[0], dict)
        prompts = [{"prompt_token_ids": self._renderer.render_chat(
            conv, tools, chat_template_kwargs, add_generation_prompt, continue_final_message,
            chat_template)} for conv in ([messages] if one else messages)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def start_profile(self) -> dict:
        """Profile every rank from here (needs `profiler_config`, vLLM's keys: runtime/profiler.py)."""
        return self.engine.start_profile()

    def stop_profile(self) -> dict:
        """Stop; {"traces": every rank's trace path} (torch profiler)."""
        return self.engine.stop_profile()

    def sleep(self, level: int = 1) -> dict:
        """Give the device memory back (needs `enable_sleep_mode=True`): level 1 keeps the
        weights in pinned host memory, level 2 discards them; the KV cache is discarded.
        generate() raises while asleep."""
        return self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Take it back: `tags` "weights" and/or "kv_cache" (None: both)."""
        return self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's call on every rank, for its sleep-mode flow: `collective_rpc("reload_weights")`
        after `sleep(2)` and `wake_up(["weights"])` loads the weights the engine started with;
        other methods are refused (ValueError), as is a `timeout` (not implemented). One result
        per rank."""
        if timeout is not None:
            raise ValueError("collective_rpc: timeout is not supported (the call runs to its end)")
        return self.engine.collective_rpc(method, args, kwargs)

    def update_weights_from_disk(self, model_path: str) -> dict:
        """Load a checkpoint of the same architecture in place (every rank)."""
        return self.engine.update_weights_from_disk(model_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> dict:
        return self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                     world_size, group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weight_update_group") -> dict:
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.engine.destroy_weights_update_group(group_name)
