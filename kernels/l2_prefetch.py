"""L2 prefetch of the next weight while a latency-bound kernel runs (opt-in, RANKSERVE_L2_PREFETCH).

At small decode batches the attention kernels (prepare_qkv, split-KV decode, its reduce) take
~10 us a layer and read almost nothing from HBM, and then o_proj streams its weight (16.8 MB FP8,
33.5 MB bf16 at Llama-3.1-8B) from a cold start. Extra programs appended to prepare_qkv's grid
issue `prefetch.global.L2::evict_last` for the first bytes of that weight (up to a share of the
L2) and exit, so the weight streams into L2 while attention runs and o_proj reads it from there.
A prefetch is only a hint: nothing waits for it, nothing is written, a missed line is read from
HBM as before. CUDA only (the interpreter has no inline PTX)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = False  # the runtime sets it from RANKSERVE_L2_PREFETCH (runtime/envs.py) at start-up
MAX_TOKENS = 16  # decode batches up to which attention leaves HBM idle enough to prefetch
PROGRAMS = 32    # prefetch programs appended to the grid
L2_SHARE = 0.6   # at most this share of the L2 is prefetched
LINE = 128       # bytes a prefetch instruction pulls


@triton.jit
def prefetch_l2(ptr, nbytes, pid, num_programs, BLOCK: tl.constexpr):
    """Program pid of num_programs: prefetch its lines of [ptr, ptr + nbytes) into L2."""
    base = ptr.to(tl.pointer_type(tl.int8))
    lines = tl.cdiv(nbytes, 128)
    for start in range(pid * BLOCK, lines, num_programs * BLOCK):
        offs = tl.minimum(start + tl.arange(0, BLOCK), lines - 1).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                  "=r,l", [base + offs * 128], dtype=tl.int32, is_pure=False,
                                  pack=1)


def plan(target: torch.Tensor | None, tokens: int) -> tuple[torch.Tensor | None, int, int]:
    """(tensor, bytes, programs) to prefetch alongside a kernel over `tokens` rows; programs 0
    when off (disabled, no target, a large batch, not CUDA)."""
    if not ENABLED or target is None or not target.is_cuda or tokens > MAX_TOKENS:
        return None, 0, 0
    nbytes = min(target.numel() * target.element_size(), int(_l2_bytes(target.device) * L2_SHARE))
    return target, nbytes, PROGRAMS


_L2: dict = {}


def _l2_bytes(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _L2:
        _L2[i] = torch.cuda.get_device_properties(i).L2_cache_size
    return _L2[i]


def target_of(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight tensor a linear module streams (the largest of its own parameters: weight,
    FP8 weight, GPTQ qweight), contiguous and on CUDA; None otherwise."""
    params = [p for p in module.parameters(recurse=False) if p.is_cuda and p.is_contiguous()]
    return max(params, key=lambda p: p.numel() * p.element_size(), default=None)
