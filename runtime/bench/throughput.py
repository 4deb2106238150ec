"""Offline throughput: every request submitted at once, wall time of the whole batch.

`rankserve bench throughput MODEL --workload w1` (or --num-prompts/--input-len/--output-len)
times `LLM.generate` after a short warm-up run (startup and compilation are reported, not
timed), and prints requests/s, output tokens/s, total tokens/s and the physical floor
(`common.py`). `--backend hf` runs the same requests on transformers (continuous batching when
the installed version has it). Token-id prompts, greedy, EOS ignored, no detokenization.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from . import common
from ..sampling_params import SamplingParams, StructuredOutputsParams


@dataclass
class ThroughputArgs:
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int
    backends: tuple[str, ...]
    output_json: str | None = None
    plot: str | None = None
    profile_dir: str | None = None
    profile_steps: tuple[int, int] | None = None  # (first step, count) of the profiled window
    hf_compile: bool = False
    model_name: str | None = None  # the shipped config name, when one was given
    structured_output: str = "none"  # json: each request under one of SCHEMAS
    num_loras: int = 0  # requests spread round-robin over this many random LoRA adapters


# --structured-output json: schemas whose documents can run to any length, so outputs keep the
# workload's lengths as far as the model goes on
SCHEMAS = [
    {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
     "required": ["notes"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "score": {"type": "number"}}, "required": ["name", "score"]}},
    {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["title", "body"]},
]


def engine_runner(llm):
    ex = llm.engine.executor
    return ex.runner if hasattr(ex, "runner") else ex.worker.runner


def observe_steps(llm) -> common.StepLog:
    """Record the tokens of every step the engine hands to its executor: only plans that run a
    forward get there (`EngineCore.step` skips empty ones)."""
    log = common.StepLog()
    llm.engine.step_hooks.append(lambda plan: log.tokens.append(plan.total_num_scheduled_tokens))
    return log


def engine_params(max_tokens: int, schema: dict | None = None, temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, detokenize=False,
                          structured_outputs=StructuredOutputsParams(json=schema) if schema else None)


def run_engine(llm, wl: common.Workload, use_tqdm: bool = False,
               structured: bool = False, loras: list | None = None,
               temperature: float = 0.0) -> tuple[float, list[int]]:
    """Seconds to generate the whole workload, and the output length of each request (a
    structured request ends when its document is complete)."""
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [engine_params(o, SCHEMAS[i % len(SCHEMAS)] if structured else None, temperature)
              for i, o in enumerate(wl.output_lens)]
    t0 = time.perf_counter()
    lora = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora)
    elapsed = time.perf_counter() - t0  # generate returns host-side token ids: the device is done
    return elapsed, [len(o.outputs[0].token_ids) for o in outs]


def warmup_workload(wl: common.Workload, vocab_size: int, seed: int) -> common.Workload:
    """A few short requests with different tokens (so they leave no prefix-cache hits behind)."""
    n = min(len(wl.prompts), 8)
    lo, hi = min(wl.prompt_lens), max(wl.prompt_lens)
    return common.make_workload(n, (lo, hi), (1, min(16, max(wl.output_lens))), vocab_size,
                                seed + 10_007)


def metrics(elapsed: float, prompt_lens: list[int], output_lens: list[int], floor: dict,
            timings: dict) -> dict:
    p, o = sum(prompt_lens), sum(output_lens)
    return dict(elapsed_s=elapsed, num_requests=len(prompt_lens), prompt_tokens=p,
                output_tokens=o, requests_per_s=len(prompt_lens) / elapsed,
                output_tokens_per_s=o / elapsed, total_tokens_per_s=(p + o) / elapsed,
                startup=timings, floor=common.with_achieved(floor, elapsed, o))


def rankserve_throughput(llm, wl: common.Workload, warm: common.Workload,
                         stats: common.ModelStats, ceilings: dict, profile_dir: str | None = None,
                         profile_steps: tuple[int, int] | None = None,
                         structured: bool = False, loras: list | None = None) -> dict:
    runner = engine_runner(llm)
    log = observe_steps(llm)
    run_engine(llm, warm, structured=structured, loras=loras)  # compiles the schemas too
    log.clear()
    spec0 = common.spec_snapshot(llm)
    sch = llm.engine.scheduler
    pre0 = (sch.num_preemptions, sch.num_preemptions_swap)
    so = llm.engine.structured
    so_keys = ("fill_seconds", "accept_seconds", "wait_seconds", "rows_filled", "rows_reused")
    so0 = [getattr(so, k) for k in so_keys]
    elapsed, out_lens = run_engine(llm, wl, use_tqdm=True, structured=structured, loras=loras)
    spec = common.spec_summary(spec0, common.spec_snapshot(llm))
    swaps = sch.num_preemptions_swap - pre0[1]  # preemptions of the timed run, by kind
    preemptions = dict(swap=swaps, recompute=sch.num_preemptions - pre0[0] - swaps)
    if structured:  # host seconds of the masks over the timed run: fill, accept, and the loop's
        # wait; mask rows filled by xgrammar and reused from the step before (grammar_state.py)
        extra_so = dict(zip(("fill_s", "accept_s", "wait_s", "rows_filled", "rows_reused"),
                            (getattr(so, k) - a for k, a in zip(so_keys, so0))))
    n_dev = llm.config.parallel.world_size  # TP shards and PP stages in flight all read at once
    floor = common.physical_floor(stats, wl.prompt_lens, out_lens, log.tokens,
                                  runner.dtype.itemsize, ceilings, num_devices=n_dev,
                                  widths=(widths := common.byte_widths(runner)))
    timings = dict(llm.engine.timings)
    extra = {"structured_output": extra_so} if structured else {}
    if profile_dir:
        extra["profile"] = common.profile_steps(llm, lambda: run_engine(llm, wl, structured=structured),
                                                len(log.tokens),
                                                profile_dir, "throughput", window=profile_steps)
    return dict(metrics(elapsed, wl.prompt_lens, out_lens, floor, timings),
                dtype=str(runner.dtype).replace("torch.", ""), num_kv_blocks=llm.engine.num_blocks,
                num_devices=n_dev, bytes_per_weight=widths["linear"], kv_bytes=widths["kv"],
                preemptions=preemptions, **({"spec_decode": spec} if llm.config.spec else {}), **extra)


def hf_throughput(model_dir: str, device: torch.device, dtype: torch.dtype, wl, warm, stats,
                  ceilings: dict, compile_: bool) -> dict:
    from .hf_backend import HFBackend
    hf = HFBackend(model_dir, device, dtype, compile_)
    try:
        hf.run_batch(warm)
        elapsed, out_lens, steps, mode = hf.run_batch(wl, progress=True)
    finally:
        hf.close()
    floor = common.physical_floor(stats, wl.prompt_lens, out_lens, steps, dtype.itemsize, ceilings)
    return dict(metrics(elapsed, wl.prompt_lens, out_lens, floor, hf.timings),
                dtype=str(dtype).replace("torch.", ""), mode=mode)


def print_result(name: str, r: dict) -> None:
    print(f"[{name}] {r['num_requests']} requests in {r['elapsed_s']:.2f} s: "
          f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
          f"{r['total_tokens_per_s']:.1f} total tok/s" + (f"  ({r['mode']})" if "mode" in r else ""))
    print(common.format_timings(r["startup"]))
    if r.get("startup_account") is not None:
        print(f"  start-up: {common.format_account(r['startup_account'])} (ceiling measurement excluded)")
    print(common.format_floor(r["floor"]))
    if "spec_decode" in r:
        print(common.format_spec(r["spec_decode"]))
    if "structured_output" in r:
        g, n = r["structured_output"], max(r["floor"]["num_steps"], 1)
        print(f"  structured outputs, per step: fill {1e3 * g['fill_s'] / n:.2f} ms, accept "
              f"{1e3 * g['accept_s'] / n:.2f} ms (grammar thread), engine loop waited for masks "
              f"{1e3 * g['wait_s'] / n:.2f} ms; mask rows filled {g['rows_filled'] / n:.0f}, reused "
              f"{g['rows_reused'] / n:.0f} a step")
    if sum(r.get("preemptions", {}).values()):
        print("  preemptions: {swap} swapped to the host tier, {recompute} recomputed".format(**r["preemptions"]))


def run(cfg, args: ThroughputArgs, on_ranks, multi_process: bool) -> int:
    """Run each backend on the workload; print, and write JSON / plot on the driving rank."""
    from ...models.loader import load_hf_config  # the engine's reader (Kimi-K2 configs too)
    from ..startup_clock import mark
    mark("imports")  # process start → here: interpreter, imports, CLI
    hf_config = load_hf_config(cfg.model.model, cfg.compilation.cache_dir)
    common.check_context(cfg, hf_config, args.input_len[1], args.output_len[1])
    stats = common.model_stats(hf_config)
    wl = common.make_workload(args.num_prompts, args.input_len, args.output_len,
                              hf_config.vocab_size, args.seed)
    warm = warmup_workload(wl, hf_config.vocab_size, args.seed)

    def hf_bench(device, dtype, ceilings):
        return hf_throughput(cfg.model.model, device, dtype, wl, warm, stats, ceilings, args.hf_compile)

    loras = None
    if args.num_loras:
        if not cfg.lora.enable_lora:  # (fewer --max-loras than adapters: they take turns)
            raise ValueError("--num-loras needs --enable-lora (and --max-loras NUM_LORAS to run "
                             "them all at once)")
        from .lora import bench_adapters
        loras = bench_adapters(cfg, hf_config, args.num_loras)

    def engine_bench(llm, ceilings):
        return rankserve_throughput(llm, wl, warm, stats, ceilings, args.profile_dir, args.profile_steps,
                                    args.structured_output == "json", loras)

    rc, results, ceilings = common.drive(cfg, hf_config, args.backends, on_ranks, multi_process,
                                         engine_bench, hf_bench)
    if not results:  # a worker rank
        return rc
    for name, r in results.items():
        print_result(name, r)
    record = dict(kind="throughput", env=common.environment(), ceilings=ceilings,
                  model=common.model_record(cfg, args.model_name, stats),
                  parallel=common.parallel_record(cfg),
                  workload=dict(wl.summary(), seed=args.seed, input_len=list(args.input_len),
                                output_len=list(args.output_len), ignore_eos=True, greedy=True,
                                structured_output=args.structured_output,
                                num_loras=args.num_loras, lora_rank=cfg.lora.max_lora_rank
                                if args.num_loras else None),
                  results=results, **common.vllm_keys("throughput", results))
    common.save(record, args.output_json, args.plot, "output_tokens_per_s",
                f"offline throughput: {args.model_name or os.path.basename(cfg.model.model)}, "
                f"{wl.summary()['num_requests']} requests")
    return rc
