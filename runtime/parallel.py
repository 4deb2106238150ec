"""Rank context: TP/PP coordinates and process groups of one rank, and pipeline send/recv.

Ranks are laid out stage-major: rank = pp_rank * tp + tp_rank, so a TP group is a block of
consecutive ranks (on one node when tp ≤ GPUs per node: its all-reduces stay on NVLink).
"""
from __future__ import annotations

import torch

from ..models.parallel import ParallelInfo
from .config import ConfigError, ParallelConfig


def build_parallel_info(rank: int, world_size: int, pc: ParallelConfig) -> ParallelInfo:
    """Collective over all ranks (each TP group is created by every rank, in the same order)."""
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    if world_size != tp * pp:
        raise ConfigError(
            f"--tensor-parallel-size {tp} × --pipeline-parallel-size {pp} = {tp * pp} ranks, but "
            f"the job has {world_size}; launch with e.g. `mpirun -np {tp * pp} rankserve ...`")
    pp_rank, tp_rank = divmod(rank, tp)
    tp_group = None
    if tp > 1:
        import torch.distributed as dist
        for stage in range(pp):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    return ParallelInfo(tp_rank, tp, tp_group, pp_rank, pp, pc.enable_expert_parallel)


def global_rank(pi: ParallelInfo, pp_rank: int) -> int:
    return pp_rank * pi.tp_size + pi.tp_rank


def recv_hidden(pi: ParallelInfo, shape, dtype, device) -> torch.Tensor:
    """Hidden states from the same TP rank of the previous stage."""
    import torch.distributed as dist
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=global_rank(pi, pi.pp_rank - 1))
    return t


def send_hidden(pi: ParallelInfo, hidden: torch.Tensor) -> None:
    import torch.distributed as dist
    dist.send(hidden.contiguous(), dst=global_rank(pi, pi.pp_rank + 1))
