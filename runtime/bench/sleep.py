"""Sleep mode and the host KV tier, measured.

`rankserve bench sleep MODEL` (sleep mode is switched on): device memory before and after sleep
level 1 and level 2 (what the caching allocator holds, and what the whole device has in use), the
time to sleep and to wake up (weights, KV cache, CUDA graph capture), and that the greedy tokens
after waking equal those before (level 2: after reloading the same weights).

`rankserve bench multiturn MODEL --kv-offload-size GiB`: conversations that each start with a
long prefix of their own and come back for several turns (a turn = the whole conversation so far
+ a new user message); `--concurrency` of them run at a time, round-robin, so a conversation's
prefix has left a small device KV cache (`--num-gpu-blocks-override`) by the time it returns.
Prints TTFT (submission to first token; mean / p50 / p90), output and total tokens/s, and the
prefix-cache hits of each tier. Run it with and without `--kv-offload-size` to compare.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from . import common
from ..messages import EngineCoreRequest
from ..sampling_params import SamplingParams


def _gib(x: float) -> str:
    return f"{x / 2**30:7.2f}"


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@dataclass
class SleepArgs:
    num_prompts: int = 8
    input_len: int = 128
    output_len: int = 32
    output_json: str | None = None
    model_name: str | None = None


def run_sleep(cfg, args: SleepArgs, on_ranks) -> int:
    import dataclasses
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, enable_sleep_mode=True))
    record = {}

    def body(llm):
        vocab = llm.engine.vocab_size
        prompts = _prompts(vocab, args.num_prompts, args.input_len, cfg.model.seed)
        want = _greedy(llm, prompts, args.output_len)
        rows = []
        for level in (1, 2):
            t0 = time.perf_counter()
            s = llm.sleep(level)
            slept = time.perf_counter() - t0
            ranks = s["ranks"]
            t0 = time.perf_counter()
            w1 = llm.wake_up(["weights"])
            if level == 2:
                llm.engine.reload_weights()
            w2 = llm.wake_up(["kv_cache"])
            woke = time.perf_counter() - t0
            same = _greedy(llm, prompts, args.output_len) == want
            before = sum(r["device_bytes_before"] for r in ranks)
            after = sum(r["device_bytes_after"] for r in ranks)
            row = dict(level=level, reserved_before=before, reserved_asleep=after,
                       used_before=sum(r["device_used_before"] for r in ranks),
                       used_asleep=sum(r["device_used_after"] for r in ranks),
                       freed_fraction=(before - after) / before if before else None,
                       sleep_s=slept, wake_s=woke,
                       wake_phases=[{**a["seconds"], **b["seconds"]} for a, b in zip(w1["ranks"], w2["ranks"])],
                       same_tokens=same)
            rows.append(row)
        print(f"sleep mode, {cfg.model.model if not args.model_name else args.model_name}: "
              f"{len(ranks)} rank(s), GiB summed over ranks")
        print("level | reserved before | asleep | freed  | device used before | asleep | sleep s | wake s "
              "| same tokens")
        for r in rows:
            frac = "   -  " if r["freed_fraction"] is None else f"{100 * r['freed_fraction']:5.1f}%"
            print(f"  {r['level']}   |    {_gib(r['reserved_before'])}      | {_gib(r['reserved_asleep'])} | "
                  f"{frac} |      {_gib(r['used_before'])}       | {_gib(r['used_asleep'])} | "
                  f"{r['sleep_s']:7.2f} | {r['wake_s']:6.2f} | {r['same_tokens']}")
            print("        wake-up phases (rank 0, s): " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["wake_phases"][0].items()))
        record.update(kind="sleep", model=args.model_name or cfg.model.model, rows=rows,
                      parallel=common.parallel_record(cfg), env=common.environment())
        if args.output_json:
            common.write_json(args.output_json, record)
        if not all(r["same_tokens"] for r in rows):
            raise RuntimeError("the tokens after waking up differ from those before sleeping")

    return on_ranks(cfg, body)


@dataclass
class MultiTurnArgs:
    num_conversations: int = 32
    prefix_len: int = 2048
    turns: int = 4
    turn_len: int = 64
    output_len: int = 64
    concurrency: int = 4
    seed: int = 0
    output_json: str | None = None
    model_name: str | None = None


def run_multiturn(cfg, args: MultiTurnArgs, on_ranks) -> int:
    def body(llm):
        engine = llm.engine
        vocab = engine.vocab_size
        rng = random.Random(args.seed)
        history = _prompts(vocab, args.num_conversations, args.prefix_len, args.seed)
        tasks = [(c, t) for t in range(args.turns) for c in range(args.num_conversations)]
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        busy: set[int] = set()  # conversations with a request in flight
        live: dict[str, dict] = {}
        ttft, prompt_tokens, out_tokens = [], 0, 0
        stats0 = engine.scheduler.stats()
        t_start = time.perf_counter()
        while tasks or live:
            while len(live) < args.concurrency:  # the next task whose conversation is free
                i = next((i for i, (c, _) in enumerate(tasks) if c not in busy), None)
                if i is None:
                    break
                c, t = tasks.pop(i)
                history[c] = history[c] + [rng.randrange(vocab) for _ in range(args.turn_len)]
                rid = f"c{c}t{t}"
                engine.add_request(EngineCoreRequest(rid, list(history[c]), sp))
                live[rid] = dict(conv=c, start=time.perf_counter(), first=None, out=[])
                busy.add(c)
                prompt_tokens += len(history[c])
            for o in engine.step().outputs:
                st = live.get(o.request_id)
                if st is None:
                    continue
                if o.new_token_ids and st["first"] is None:
                    st["first"] = time.perf_counter()
                    ttft.append(st["first"] - st["start"])
                st["out"] += o.new_token_ids
                if o.finished:
                    history[st["conv"]] += st["out"]
                    out_tokens += len(st["out"])
                    busy.discard(st["conv"])
                    del live[o.request_id]
        elapsed = time.perf_counter() - t_start
        s = engine.scheduler.stats()
        q = sorted(ttft)
        res = dict(kind="multiturn", model=args.model_name or cfg.model.model,
                   kv_offload_gib=cfg.offload.kv_offload_size, device_blocks=engine.num_blocks,
                   host_blocks=engine.num_host_blocks, block_size=cfg.cache.block_size,
                   requests=len(ttft), elapsed_s=elapsed, ttft_mean_s=statistics.mean(q),
                   ttft_p50_s=q[len(q) // 2], ttft_p90_s=q[int(len(q) * 0.9)],
                   output_tokens_per_s=out_tokens / elapsed,
                   total_tokens_per_s=(prompt_tokens + out_tokens) / elapsed,
                   prompt_tokens=prompt_tokens,
                   device_hit_tokens=s.prefix_hits - stats0.prefix_hits,
                   host_hit_tokens=s.host_prefix_hits - stats0.host_prefix_hits,
                   host_blocks_stored=s.host_blocks_stored, host_blocks_loaded=s.host_blocks_loaded,
                   num_preemptions=s.num_preemptions, args=vars(args),
                   parallel=common.parallel_record(cfg), env=common.environment())
        print(f"multi-turn: {args.num_conversations} conversations × {args.turns} turns, prefix "
              f"{args.prefix_len}, +{args.turn_len} per turn, {args.output_len} out, {args.concurrency} "
              f"at a time; device KV {engine.num_blocks} blocks, host tier {engine.num_host_blocks} blocks "
              f"({cfg.offload.kv_offload_size:g} GiB)")
        print(f"  TTFT mean {res['ttft_mean_s'] * 1e3:.1f} ms, p50 {res['ttft_p50_s'] * 1e3:.1f} ms, "
              f"p90 {res['ttft_p90_s'] * 1e3:.1f} ms; {res['output_tokens_per_s']:.1f} output tok/s, "
              f"{res['total_tokens_per_s']:.1f} total tok/s over {elapsed:.1f} s")
        print(f"  prompt tokens {prompt_tokens}: {res['device_hit_tokens']} from the device tier, "
              f"{res['host_hit_tokens']} from the host tier "
              f"({100 * (res['device_hit_tokens'] + res['host_hit_tokens']) / prompt_tokens:.1f}% not "
              f"recomputed); {res['host_blocks_stored']} blocks stored, {res['host_blocks_loaded']} loaded; "
              f"{res['num_preemptions']} preemptions")
        if args.output_json:
            common.write_json(args.output_json, res)

    return on_ranks(cfg, body)
