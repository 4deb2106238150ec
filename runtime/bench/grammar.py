"""The host cost of structured outputs per engine step, on CPU, with a fake device.

    python -m rankserve.runtime.bench.grammar --tokenizer ../shared/tokenizers/qwen3 \
        [--num-seqs 256] [--forward-ms 20] [--steps 60] [--mode json|none|both] [--output-json F]

The real EngineCore, Scheduler and StructuredOutputManager run a W1-like batch (every request
under one of `bench throughput`'s JSON schemas, always `--num-seqs` running: finished requests
are replaced from a queue) against a fake executor whose "device" is one worker thread: a
forward sleeps `--forward-ms` (as a GPU forward, it holds no GIL) and sampling picks a token the
bitmask allows. The executor drives the grammar hooks as `ModelRunner.execute` does (runtime/
model_runner.py): the forward is launched, then the plan's masks are requested, and the
sampling that needs them is queued when they are ready. Per step it reports the wall time and
its excess over the forward, the time filling masks (`fill`), accepting sampled tokens
(`accept`), copying the rows to the device buffer (`copy`), how long the engine thread waited
for masks (`wait`), and how much of the fill ran while a forward did (`overlap`). `--mode both`
runs an unconstrained batch too: the difference is the cost of structured outputs.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import threading
import time

import numpy as np
import torch

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..messages import EngineCoreRequest
from ..model_runner import ModelRunnerOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .common import resolve_model
from .throughput import SCHEMAS

VOCAB = 151936  # Qwen3's logits width
PREFERRED = 64  # of 100 draws: a token that keeps a JSON string going, where allowed


class _Device:
    """One worker thread runs the 'kernels' in order; intervals of the forwards are kept."""

    def __init__(self, forward_s: float):
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fake-device")
        self.forward_s = forward_s
        self.forwards: list[tuple[float, float]] = []
        self.samples: list[float] = []  # seconds of each 'sampling kernel'
        self.idle: list[float] = []  # device idle before each forward (after the last kernel)
        self.last_end = 0.0

    def forward(self) -> concurrent.futures.Future:
        def run():
            t0 = time.perf_counter()
            self.idle.append(t0 - self.last_end)
            time.sleep(self.forward_s)
            self.last_end = time.perf_counter()
            self.forwards.append((t0, self.last_end))
        return self.pool.submit(run)

    def busy_within(self, a: float, b: float) -> float:
        """Seconds of [a, b] during which a forward ran."""
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.forwards)


class _Pending:
    """`ModelRunnerOutput._pending`'s (host copy, event) pair, backed by a device future."""

    def __init__(self, fut):
        self.fut = fut

    def synchronize(self):
        self.fut.result()

    def tolist(self):
        return self.fut.result()


