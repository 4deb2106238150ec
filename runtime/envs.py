"""Every `RANKSERVE_*` environment variable, in one table. Read when used (not at import), so a
launcher, a test or a child process may set them; nothing here writes to `os.environ`.
Flags are the way to configure the engine; these are for what must reach every rank of a job
before any flag is parsed, and for tests and experiments. The README lists them all."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class Knob:
    default: object
    parse: Callable[[str], object]
    doc: str


def _flag(v: str) -> bool:
    # strict: a typo (`RANKSERVE_HEARTBEAT=of`) must not silently mean on
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0 (true/false, yes/no, on/off)")


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            n = lo - 1
        if n < lo:
            raise ValueError(f"expected an integer >= {lo}")
        return n
    return parse


def _positive(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):  # (nan too)
        raise ValueError("expected a number > 0")
    return x


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return v
    return parse


def _fault(v: str) -> str:
    r, sep, step = v.partition(":")
    if not (sep and r.strip().isdigit() and step.strip().isdigit() and int(step) >= 1):
        raise ValueError("expected RANK:STEP, e.g. 1:5")
    return v


KNOBS: dict[str, Knob] = {
    "RANKSERVE_LAUNCHER": Knob(None, _one_of("mpi", "slurm", "torchrun", "single"),
                               "force the launcher (mpi, slurm, torchrun, single) instead of "
                               "detecting it from the environment"),
    "RANKSERVE_MASTER_ADDR": Knob(None, str, "address ranks use to reach rank 0 (default: "
                                  "127.0.0.1 on one node, else rank 0's hostname)"),
    "RANKSERVE_HEARTBEAT": Knob(True, _flag, "0 turns off the rank heartbeat (failure detection "
                                "of ranks that die without MPI noticing)"),
    "RANKSERVE_HEARTBEAT_TIMEOUT": Knob(30.0, _positive, "seconds without a heartbeat before a rank "
                                        "is declared dead and the job is taken down"),
    "RANKSERVE_INJECT_FAULT": Knob(None, _fault, "RANK:STEP makes that rank raise at that step "
                                   "(failure drills and tests)"),
    "RANKSERVE_SKINNY_MAX_M": Knob(1, _int_at_least(0), "rows up to which decode GEMMs use the fused skinny "
                                   "Triton kernels (0: off, cuBLAS + prologue kernels)"),
    "RANKSERVE_QUANT_TC_MAX_M": Knob(None, _int_at_least(0), "rows up to which FP8 / 4-bit GEMMs use the "
                                     "tensor-core skinny Triton kernels (kernels/quant_tc.py; "
                                     "default 16 on CUDA, 0 elsewhere; 0: off, the CUDA-core "
                                     "skinny kernels / GEMMs)"),
    "RANKSERVE_FUSED_DECODE_MAX_B": Knob(0, _int_at_least(0), "decode steps of up to this many "
                                         "requests build q/k (norm, RoPE) and store k/v inside the "
                                         "split-KV attention kernel, one launch fewer a layer "
                                         "(kernels/triton_attention.py fused_decode_attention; "
                                         "0: off, the default until measured on a GPU)"),
    "RANKSERVE_DECODE_LPT": Knob(False, _flag, "1: decode attention starts its programs longest "
                                 "context first (a request's kv heads and splits together), so "
                                 "short ones fill the tail (kernels/triton_attention.py "
                                 "DECODE_LPT; off until measured on a GPU)"),
    "RANKSERVE_SWIGLU_EPILOGUE": Knob(False, _flag, "1: decode steps of up to RANKSERVE_SKINNY_MAX_M "
                                      "rows apply silu(gate) * up in gate_up's skinny GEMV epilogue, "
                                      "so down is a plain GEMV (kernels/gemv.py; 16-bit gate_up "
                                      "without LoRA; off until measured on a GPU)"),
    "RANKSERVE_PRECOMPILE": Knob(True, _flag, "0: compile Triton kernels where first launched, one "
                                 "after another, instead of all at once on a thread pool before "
                                 "the memory profile (CUDA, levels 0-1; kernels/precompile.py)"),
    "RANKSERVE_PDL": Knob(False, _flag, "1: programmatic dependent launch for the decode-path Triton "
                          "kernels (skinny GEMVs, prepare_qkv, decode attention; Hopper+), each "
                          "launching while the previous one finishes (kernels/pdl.py)"),
    "RANKSERVE_COMM_LIB": Knob(None, _one_of("torch", "deepspeed"), "`torch` makes `rankserve bench comm` use "
                               "torch.distributed even where deepspeed is installed"),
    "RANKSERVE_API_KEY": Knob(None, str, "API key of `rankserve serve` (instead of --api-key, "
                              "which `ps` shows); VLLM_API_KEY is read too"),
    "RANKSERVE_PEAK_TFLOPS": Knob(None, _positive, "device FLOP rate (TFLOP/s) of the swap-or-recompute "
                                  "preemption cost model (default: measured on CUDA, 0.1 on CPU)"),
    "RANKSERVE_HOST_LINK_GBPS": Knob(None, _positive, "host <-> device bandwidth (GB/s per direction) of "
                                     "that cost model (default: measured on CUDA, 10 on CPU)"),
    "RANKSERVE_GRAMMAR_THREADS": Knob(None, _int_at_least(1), "threads of the structured-output mask fill "
                                      "(default: the CPUs the engine process may use less two, at most 16)"),
    "RANKSERVE_GRAMMAR_REUSE_MASKS": Knob(True, _flag, "0 fills every structured-output mask row each "
                                          "step (default: a row known unchanged inside a JSON string is copied)"),
    "RANKSERVE_GRAMMAR_CACHE_MB": Knob(512, _int_at_least(0), "MiB of compiled structured-output grammars "
                                       "kept for reuse (oldest dropped first; ~14 MiB each with a 150k "
                                       "vocabulary)"),
    "RANKSERVE_LOG_STATS_INTERVAL": Knob(10.0, _positive, "seconds between the server engine's stats "
                                         "lines (throughput, requests, KV cache; "
                                         "--disable-log-stats turns them off)"),
    "RANKSERVE_STEP_LOG": Knob(None, str, "path: the server's engine appends one CSV line per step "
                               "(time, seconds since the previous step's outputs, prompt tokens, generated "
                               "tokens, running, waiting): where inter-token-latency tails come from"),
    "RANKSERVE_HOST_PROFILE": Knob(None, str, "path: the server's engine profiles its host loop (cProfile) "
                                   "over the first 64 steps of each of the first 3 bursts of work (work after "
                                   "an idle turn) and writes PATH.1, PATH.2, ... (functions by own and by "
                                   "cumulative time): what the host does in the steps of a cold burst"),
    # test-suite knobs: how long the bounded fuzz and soak runs are (CI keeps the defaults)
    "RANKSERVE_FUZZ_EXAMPLES": Knob(12, _int_at_least(1), "generated examples per route in tests/test_fuzz_api.py"),
    "RANKSERVE_SOAK_SECONDS": Knob(40.0, _positive, "duration of tests/test_soak.py"),
}


def get(name: str, env: Mapping[str, str] | None = None):
    """The knob's value from `env` (default: this process's environment), parsed."""
    knob = KNOBS[name]
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw == "":
        return knob.default
    try:
        return knob.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not valid ({e}): {knob.doc}") from None


# read by the sbatch templates and the GPU session script, not by rankserve itself
SCRIPT_VARIABLES = ("RANKSERVE_PORT", "RANKSERVE_HEALTH_TIMEOUT", "RANKSERVE_SRUN_MPI",
                    "RANKSERVE_CACHE_DIR")


def check(env: Mapping[str, str] | None = None) -> list[str]:
    """Parse every knob that is set, at start-up: most are read only where they are used (a
    multi-rank job, a structured-output request, a preemption), so a bad value would otherwise
    go unnoticed, or fail a request or a rank long after the start. Raises ValueError naming it.
    Returns a warning per `RANKSERVE_*` variable that is no knob (a typo would be ignored), and
    logs it."""
    env = os.environ if env is None else env
    for name in KNOBS:
        get(name, env)
    import difflib
    import logging
    warnings = []
    for name in sorted(k for k in env if k.startswith("RANKSERVE_")):
        if name not in KNOBS and name not in SCRIPT_VARIABLES:
            near = difflib.get_close_matches(name, KNOBS, n=1)
            warnings.append(f"{name} is not a rankserve environment variable (ignored)"
                            + (f"; did you mean {near[0]}?" if near else ""))
            if warnings[-1] not in _WARNED:  # the CLI and LLM() both check: log it once
                _WARNED.add(warnings[-1])
                logging.getLogger("rankserve.envs").warning("%s", warnings[-1])
    return warnings


_WARNED: set[str] = set()
