"""Summarise a RANKSERVE_STEP_LOG file (one CSV line per engine step of a server:
time, gap_s, prompt_tokens, generated_tokens, running, waiting, then the host seconds of the turn
that sent the outputs: drain (taking the API's messages), schedule, submit (inputs + launch),
collect (waiting for the step's results), update, send): the distribution of the gaps
between consecutive steps' outputs (what a stream sees as its inter-token latency, before the API
process and the network add theirs), and the gaps by how many prompt tokens the step prefilled, so
that an ITL tail can be told apart: long mixed prefill steps, or stalls with no prefill at all
(host pauses). `python -m rankserve.runtime.bench.steplog LOG` (gpu_session.sh stage servew1)."""
from __future__ import annotations

import sys

BUCKETS = (0, 1, 512, 2048, 4096, 8192)


PHASES = ("drain", "schedule", "submit", "collect", "update", "send")


def load(path: str) -> list[tuple]:
    """The rows of the log; lines that are not one (blank, cut off by a server killed mid-write)
    are skipped and counted in `load.skipped`. Rows of older servers have no phase columns: the
    server appends, so one file may mix both."""
    rows, load.skipped = [], 0
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            try:
                if len(fields) not in (6, 6 + len(PHASES)):
                    raise ValueError(line)
                t, gap, p, g, r, w, *phases = fields
                rows.append((float(t), float(gap), int(p), int(g), int(r), int(w), *map(float, phases)))
            except ValueError:
                load.skipped += 1
    return rows


def phase_line(label: str, rows) -> str:
    rows = [r for r in rows if len(r) == 6 + len(PHASES)]  # (older rows have no phases)
    if not rows:
        return ""
    return f"{label:>26}: " + "  ".join(
        f"{name} {pct([r[6 + i] * 1e3 for r in rows], 50):.2f}" for i, name in enumerate(PHASES)) + " (ms, median)"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


def summarise(rows) -> str:
    # decode steps only: gaps that a running stream waits through (the first step of a burst
    # and idle periods have no stream waiting)
    steps = [r for r in rows[1:] if r[3] > 0 and r[1] < 5.0]
    if not steps:
        return "no decode steps in the log"
    gaps = [r[1] * 1e3 for r in steps]
    lines = [f"{len(steps)} steps with outputs: gap ms p50 {pct(gaps, 50):.2f}  p90 {pct(gaps, 90):.2f}  "
             f"p99 {pct(gaps, 99):.2f}  max {max(gaps):.2f}; 3 x p50 = {3 * pct(gaps, 50):.2f}",
             f"{'prompt tokens in the step':>26} {'steps':>6} {'gap p50':>8} {'p99':>8} {'tokens out':>10}"]
    for lo, hi in zip(BUCKETS, BUCKETS[1:] + (1 << 30,)):
        sel = [r for r in steps if lo <= r[2] < hi]
        if sel:
            g = [r[1] * 1e3 for r in sel]
            lines.append(f"{f'[{lo}, {hi})':>26} {len(sel):>6} {pct(g, 50):>8.2f} {pct(g, 99):>8.2f} "
                         f"{sum(r[3] for r in sel):>10}")
    # every output token weighs its step's gap: the ITL distribution the streams see
    weighted = sorted((r[1] * 1e3, r[3]) for r in steps)
    total, acc, p99 = sum(w for _, w in weighted), 0, float("nan")
    for g, w in weighted:
        acc += w
        if acc >= 0.99 * total:
            p99 = g
            break
    slow = [r for r in steps if r[1] * 1e3 >= p99]
    lines.append(f"per output token: gap p99 {p99:.2f} ms; steps at or above it: {len(slow)}, "
                 f"{sum(1 for r in slow if r[2] == 0)} with no prompt tokens, median prompt tokens "
                 f"{pct([r[2] for r in slow], 50):.0f}, median running {pct([r[4] for r in slow], 50):.0f}")
    lines += [x for x in (phase_line("host, decode-only steps", [r for r in steps if r[2] == 0]),
                          phase_line("host, steps with prompts", [r for r in steps if r[2] > 0])) if x]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rankserve.runtime.bench.steplog FILE (a RANKSERVE_STEP_LOG file)")
    try:
        rows = load(sys.argv[1])
    except OSError as e:
        sys.exit(f"steplog: cannot read {sys.argv[1]}: {e.strerror or e}")
    if load.skipped:
        print(f"skipped {load.skipped} line(s) that are not step rows", file=sys.stderr)
    print(summarise(rows))


if __name__ == "__main__":
    main()