class FakeExecutor:
    """What EngineCore needs of an executor; `submit` follows ModelRunner.execute's order."""
    max_in_flight = 1
    timings: dict = {}
    device = None

    def __init__(self, forward_s: float, preferred: list[int], stop: set[int], seed: int = 0,
                 inline: bool = False):
        self.inline = inline  # fill the masks on the engine thread right after the launch
        self.dev = _Device(forward_s)
        self.max_model_len, self.vocab_size = 4096, VOCAB
        self.preferred = np.array(preferred, dtype=np.int64)
        self.stop = stop
        self.rng = np.random.default_rng(seed)
        self._deferred: tuple | None = None
        # the runner's two "pinned" buffers the fill writes into (SamplingMetadataBuilder)
        self.bufs = [torch.empty((512, (VOCAB + 31) // 32), dtype=torch.int32) for _ in range(2)]
        self.buf_step = 0
        self.copy_s: list[float] = []
        self.wait_s: list[float] = []
        # per step, from the previous sampling's end on the device: when the engine thread asked
        # for the masks (its own work done) and when it had them (the fill done)
        self.sampled_at = 0.0
        self.engine_ready: list[float] = []
        self.masks_ready: list[float] = []

    def determine_num_blocks(self):
        return 1 << 15

    def initialize(self, num_blocks):
        pass

    def shutdown(self):
        self.dev.pool.shutdown()

    def collect(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        return out.resolve()

    def submit(self, plan) -> ModelRunnerOutput:
        self.finish_sampling()
        sample_ids = list(plan.num_scheduled_tokens)  # short prompts: every request samples
        self.dev.forward()
        out = ModelRunnerOutput(sample_ids, [])
        if plan.grammar_req_ids and not self.inline:
            self.buf_step ^= 1
            plan.fill_async(self.bufs[self.buf_step][:len(plan.grammar_req_ids)])
            out._sample = lambda: self.sample(plan, None, out)
            self._deferred = out
        else:
            self.sample(plan, None, out)
        return out

    def finish_sampling(self):
        out, self._deferred = self._deferred, None
        if out is not None:
            out.finish()

    def sample(self, plan, _hidden, out: ModelRunnerOutput):
        rows = None
        if plan.grammar_req_ids:
            t0 = time.perf_counter()
            bits = plan.bitmask()
            t1 = time.perf_counter()
            self.engine_ready.append(t0 - self.sampled_at)
            self.masks_ready.append(t1 - self.sampled_at)
            buf = self.bufs[self.buf_step].numpy()
            if buf.ctypes.data != bits.ctypes.data:  # not filled in place: copy (as the runner)
                self.buf_step ^= 1
                buf = self.bufs[self.buf_step].numpy()
                np.copyto(buf[:len(bits)], bits)
            rows = buf[:len(bits)]
            self.wait_s.append(t1 - t0)
            self.copy_s.append(time.perf_counter() - t1)
            pos = {r: i for i, r in enumerate(plan.grammar_req_ids)}
            rows = (rows, [pos.get(r) for r in out.req_ids])  # (the next fill into it: 2 steps on)
        n = len(out.req_ids)
        done = _Pending(self.dev.pool.submit(self._timed_pick, n, rows))
        out._pending = (done, done)  # (host copy, event)

    def _timed_pick(self, n: int, masked) -> list[int]:
        t0 = time.perf_counter()
        self.dev.idle.append(t0 - self.dev.last_end)
        try:
            return self._pick(n, masked)
        finally:
            self.dev.last_end = time.perf_counter()
            self.dev.samples.append(self.dev.last_end - t0)

    def _pick(self, n: int, masked) -> list[int]:
        """The 'sampling kernel' (vectorized, so that it costs the host little, as on a GPU):
        mostly a token that continues a JSON string where the mask allows it, else an allowed
        token from a random point of the vocabulary on (a stop token only when nothing else is)."""
        toks = self.rng.integers(1000, 100000, n)
        if masked is None:
            self.sampled_at = time.perf_counter()
            return toks.tolist()
        bits, where = masked
        idx = np.array([-1 if r is None else r for r in where])
        sel = np.flatnonzero(idx >= 0)
        b = bits[idx[sel]].view(np.uint32)
        pref = self.preferred[self.rng.integers(0, len(self.preferred), len(sel))]
        ok = (b[np.arange(len(sel)), pref >> 5] >> (pref & 31).astype(np.uint32)) & 1
        use = (ok == 1) & (self.rng.integers(0, 100, len(sel)) < PREFERRED)
        free = b.copy()
        for t in self.stop:  # stop tokens only where nothing else is allowed
            free[:, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        free = np.where(free.any(axis=1, keepdims=True), free, b)
        s = int(self.rng.integers(0, b.shape[1]))
        rolled = np.concatenate([free[:, s:], free[:, :s]], axis=1)
        w = (np.argmax(rolled != 0, axis=1) + s) % b.shape[1]
        word = free[np.arange(len(sel)), w]
        low = np.log2((word & (~word + np.uint32(1))).astype(np.float64)).astype(np.int64)
        toks[sel] = np.where(use, pref, 32 * w + low)
        self.sampled_at = time.perf_counter()
        return toks.tolist()


def _timed(obj, name: str, log: list):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log.append((t0, time.perf_counter(), threading.current_thread().name))
    setattr(obj, name, wrapper)


def sampling_tokens(tok) -> tuple[list[int], set[int]]:
    """The fake sampler's favourite tokens (text that continues a string) and stop tokens."""
    preferred = sorted({t for w in ("a", " the", "hello", " data", "x", " value", "ing", " of")
                        for t in tok.encode(w)})
    return preferred, {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}


def run(tokenizer: str, num_seqs: int, forward_ms: float, steps: int, structured: bool,
        warmup: int = 10, inline: bool = False) -> dict:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    model_dir, _ = resolve_model("qwen3-0.6b")
    cfg = EngineConfig.from_kwargs(model=model_dir, tokenizer=tokenizer, async_scheduling=True,
                                   max_num_seqs=num_seqs, max_num_batched_tokens=1 << 16,
                                   enable_prefix_caching=False)
    preferred, stop = sampling_tokens(tok)
    ex = FakeExecutor(forward_ms / 1e3, preferred, stop, inline=inline)
    engine = EngineCore(cfg, ex)
    so = engine.structured
    fills, accepts = [], []
    _timed(so, "fill_bitmask", fills)
    _timed(so, "accept", accepts)
    rng = np.random.default_rng(1)
    made = 0

    def add(k):
        nonlocal made
        for _ in range(k):
            schema = SCHEMAS[made % len(SCHEMAS)]
            sp = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True, detokenize=False,
                                structured_outputs=StructuredOutputsParams(json=schema) if structured else None)
            engine.add_request(EngineCoreRequest(f"r{made}", rng.integers(1000, 100000, 32).tolist(), sp,
                                                 eos_token_id=tok.eos_token_id))
            made += 1
    add(num_seqs)
    step_times, running, reuse = [], [], []
    last = None
    done = 0
    while len(step_times) < steps + warmup:
        out = engine.step()
        finished = sum(o.finish_reason is not None for o in out.outputs)
        if finished:
            add(finished)
            done += finished
        if out.outputs:
            now = time.perf_counter()
            if last is not None:
                step_times.append(now - last)
                running.append(len(engine.scheduler.running))
                reuse.append((so.rows_filled, so.rows_reused))
            last = now
    ex.shutdown()
    so.shutdown()
    # per-step figures over the measured steps (after warm-up: compilation, the first prefill)
    step_times = step_times[warmup:]
    t_from = time.perf_counter() - sum(step_times)
    fills = [f for f in fills if f[0] >= t_from]
    accepts = [a for a in accepts if a[0] >= t_from]
    fill_s = [e - s for s, e, _ in fills]
    overlap = sum(ex.dev.busy_within(s, e) for s, e, _ in fills) / max(sum(fill_s), 1e-9)
    med = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
    sample_ms = med(ex.dev.samples[-len(step_times):])
    idle_ms = 1e3 * statistics.mean(ex.dev.idle[-2 * len(step_times):]) * 2  # per step (2 kernels)
    return dict(structured=structured, num_seqs=num_seqs, forward_ms=forward_ms, steps=len(step_times),
                step_ms=med(step_times), sample_ms=sample_ms, device_idle_ms=idle_ms,
                excess_ms=med(step_times) - forward_ms - sample_ms,
                mean_step_ms=1e3 * statistics.mean(step_times),
                fill_ms=med(fill_s), accept_ms=med([e - s for s, e, _ in accepts]),
                copy_ms=med(ex.copy_s[-len(step_times):]), wait_ms=med(ex.wait_s[-len(step_times):]),
                engine_ready_ms=med(ex.engine_ready[-len(step_times):]),
                masks_ready_ms=med(ex.masks_ready[-len(step_times):]),
                fill_overlap=overlap, fill_threads=sorted({t for *_, t in fills}),
                mean_running=statistics.mean(running[warmup:]), finished=done,
                rows_filled=(reuse[-1][0] - reuse[warmup][0]) / len(step_times),
                rows_reused=(reuse[-1][1] - reuse[warmup][1]) / len(step_times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mode", choices=("json", "none", "both"), default="both")
    p.add_argument("--inline", action="store_true", help="fill the masks on the engine thread at "
                   "sampling time (no overlap with the engine's own work), for comparison")
    p.add_argument("--rows", action="store_true", help="instead: time each row's fill on its own, "
                   "by matcher state (bench/grammar_rows.py)")
    p.add_argument("--output-json")
    a = p.parse_args(argv)
    results = []
    if a.rows:
        from transformers import AutoTokenizer
        from .grammar_rows import profile, report
        r = profile(a.tokenizer, a.num_seqs, a.steps, *sampling_tokens(AutoTokenizer.from_pretrained(a.tokenizer)),
                    VOCAB)
        print(report(r))
        results.append(r)
    for structured in [] if a.rows else {"json": [True], "none": [False], "both": [False, True]}[a.mode]:
        r = run(a.tokenizer, a.num_seqs, a.forward_ms, a.steps, structured, inline=a.inline)
        results.append(r)
        print(f"[{'json' if structured else 'none'}] {r['steps']} steps of {r['num_seqs']} requests, "
              f"forward {r['forward_ms']:.1f} ms: step {r['step_ms']:.2f} ms median "
              f"(+{r['excess_ms']:.2f} ms over the device's forward + {r['sample_ms']:.2f} ms sampling; "
              f"mean {r['mean_step_ms']:.2f} ms; device idle {r['device_idle_ms']:.2f} ms a step)")
        if structured:
            print(f"  fill {r['fill_ms']:.2f} ms ({100 * r['fill_overlap']:.0f}% under a forward, "
                  f"threads {', '.join(r['fill_threads'])}), accept {r['accept_ms']:.2f} ms, "
                  f"copy {r['copy_ms']:.2f} ms, engine waited for masks {r['wait_ms']:.2f} ms; rows a step: "
                  f"{r['rows_filled']:.0f} filled, {r['rows_reused']:.0f} reused")
            print(f"  after a sampling ends: the engine asks for the next masks at {r['engine_ready_ms']:.2f} ms, "
                  f"has them at {r['masks_ready_ms']:.2f} ms")
    if len(results) == 2:
        base, so = results
        print(f"structured outputs cost {so['mean_step_ms'] / base['mean_step_ms'] - 1:+.1%} per step (mean)")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
