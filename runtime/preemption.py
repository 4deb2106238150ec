"""Swap or recompute: what a preempted request's KV costs to get back (`--preemption-mode`).

With the host KV tier (`--kv-offload-size`) a preempted request's full blocks can be copied to
pinned host memory and back ("swap") instead of recomputed by a prefill when it resumes. Which
is cheaper depends on the model, the device and the host link, and on the request:

    recompute(n tokens) = (2 × active params × n  +  attention FLOPs per context token × n(n+1)/2
                           + 2 × vocab × hidden) / peak FLOP/s
    swap(b blocks)      = 2 × b × KV bytes per block / host link bandwidth     (out, then back)

The prefix is recomputed in one prefill, so its attention term grows with the square of its
length, while the copies are linear: long prefixes favour swapping. Both sides are totals over
every rank of the engine (FLOPs of the whole model, bytes of every rank's shard of a block)
over one device's rates; with TP × PP devices working in parallel both divide by the same
count, which cancels. The FLOPs come from the floor model (runtime/bench/common.py,
`ModelStats`); the rates are measured once at startup on CUDA (a short timed bf16 matmul and a
pinned round-trip copy) and are documented defaults on CPU. RANKSERVE_PEAK_TFLOPS and
RANKSERVE_HOST_LINK_GBPS override them (tests, or a node whose link is shared).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from . import envs

log = logging.getLogger("rankserve.preemption")

# CPU defaults (no measurement: startup stays fast and tests deterministic): a few cores' fp32
# matmul rate, and a memcpy between two host buffers
CPU_PEAK_TFLOPS = 0.1
CPU_LINK_GBPS = 10.0


@dataclass(frozen=True)
class SwapCostModel:
    flops_per_token: float  # 2 × active parameters per token
    attn_flops_per_context: float  # one query token against one context token, all layers
    head_flops: float  # the LM head over the last position of the prefill
    block_size: int
    block_bytes: int  # KV bytes of one block, every rank's shard together
    peak_flops: float  # FLOP/s of one device
    link_bytes_per_s: float  # host ⇄ device bandwidth of one device, per direction

    def recompute_seconds(self, num_tokens: int) -> float:
        n = num_tokens
        return (self.flops_per_token * n + self.attn_flops_per_context * n * (n + 1) / 2
                + self.head_flops) / self.peak_flops

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.link_bytes_per_s

    def prefers_swap(self, num_tokens: int) -> bool:
        """Swap the full blocks of a request that computed `num_tokens`? (Its partial last
        block is recomputed either way.)"""
        blocks = num_tokens // self.block_size
        return blocks > 0 and self.swap_seconds(blocks) < self.recompute_seconds(blocks * self.block_size)

    def describe(self) -> str:
        b = self.block_size
        return (f"preemption cost per block of {b} tokens: recompute {1e6 * self.recompute_seconds(b):.1f} us "
                f"(first block; {self.flops_per_token * b / 1e9:.3g} GFLOP + attention, at "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s), swap {1e6 * self.swap_seconds(1):.1f} us "
                f"({self.block_bytes / 2**20:.3g} MiB out and back at {self.link_bytes_per_s / 1e9:.3g} GB/s)")


def build_cost_model(hf_config, block_size: int, block_bytes: int, device: torch.device) -> SwapCostModel:
    from .bench.common import model_stats  # the floor model's parameter counts
    s = model_stats(hf_config)
    peak, link = envs.get("RANKSERVE_PEAK_TFLOPS"), envs.get("RANKSERVE_HOST_LINK_GBPS")
    cuda = device.type == "cuda"
    if peak is None:
        peak = measure_matmul_tflops(device) if cuda else CPU_PEAK_TFLOPS
    if link is None:
        link = measure_link_gbps(device) if cuda else CPU_LINK_GBPS
    return SwapCostModel(
        flops_per_token=2 * s.active_params_per_token + s.ssm_flops_per_token,
        attn_flops_per_context=s.attn_flops_per_context, head_flops=2 * s.head_params,
        block_size=block_size, block_bytes=block_bytes, peak_flops=peak * 1e12,
        link_bytes_per_s=link * 1e9)


def _cuda_seconds(fn, reps: int = 5) -> float:
    fn()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def measure_matmul_tflops(device: torch.device, n: int = 4096) -> float:
    """Dense bf16 matmul rate (a prefill's GEMMs run near it); about a millisecond."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    s = _cuda_seconds(lambda: torch.matmul(a, b))
    return 2 * n**3 / s / 1e12


def measure_link_gbps(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Pinned host ⇄ device bandwidth per direction: the mean over a copy each way."""
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s = _cuda_seconds(lambda: dev.copy_(host, non_blocking=True)) \
        + _cuda_seconds(lambda: host.copy_(dev, non_blocking=True))
    log.debug("host link measured in %.2f s", time.perf_counter() - t0)
    return 2 * nbytes / s / 1e9
