"""Compile Triton kernels concurrently at start-up (issue #21: a cold start spent most of its
engine time compiling one kernel variant after another: MLIR passes, `ptxas`, the launcher's C
build, each serial inside the first forward that needs it).

`compile_only()` is a context in which a Triton launch does not run: it hands the variant's
compilation to a thread pool (Triton's AsyncCompileMode) and returns. The runtime runs its
start-up forwards once inside it (runtime/compilation.py `precompile`), so every variant the
memory profile, the warm-up and the graph capture will launch is compiled at once on the host's
cores; those phases then find them compiled. The outputs of kernels that did not run are
whatever their buffers held, so while the context is active `torch.empty` / `empty_like` return
zeros: indices computed from them stay in range and nothing reads NaN. Torch's own kernels run as
usual, except `F.linear`, which returns zeros of its shape: no dry step reads a value, and its
GEMMs were most of a dry step's device time (Llama-8B's mixed-step buckets: ~0.5 s at 4096
tokens). A variant that the dry pass misses (a shape that depends on data) is compiled, as before,
where it is first launched.
"""
from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def available() -> bool:
    try:
        from triton.runtime import _async_compile  # noqa: F401  (Triton >= 3.4)
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(JITFunction, "run")


class _LoadingPool:
    """The executor AsyncCompileMode submits to: compile, then build the launcher and load the
    module (the first launch would otherwise do both, serially) in the same worker thread."""

    def __init__(self, device: torch.device, workers: int):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())

        def init():
            torch.cuda.set_device(device)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="triton-compile",
                                       initializer=init if device.type == "cuda" else None)
        self.submitted = 0

    def submit(self, fn):
        self.submitted += 1
        return self.pool.submit(self._compile_and_load, fn)

    @staticmethod
    def _compile_and_load(fn):
        kernel = fn()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            try:
                init()
            except Exception:  # noqa: BLE001 (raised again, with its context, at the launch)
                pass
        return kernel


def _zeros_instead_of_empty():
    """torch.empty / empty_like / Tensor.new_empty as zeros, and F.linear as zeros of its output
    shape (see the module docstring)."""
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear

    def empty(*size, **kw):
        return torch.zeros(*size, **kw)

    def empty_like(t, **kw):
        return torch.zeros_like(t, **kw)

    def new_empty(self, *size, **kw):
        return self.new_zeros(*size, **kw)

    def linear(x, w, bias=None):
        return x.new_zeros(*x.shape[:-1], w.shape[0])

    torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear = empty, empty_like, new_empty, linear
    return saved


@contextlib.contextmanager
def compile_only(device: torch.device, workers: int | None = None):
    """Inside: Triton launches compile (concurrently) instead of running. On leaving, waits for
    every compilation and installs the kernels in their JIT caches. Yields the pool (its
    `submitted` counts the variants compiled)."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    pool = _LoadingPool(device, workers or min(32, os.cpu_count() or 1))
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_instead
    saved = _zeros_instead_of_empty()
    try:
        with AsyncCompileMode(pool, ignore_errors=True):
            try:
                yield pool
            finally:
                JITFunction.run = run
                torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear = saved
    finally:
        JITFunction.run = run
        torch.empty, torch.empty_like, torch.Tensor.new_empty, F.linear = saved
        pool.pool.shutdown(wait=True)
