"""Where the seconds before the engine went: process start → imports → tokenizer → engine.

The engine's own phases (load, memory profile, warm-up, graphs) are timed by the model runner;
this module accounts for the time before them, which `perf_counter` inside the engine cannot see,
from the process's start time in /proc. `mark(phase)` books the seconds since the previous mark
(or since the process started) under `phase`, so the phases add up to the process age."""
from __future__ import annotations

import os

_phases: dict[str, float] = {}
_last = 0.0


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(phase: str) -> None:
    """Book the time since the previous mark under `phase`. A phase is booked once: a second
    engine in the process (tests, a draft model's runner) must not book its predecessor's time."""
    global _last
    age = process_age()
    if age is None or phase in _phases:
        return
    _phases[phase] = max(age - _last, 0.0)
    _last = age


def pre_engine_phases() -> dict[str, float]:
    return dict(_phases)


def account(engine_phases: dict[str, float]) -> dict | None:
    """The start-up as a user sees it, once the engine is ready: the phases before the engine,
    the engine's own, `other` (what neither timed: config reads, executor set-up), and their sum
    `ready_after_s` (the process age). None where the process age is unknown."""
    age = process_age()
    if age is None:
        return None
    pre = pre_engine_phases()
    other = max(age - sum(pre.values()) - sum(engine_phases.values()), 0.0)
    return dict(pre_engine=pre, engine=dict(engine_phases), other_s=other, ready_after_s=age)


def format_account(a: dict) -> str:
    def phases(d):
        return ", ".join(f"{k} {v:.2f} s" for k, v in d.items()) or "-"
    return (f"before the engine {sum(a['pre_engine'].values()):.2f} s ({phases(a['pre_engine'])}) + "
            f"engine {sum(a['engine'].values()):.2f} s ({phases(a['engine'])}) + other "
            f"{a['other_s']:.2f} s = ready {a['ready_after_s']:.2f} s after the process started")
