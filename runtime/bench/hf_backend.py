"""The transformers side of `rankserve bench ... --backend hf`: the same workload on
`AutoModelForCausalLM.from_config` (random weights, no checkpoint needed), greedy, EOS ignored.

- latency (`generate_static`): `model.generate(..., cache_implementation="static")`; with
  `--hf-compile` transformers' automatic torch.compile of the decode step is allowed (it only
  kicks in on CUDA), otherwise it is disabled so the run is eager.
- throughput (`run_batch`): continuous batching (`init_continuous_batching`, transformers >= 5;
  the same API in 5.17 and 5.24), each request with its own `max_new_tokens`. Without it, a
  left-padded batched `generate` to the longest output (reported as `mode`).

Step counts for the floor: the static and padded paths are exact by construction (one prefill
of the whole batch, then one decode step per further token); continuous batching is counted by
wrapping its manager's `_generation_step`, with per-step tokens from a forward hook when it saw
every step (CUDA-graph replays bypass it), else the average.
"""
from __future__ import annotations

import copy
import gc
import logging
import math
import time

import torch
from tqdm import tqdm

from .common import Workload


# its INFO chatter (and a psutil "ERROR" on CPU) would drown the benchmark's own output
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFBackend:
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, compile_: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM
        self.device, self.dtype, self.compile = device, dtype, compile_
        t0 = time.perf_counter()
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        _sync(device)
        self.timings = {"load": time.perf_counter() - t0}
        gc = self.model.generation_config
        gc.eos_token_id = None  # the benchmark ignores EOS (continuous batching reads None as "off")
        gc.pad_token_id = 0
        gc.do_sample = False
        self.forward_tokens: list[int] = []
        self._hook = self.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")[..., 0]
        self.forward_tokens.append(ids.numel())

    def close(self) -> None:
        self._hook.remove()
        del self.model
        gc.collect()  # generate's static cache and CB's paged cache hang off reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- latency ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_static(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[float, list[int]]:
        """Seconds for one static-cache generate, and the tokens of each step it ran."""
        b, n = input_ids.shape
        ids = input_ids.to(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, cache_implementation="static",
                                  disable_compile=not self.compile)
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        if out.shape[1] - n != max_new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - n} tokens, not {max_new_tokens}")
        return elapsed, [b * n] + [b] * (max_new_tokens - 1)

    # ---- throughput -------------------------------------------------------------------------
    def run_batch(self, wl: Workload, progress: bool = False) -> tuple[float, list[int], list[int], str]:
        """(seconds, output length per request, tokens per step, mode) for the whole workload."""
        if hasattr(self.model, "init_continuous_batching"):
            return self._continuous(wl, progress)
        return self._padded(wl)

    @torch.no_grad()
    def _continuous(self, wl: Workload, progress: bool):
        # no_grad, not inference_mode: the manager's warm-up (CUDA-graph capture) would make its
        # static buffers inference tensors, which its own generation thread (outside inference
        # mode) then may not update in place: every request failed on the H200 (transformers 5.17)
        from transformers import ContinuousBatchingConfig
        cb = None
        if self.device.type != "cuda":
            # CPU: size the paged cache for this workload (its default probes host memory and
            # allocates for minutes); page size 256 is the default of every version with CB
            cb = ContinuousBatchingConfig(
                num_blocks=sum(math.ceil((p + o) / 256) for p, o in zip(wl.prompt_lens, wl.output_lens)) + 1,
                max_batch_tokens=max(512, max(wl.prompt_lens)))
        # a copy: init_continuous_batching rewrites eos None as -1, which generate() would then see
        manager = self.model.init_continuous_batching(generation_config=copy.deepcopy(self.model.generation_config),
                                                      continuous_batching_config=cb)
        steps = [0]
        inner = manager._generation_step

        def step():
            steps[0] += 1
            return inner()
        manager._generation_step = step
        if self.device.type == "cuda":
            manager.warmup()  # CUDA-graph capture, outside the timed region
        manager.start()
        try:
            self.forward_tokens.clear()
            _sync(self.device)
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=o) for p, o in zip(wl.prompts, wl.output_lens)]
            done: dict[str, int] = {}
            bar = tqdm(total=len(ids), desc="Generating (hf)", disable=not progress)
            while len(done) < len(ids):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread died")
                    continue
                if r.is_finished():
                    if r.error:
                        raise RuntimeError(f"transformers request {r.request_id} failed: {r.error}")
                    done[r.request_id] = len(r.generated_tokens)
                    bar.update(1)
            elapsed = time.perf_counter() - t0
            bar.close()
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
        out_lens = [done[i] for i in ids]
        n = steps[0]
        if len(self.forward_tokens) == n:
            step_tokens = list(self.forward_tokens)
        else:  # graph replays skip the hook: spread the processed tokens evenly
            total = sum(p + o - 1 for p, o in zip(wl.prompt_lens, out_lens))
            step_tokens = [total // n] * n
        return elapsed, out_lens, step_tokens, "continuous batching (init_continuous_batching)"

    @torch.inference_mode()
    def _padded(self, wl: Workload):
        """Fallback: one left-padded batch generated to the longest requested output."""
        width, new = max(wl.prompt_lens), max(wl.output_lens)
        ids = torch.zeros(len(wl.prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(wl.prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            disable_compile=not self.compile)
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        b = len(wl.prompts)
        # every row runs to the longest output; the useful outputs are the requested lengths
        return (elapsed, list(wl.output_lens), [b * width] + [b] * (new - 1),
                "padded batched generate (no continuous batching in this transformers)")
