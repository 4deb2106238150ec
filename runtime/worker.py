"""Worker: one rank's model runner, driven by the step plans rank 0 broadcasts.

The same `Worker` object serves rank 0 (inside `MultiRankExecutor`) and the other ranks
(`run_worker` loop), so every rank runs exactly the same sequence of collectives.
"""
from __future__ import annotations

import collections
import logging

import torch

from ..models.parallel import ParallelInfo
from . import envs
from .config import EngineConfig
from .engine_core import freeze_gc_heap
from .kv_offload import num_host_blocks
from .model_runner import ModelRunner
from .parallel import global_rank, recv_hidden, send_hidden
from .model_runner import ModelRunnerOutput
from .rpc import RunnerRPC
from .scheduler import SchedulerOutput

log = logging.getLogger("rankserve.worker")


class Worker:
    def __init__(self, cfg: EngineConfig, control, pi: ParallelInfo, device: torch.device):
        self.control = control
        self.pi = pi
        self.cfg = cfg
        self.runner = ModelRunner(cfg, pi, device)
        self.rpc = RunnerRPC(self.runner, control.rank)
        self.received: collections.deque = collections.deque()  # step results taken early
        self.num_host_blocks = 0
        self.host_block_bytes = 0  # every rank's shard of a block (rank 0's cost model)
        # the rank whose sampled ids go back to rank 0: TP rank 0 of the last stage (ranks on
        # the control channel, which spans one data-parallel replica)
        self.result_rank = global_rank(ParallelInfo(0, pi.tp_size, None, pi.pp_size - 1,
                                                    pi.pp_size), pi.pp_size - 1)

    def init_cache(self, num_blocks: int | None) -> int:
        """Collective: the smallest block count any rank can hold wins."""
        mine = self.runner.determine_num_blocks()
        counts = self.control.gather(mine)
        num_blocks = self.control.bcast(min(counts) if counts else None)
        self.runner.allocate_kv_cache(num_blocks)
        gib = self.cfg.offload.kv_offload_size
        if gib > 0:  # the host tier: --kv-offload-size GiB over every rank's shard of a block
            sizes = self.control.gather(self.rpc.rpc_host_kv_bytes_per_block())
            self.host_block_bytes = self.control.bcast(sum(sizes) if sizes else None)
            self.num_host_blocks = num_host_blocks(gib, self.host_block_bytes)  # (every rank refuses 0)
            self.rpc.rpc_init_host_kv(self.num_host_blocks)
        self.runner.compile()
        return num_blocks

    def collective_rpc(self, method: str, args: tuple) -> list:
        """Collective: run an admin call (runtime/rpc.py) on this rank; rank 0 gets every
        rank's result, in rank order (None elsewhere)."""
        return self.control.gather(self.rpc.call(method, args))

    def step(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        """This rank's part of one step. Returns the sampled result where it was computed (the
        last stage's TP rank 0), None elsewhere; rank 0 fetches it with `collect`."""
        r = self.runner
        hidden_in = None
        if not self.pi.is_first_stage:
            hidden_in = recv_hidden(self.pi, (plan.total_num_scheduled_tokens,
                                              r.hf_config.hidden_size), r.dtype, r.device)
        out = r.execute(plan, hidden_in)
        if not self.pi.is_last_stage:
            send_hidden(self.pi, out)
            out = None
        me = self.control.rank
        if me == self.result_rank and me != 0:  # PP > 1: the last stage reports to rank 0
            self.control.send(out, dest=0)
        return out if me == self.result_rank else None

    def collect(self, local: ModelRunnerOutput | None) -> ModelRunnerOutput:
        """On rank 0: the result of the oldest submitted step (results arrive in order)."""
        if self.result_rank == 0:
            return local
        if self.received:
            return self.received.popleft()
        return self.control.recv(source=self.result_rank)

    def receive_pending(self, in_flight: int) -> None:
        """On rank 0, before a gather while steps are in flight: take their results off the
        last stage now (its send may wait for this receive, while rank 0 would wait in the gather)."""
        if self.result_rank != 0:
            while len(self.received) < in_flight:
                self.received.append(self.control.recv(source=self.result_rank))

    def profile(self, action: str, tag: str, in_flight: int = 0) -> list:
        """Collective: start / stop the profiler between two steps on every rank (runtime/profiler.py);
        rank 0 gets every rank's result. Steps may be in flight (rank 0: `in_flight` of them)."""
        mine = self.rpc.call("profile", (action, tag))
        if self.control.rank == 0:
            self.receive_pending(in_flight)
        return self.control.gather(mine)


def _fault_step(rank: int) -> int | None:
    """`RANKSERVE_INJECT_FAULT=rank:step` makes that rank raise at that step (failure tests)."""
    spec = envs.get("RANKSERVE_INJECT_FAULT")
    if spec:
        r, step = spec.split(":")
        if int(r) == rank:
            return int(step)
    return None


def run_worker(cfg: EngineConfig, control, pi: ParallelInfo, device: torch.device) -> int:
    """Loop of ranks 1..N-1: wait (without spinning) for a command, run it, repeat."""
    worker = Worker(cfg, control, pi, device)
    worker.init_cache(None)
    freeze_gc_heap()  # this rank serves this engine until shutdown
    fault, steps = _fault_step(global_rank(pi, pi.pp_rank)), 0  # the job-wide rank
    while True:
        kind, payload = control.bcast_idle(None)
        if kind == "step":
            steps += 1
            if steps == fault:
                raise RuntimeError(f"injected fault at step {steps} (RANKSERVE_INJECT_FAULT)")
            worker.step(payload)
        elif kind == "rpc":
            worker.collective_rpc(*payload)
        elif kind == "profile":
            worker.profile(*payload)
        elif kind == "shutdown":
            log.info("rank %d: shutdown", control.rank)
            return 0
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
