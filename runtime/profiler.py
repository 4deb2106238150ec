"""Profiling a live engine: `--profiler-config` (vLLM's flag and keys), then POST /start_profile
and /stop_profile (or LLM.start_profile / stop_profile, `bench serve --profile`).

Every rank of every replica profiles itself between the two calls: the toggle travels to the
ranks with the step plans (runtime/executor.py), so it lands between the same two steps on each,
with steps still in flight. The
"torch" profiler writes one Chrome / Perfetto trace per rank, named by rank, and (by default) a
table of the busiest ops beside it; "cuda" brackets the window with cudaProfilerStart / Stop for
`nsys profile --capture-range=cudaProfilerApi`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("rankserve.profiler")

FLAG = "--profiler-config"
KINDS = ("torch", "cuda")


@dataclass(frozen=True)
class ProfilerParams:
    profiler: str
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False


_BOOLS = tuple(k for k, v in ProfilerParams.__dataclass_fields__.items() if v.type == "bool")


def parse_profiler_config(value) -> ProfilerParams | None:
    """A JSON object (string) or dict with vLLM's keys → ProfilerParams (None: profiling off);
    unknown keys and bad values are refused by name."""
    from .config import ConfigError, json_object_flag
    value = json_object_flag(value, FLAG)
    if not value:  # (also '{}')
        return None
    keys = tuple(ProfilerParams.__dataclass_fields__)
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{FLAG}: unsupported key(s) {', '.join(unknown)} (supported: {', '.join(keys)})")
    kind = value.get("profiler")
    if kind is None:
        raise ConfigError(f'{FLAG}: say which profiler: "profiler": "torch" or "cuda"')
    if kind not in KINDS:
        raise ConfigError(f"{FLAG}: profiler must be one of {', '.join(KINDS)}, got {kind!r}")
    for k in _BOOLS:
        if k in value and not isinstance(value[k], bool):
            raise ConfigError(f"{FLAG}: {k} must be true or false, got {value[k]!r}")
    d = value.get("torch_profiler_dir", "")
    if not isinstance(d, str):
        raise ConfigError(f"{FLAG}: torch_profiler_dir must be a path, got {d!r}")
    if kind == "torch":
        if not d:
            raise ConfigError(f'{FLAG}: the torch profiler needs "torch_profiler_dir": where the '
                              "traces go")
        d = os.path.abspath(os.path.expanduser(d))
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{FLAG}: torch_profiler_dir {d}: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"{FLAG}: torch_profiler_dir {d} is not writable")
    elif d:
        raise ConfigError(f"{FLAG}: torch_profiler_dir is for the torch profiler (the cuda "
                          "profiler's output is nsys's)")
    torch_keys = [k for k in value if k.startswith("torch_profiler_") and k != "torch_profiler_dir"]
    if kind == "cuda" and torch_keys:
        raise ConfigError(f"{FLAG}: {', '.join(sorted(torch_keys))} apply to the torch profiler only")
    return ProfilerParams(**{**value, "torch_profiler_dir": d})


class RankProfiler:
    """One rank's profiler; `rank` is its job-wide rank (it names the trace)."""

    def __init__(self, params: ProfilerParams, rank: int, device: torch.device):
        if params.profiler == "cuda" and device.type != "cuda":
            from .config import ConfigError
            raise ConfigError(f"{FLAG}: the cuda profiler (cudaProfilerStart / Stop) needs a CUDA "
                              f"device; this rank runs on {device} (use \"profiler\": \"torch\")")
        self.params, self.rank, self.device = params, rank, device
        self.prof = None
        self.started = 0.0

    def start(self, tag: str) -> None:
        self.tag = tag
        self.started = time.perf_counter()
        p = self.params
        if p.profiler == "cuda":
            torch.cuda.profiler.start()
            return
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=acts, record_shapes=p.torch_profiler_record_shapes,
                            profile_memory=p.torch_profiler_with_memory,
                            with_stack=p.torch_profiler_with_stack, with_flops=p.torch_profiler_with_flops)
        self.prof.start()

    def stop(self) -> str | None:
        """Stop; the trace's path (torch) or None (cuda)."""
        p, seconds = self.params, time.perf_counter() - self.started
        if p.profiler == "cuda":
            torch.cuda.profiler.stop()
            return None
        prof, self.prof = self.prof, None
        prof.stop()
        path = trace_path(p, self.tag, self.rank)
        prof.export_chrome_trace(path)
        if p.torch_profiler_dump_cuda_time_total:
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            with open(table_path(p, self.tag, self.rank), "w") as f:
                f.write(prof.key_averages().table(sort_by=key, row_limit=50) + "\n")
        log.info("rank %d: profiled %.1f s, trace %s", self.rank, seconds, path)
        return path


def trace_path(p: ProfilerParams, tag: str, rank: int) -> str:
    return os.path.join(p.torch_profiler_dir,
                        f"{tag}-rank{rank}.pt.trace.json" + (".gz" if p.torch_profiler_use_gzip else ""))


def table_path(p: ProfilerParams, tag: str, rank: int) -> str:
    return os.path.join(p.torch_profiler_dir, f"{tag}-rank{rank}.txt")


def new_tag() -> str:
    """The name every rank's trace of one profiling window starts with."""
    return "rankserve-" + time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
