"""Where a structured-output mask fill's time goes, row by row (`bench.grammar --rows`).

Matchers for `bench throughput`'s JSON schemas walk as the fake device of `bench.grammar`
samples (mostly tokens that continue a string); each step every row is filled on its own and
timed, and classed by its state: at the start of a JSON string's body (the rows
`StructuredOutputManager` reuses, runtime/grammar_state.py) or elsewhere. Also counted: how
often a row's mask equals the one of its previous step, and how many of those the reuse finds.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..grammar_state import at_string_start
from ..sampling_params import StructuredOutputsParams
from ..structured_output import StructuredOutputManager


def profile(tokenizer: str, num_seqs: int, steps: int, preferred: list[int], stop: set[int],
            vocab: int) -> dict:
    from .grammar import FakeExecutor
    from .throughput import SCHEMAS
    so = StructuredOutputManager(tokenizer, tokenizer, vocab)
    pick = FakeExecutor(0, preferred, stop)._pick

    def new(i):
        g = so.submit(StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
        g.future.result()
        so.init_matcher(g, None)
        return g
    gs = [new(i) for i in range(num_seqs)]
    buf = torch.zeros((num_seqs, (vocab + 31) // 32), dtype=torch.int32)
    prev: list[np.ndarray | None] = [None] * num_seqs
    cost: dict[str, list[float]] = {"string": [], "other": []}
    same = found = rows = 0
    for _ in range(steps):
        for i, g in enumerate(gs):
            if g.matcher.is_terminated():
                g = gs[i] = new(i)
                prev[i] = None
            t0 = time.perf_counter()
            g.matcher.fill_next_token_bitmask(buf, i)
            dt = time.perf_counter() - t0
            known = g.row is not None  # what the manager would have reused
            in_string = known or at_string_start(g.matcher, g.string_rules, g.num_bytes)
            cost["string" if in_string else "other"].append(dt)
            row = buf[i].numpy()
            rows += 1
            if prev[i] is not None and np.array_equal(prev[i], row):
                same += 1
                found += known
            if known:
                assert np.array_equal(g.row, row), "a reused row differs from a fresh fill"
            elif in_string:
                g.row = row.copy()
            prev[i] = row.copy()
        toks = pick(num_seqs, (buf.numpy(), list(range(num_seqs))))
        so.accept(list(zip(gs, toks)))
    so.shutdown()
    us = lambda xs: 1e6 * statistics.median(xs) if xs else 0.0  # noqa: E731
    total = sum(map(sum, cost.values()))
    return dict(rows=rows, same_as_previous=same / rows, reused=found / rows,
                string_rows=len(cost["string"]) / rows,
                string_us=us(cost["string"]), other_us=us(cost["other"]),
                string_time_share=sum(cost["string"]) / total,
                p90_us=1e6 * float(np.percentile(cost["string"] + cost["other"], 90)),
                max_us=1e6 * max(cost["string"] + cost["other"]))


def report(r: dict) -> str:
    return (f"[rows] {r['rows']} row fills, one at a time: {100 * r['string_rows']:.0f}% at the start "
            f"of a JSON string (median {r['string_us']:.1f} us, {100 * r['string_time_share']:.0f}% of "
            f"the fill time), others median {r['other_us']:.1f} us; p90 {r['p90_us']:.1f} us, max "
            f"{r['max_us']:.1f} us\n  a row's mask equals its previous step's: {100 * r['same_as_previous']:.0f}% "
            f"of rows; reused (known unchanged, no fill): {100 * r['reused']:.0f}%")
