"""A model's place in the job (ParallelInfo) and the tensor-parallel collectives its layers use.
Built by runtime/parallel.py; the models only read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ParallelInfo:
    """What a model needs to know about its place in the job (built by runtime/parallel.py)."""
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of the TP ranks
    pp_rank: int = 0
    pp_size: int = 1
    enable_expert_parallel: bool = False
    dp_rank: int = 0  # data-parallel replica (runtime only: the layers never look at it)
    dp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def tp_all_reduce(x: torch.Tensor, pi: ParallelInfo) -> torch.Tensor:
    if pi.tp_size == 1:
        return x
    # functional collectives trace under torch.compile and capture in CUDA graphs
    from torch.distributed import _functional_collectives as fc
    return fc.all_reduce(x, "sum", pi.tp_group)


def tp_all_gather_last(x: torch.Tensor, pi: ParallelInfo) -> torch.Tensor:
    """Concatenate the ranks' shards along the last dimension."""
    if pi.tp_size == 1:
        return x
    from torch.distributed import _functional_collectives as fc
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # renamed in 2.12
    gathered = gather(x.contiguous(), 0, pi.tp_group)  # [tp * N, ...]
    return torch.cat(gathered.chunk(pi.tp_size, 0), dim=-1)
