"""Rank context: DP/TP/PP coordinates and process groups of one rank, and pipeline send/recv.

Ranks are laid out replica-major, then stage-major: rank = dp_rank * (pp * tp) + pp_rank * tp +
tp_rank. So a data-parallel replica is a block of consecutive ranks and a TP group a block
within it (on one node when tp ≤ GPUs per node: its all-reduces stay on NVLink).
"""
from __future__ import annotations

import torch

from ..models.parallel import ParallelInfo
from .config import ConfigError, ParallelConfig


def build_parallel_info(rank: int, world_size: int, pc: ParallelConfig) -> ParallelInfo:
    """Collective over all ranks (each TP group is created by every rank, in the same order)."""
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    if world_size != tp * pp * dp:
        dp_part = f" × --data-parallel-size {dp}" if dp > 1 else ""
        raise ConfigError(
            f"--tensor-parallel-size {tp} × --pipeline-parallel-size {pp}{dp_part} = {tp * pp * dp} "
            f"ranks, but the job has {world_size}; launch with e.g. `mpirun -np {tp * pp * dp} "
            "rankserve ...`")
    dp_rank, local = divmod(rank, tp * pp)
    pp_rank, tp_rank = divmod(local, tp)
    tp_group = None
    if tp > 1:
        import torch.distributed as dist
        for block in range(dp * pp):  # every (replica, stage) in rank order
            ranks = list(range(block * tp, (block + 1) * tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    return ParallelInfo(tp_rank, tp, tp_group, pp_rank, pp, pc.enable_expert_parallel, dp_rank, dp)


def replica_ranks(pc: ParallelConfig) -> list[list[int]]:
    """The global ranks of each data-parallel replica, replica 0 first."""
    n = pc.world_size
    return [list(range(r * n, (r + 1) * n)) for r in range(pc.data_parallel_size)]


def global_rank(pi: ParallelInfo, pp_rank: int) -> int:
    """The job-wide rank of this rank's TP peer in stage `pp_rank` of its replica."""
    return pi.dp_rank * pi.pp_size * pi.tp_size + pp_rank * pi.tp_size + pi.tp_rank


def recv_hidden(pi: ParallelInfo, shape, dtype, device) -> torch.Tensor:
    """Hidden states from the same TP rank of the previous stage."""
    import torch.distributed as dist
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=global_rank(pi, pi.pp_rank - 1))
    return t


def send_hidden(pi: ParallelInfo, hidden: torch.Tensor) -> None:
    import torch.distributed as dist
    dist.send(hidden.contiguous(), dst=global_rank(pi, pi.pp_rank + 1))
