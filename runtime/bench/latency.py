"""Latency of one batch: `rankserve bench latency MODEL --batch-size B --input-len L --output-len O`.

Per iteration, with fresh random prompts each time (a repeated prompt would hit the prefix
cache): end-to-end latency of B requests of L prompt tokens generating O tokens each, and TTFT,
measured as the same batch with one output token (prefill alone). Reports medians over
`--num-iters` after `--num-iters-warmup`, decode tokens/s = B × O / median latency, and the
physical floor (`common.py`) of both. `--backend hf` does the same with transformers' static-cache
`generate`.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import common
from .throughput import engine_runner, observe_steps, run_engine


@dataclass
class LatencyArgs:
    batch_size: int
    input_len: int
    output_len: int
    num_iters: int
    num_iters_warmup: int
    seed: int
    backends: tuple[str, ...]
    output_json: str | None = None
    plot: str | None = None
    profile_dir: str | None = None
    profile_steps: tuple[int, int] | None = None  # (first step, count) of the profiled window
    hf_compile: bool = False
    model_name: str | None = None
    prompt_kind: str = "random"  # "repeat": prompts tile a 16-token segment (n-gram speculation)
    temperature: float = 0.0  # 0: greedy (rankserve only: the hf backend is greedy)


def _batches(args: LatencyArgs, vocab_size: int, output_len: int, salt: int):
    """Fresh prompts per iteration (warm-up ones included)."""
    for i in range(args.num_iters_warmup + args.num_iters):
        yield i < args.num_iters_warmup, common.make_workload(
            args.batch_size, (args.input_len,) * 2, (output_len,) * 2, vocab_size,
            args.seed + 7919 * (i + 1) + salt, 16 if args.prompt_kind == "repeat" else 0)


def summarize(args: LatencyArgs, e2e: list[float], ttft: list[float], floor_e2e: dict,
              floor_ttft: dict, timings: dict) -> dict:
    lat, first = statistics.median(e2e), statistics.median(ttft)
    out = args.batch_size * args.output_len
    return dict(batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len,
                num_iters=args.num_iters, latency_s=lat, latencies_s=e2e, ttft_s=first,
                ttfts_s=ttft, decode_tokens_per_s=out / lat, startup=timings,
                floor=common.with_achieved(floor_e2e, lat, out),
                ttft_floor=common.with_achieved(floor_ttft, first, args.batch_size))


def _floor(stats, args, output_len, steps, dtype_bytes, ceilings, n_dev=1, widths=None):
    return common.physical_floor(stats, [args.input_len] * args.batch_size,
                                 [output_len] * args.batch_size, steps, dtype_bytes, ceilings, n_dev,
                                 widths)


def rankserve_latency(llm, args: LatencyArgs, stats, ceilings) -> dict:
    runner = engine_runner(llm)
    vocab = runner.vocab_size
    log = observe_steps(llm)
    results = {}
    spec0 = common.spec_snapshot(llm)
    for name, olen, salt in (("e2e", args.output_len, 0), ("ttft", 1, 1)):
        times = []
        for warm, wl in tqdm(list(_batches(args, vocab, olen, salt)), desc=f"latency ({name})"):
            log.clear()
            elapsed, out_lens = run_engine(llm, wl, temperature=args.temperature)
            if out_lens != wl.output_lens:
                raise RuntimeError(f"the engine generated {out_lens}, not {wl.output_lens}")
            if not warm:
                times.append(elapsed)
        results[name] = (times, list(log.tokens))  # every iteration runs the same steps
        if name == "e2e":
            spec = common.spec_summary(spec0, common.spec_snapshot(llm))
    n_dev = llm.config.parallel.world_size  # TP shards and PP stages in flight all read at once
    widths = common.byte_widths(runner)
    f = {k: _floor(stats, args, olen, results[k][1], runner.dtype.itemsize, ceilings, n_dev, widths)
         for k, olen in (("e2e", args.output_len), ("ttft", 1))}
    extra = {}
    if args.profile_dir:
        wl = next(b for _, b in _batches(args, vocab, args.output_len, 0))
        extra["profile"] = common.profile_steps(llm, lambda: run_engine(llm, wl, temperature=args.temperature),
                                                len(results["e2e"][1]), args.profile_dir, "latency",
                                                window=args.profile_steps)
    return dict(summarize(args, results["e2e"][0], results["ttft"][0], f["e2e"], f["ttft"],
                          dict(llm.engine.timings)),
                **({"spec_decode": spec} if llm.config.spec else {}), num_steps=len(results["e2e"][1]),
                dtype=str(runner.dtype).replace("torch.", ""), num_devices=n_dev,
                bytes_per_weight=widths["linear"], kv_bytes=widths["kv"], **extra)


def hf_latency(model_dir: str, device, dtype, args: LatencyArgs, vocab: int, stats, ceilings) -> dict:
    from .hf_backend import HFBackend
    hf = HFBackend(model_dir, device, dtype, args.hf_compile)
    results = {}
    try:
        for name, olen, salt in (("e2e", args.output_len, 0), ("ttft", 1, 1)):
            times = []
            for warm, wl in tqdm(list(_batches(args, vocab, olen, salt)), desc=f"hf latency ({name})"):
                elapsed, steps = hf.generate_static(torch.tensor(wl.prompts), olen)
                if not warm:
                    times.append(elapsed)
            results[name] = (times, steps)
    finally:
        hf.close()
    f = {k: _floor(stats, args, olen, results[k][1], dtype.itemsize, ceilings)
         for k, olen in (("e2e", args.output_len), ("ttft", 1))}
    return dict(summarize(args, results["e2e"][0], results["ttft"][0], f["e2e"], f["ttft"], hf.timings),
                dtype=str(dtype).replace("torch.", ""),
                mode="generate(cache_implementation='static')" + (" + torch.compile" if args.hf_compile else ""))


def print_result(name: str, r: dict) -> None:
    print(f"[{name}] batch {r['batch_size']}, {r['input_len']} in / {r['output_len']} out: "
          f"latency {r['latency_s'] * 1e3:.1f} ms, TTFT {r['ttft_s'] * 1e3:.1f} ms, "
          f"decode {r['decode_tokens_per_s']:.1f} tok/s (median of {r['num_iters']})"
          + (f"  ({r['mode']})" if "mode" in r else ""))
    print(common.format_timings(r["startup"]))
    a = r.get("startup_account")
    if a is not None:  # cold start (empty --cache-dir) or warm (cached)
        print(f"  start to first token: {a['ready_after_s'] + r['ttft_s']:.1f} s = "
              f"{common.format_account(a)} + TTFT {r['ttft_s']:.2f} s (ceiling measurement excluded)")
    print(common.format_floor(r["floor"]))
    if "spec_decode" in r:
        print(common.format_spec(r["spec_decode"]))
    t = r["ttft_floor"]
    print(f"  TTFT floor: {t['floor_s'] * 1e3:.3f} ms ({t['bound']}-bound); achieved "
          f"{100 * t['achieved_fraction']:.1f}%")


def run(cfg, args: LatencyArgs, on_ranks, multi_process: bool) -> int:
    from ...models.loader import load_hf_config  # the engine's reader (Kimi-K2 configs too)
    from ..startup_clock import mark
    mark("imports")  # process start → here: interpreter, imports, CLI
    hf_config = load_hf_config(cfg.model.model, cfg.compilation.cache_dir)
    common.check_context(cfg, hf_config, args.input_len, args.output_len)
    if "rankserve" in args.backends and args.batch_size > cfg.scheduler.max_num_seqs:
        # the batch would run in waves: its latency and TTFT would not be one batch's
        raise ValueError(f"--batch-size {args.batch_size} is more than --max-num-seqs "
                         f"{cfg.scheduler.max_num_seqs}: raise --max-num-seqs to run it as one batch")
    stats = common.model_stats(hf_config)

    def hf_bench(device, dtype, ceilings):
        return hf_latency(cfg.model.model, device, dtype, args, hf_config.vocab_size, stats, ceilings)

    def engine_bench(llm, ceilings):
        return rankserve_latency(llm, args, stats, ceilings)

    rc, results, ceilings = common.drive(cfg, hf_config, args.backends, on_ranks, multi_process,
                                         engine_bench, hf_bench)
    if not results:
        return rc
    for name, r in results.items():
        print_result(name, r)
    record = dict(kind="latency", env=common.environment(), ceilings=ceilings,
                  model=common.model_record(cfg, args.model_name, stats),
                  parallel=common.parallel_record(cfg),
                  workload=dict(batch_size=args.batch_size, input_len=args.input_len,
                                output_len=args.output_len, num_iters=args.num_iters,
                                num_iters_warmup=args.num_iters_warmup, seed=args.seed,
                                prompt_kind=args.prompt_kind, speculative_config=cfg.spec and
                                dataclasses.asdict(cfg.spec),
                                ignore_eos=True, greedy=args.temperature == 0,
                                temperature=args.temperature),
                  results=results, **common.vllm_keys("latency", results))
    common.save(record, args.output_json, args.plot, "decode_tokens_per_s",
                f"latency: {args.model_name or os.path.basename(cfg.model.model)}, batch {args.batch_size}, "
                f"{args.input_len} in / {args.output_len} out")
    return rc
