"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path Triton kernels, opt-in
(`RANKSERVE_PDL=1`). A kernel launched with PDL may start while the kernel before it in the stream
is still finishing, so its launch and block ramp-up overlap the other's tail. The contract that
keeps it correct: every PDL kernel calls `gdc_wait` (wait until the previous grid has finished
and its writes are visible) before it reads or writes anything another kernel touches, and
`gdc_launch_dependents` to let the next kernel launch early. Work on data no kernel writes (the
skinny GEMV's first weight tile) may go before the wait. CUDA graphs record the dependency as a
programmatic edge."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = False  # the runtime sets it from RANKSERVE_PDL (runtime/envs.py) at start-up


def launch(t: torch.Tensor) -> dict:
    """The launch arguments of a PDL-capable kernel (its USE_PDL constexpr, and Triton's
    launch_pdl when on): on when enabled, on CUDA at compute capability >= 9."""
    on = ENABLED and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait_and_release(USE: tl.constexpr):
    """At a PDL kernel's start: wait for the previous grid, then let the next one launch."""
    if USE:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
