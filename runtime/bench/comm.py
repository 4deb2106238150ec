"""Collective-communication benchmark across the ranks of an initialised torch.distributed world.

API (the `rankserve bench comm` command wraps it; every rank calls it, it is collective):

    from .comm import run_comm_bench, model_message_sizes

    sizes = model_message_sizes(hidden_size=8192, num_tokens_list=[1, 64, 8192], dtype_bytes=2,
                                tp=8, moe_topk=None, vocab_size=128256)
    # -> {"all_reduce": [16384, ...], "all_gather": [...]}
    rows = []
    for op, op_sizes in sizes.items():
        rows += run_comm_bench(op_sizes, ops=(op,), dtype=torch.bfloat16, iters=50, warmup=10,
                               json_path=None)

`run_comm_bench` returns one dict per (op, size) on every rank: op, size_bytes, dtype, world_size,
backend, comm_lib, iters, latency_us, algbw_GBps, busbw_GBps. Rank 0 prints a table and, when
`json_path` is given, writes {"comm_lib", "backend", "world_size", "results": rows} there.

Conventions follow nccl-tests: `size_bytes` is the all-reduce buffer, the *gathered* all-gather
output and the all-to-all send buffer of one rank; algbw = size / time; busbw = algbw x 2(n-1)/n
for all_reduce and x (n-1)/n for all_gather and all_to_all, which makes busbw comparable with the
link bandwidth whatever the rank count. Time is the slowest rank's mean over `iters`.

With deepspeed importable the ops go through `deepspeed.comm` with its comms logger on (its own
summary is printed after the table); otherwise torch.distributed. `comm_lib` says which.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist

from .. import envs

log = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "all_to_all")
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "all_to_all": lambda n: (n - 1) / n}


class _TorchComm:
    name = "torch.distributed"

    def __init__(self):
        # all_gather_into_tensor is deprecated in newest torch in favour of all_gather_single
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def all_reduce(self, t):
        dist.all_reduce(t)

    def all_gather(self, out, inp):
        self._ag(out, inp)

    def all_to_all(self, out, inp):
        dist.all_to_all_single(out, inp)

    def summary(self):
        pass


class _DeepSpeedComm:
    name = "deepspeed.comm"

    def __init__(self, ds):
        self.ds = ds
        ds.init_distributed(auto_mpi_discovery=False)  # wraps the existing torch.distributed world
        ds.configure(enabled=True, prof_all=True, verbose=False)

    def all_reduce(self, t):
        self.ds.all_reduce(t)

    def all_gather(self, out, inp):
        self.ds.all_gather_into_tensor(out, inp)

    def all_to_all(self, out, inp):
        self.ds.all_to_all_single(out, inp)

    def summary(self):
        self.ds.log_summary()


def _comm_lib():
    if envs.get("RANKSERVE_COMM_LIB") != "torch":
        try:
            import deepspeed.comm as ds
        except ImportError:
            pass
        else:
            return _DeepSpeedComm(ds)
    return _TorchComm()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_comm_bench(sizes_bytes: list[int], ops=OPS, dtype: torch.dtype = torch.float32,
                   iters: int = 20, warmup: int = 5, json_path: str | None = None,
                   device: torch.device | str | None = None) -> list[dict]:
    """Time each op at each size (see module docstring). Collective over the default group."""
    if not dist.is_initialized():
        raise RuntimeError("run_comm_bench needs an initialised torch.distributed world")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    n, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    device = torch.device(device)
    lib = _comm_lib()
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for op in ops:
        for size in sizes_bytes:
            # whole elements, divisible by the rank count (per-rank shards of gather / all-to-all)
            numel = max(n, (size // elem) // n * n)
            big = torch.ones(numel, dtype=dtype, device=device)
            shard = torch.ones(numel // n, dtype=dtype, device=device)
            out = torch.empty_like(big)
            run = {"all_reduce": lambda: lib.all_reduce(big),
                   "all_gather": lambda: lib.all_gather(out, shard),
                   "all_to_all": lambda: lib.all_to_all(out, big)}[op]
            for _ in range(warmup):
                run()
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            _sync(device)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            sec = elapsed.item() / iters
            nbytes = numel * elem
            algbw = nbytes / sec / 1e9
            rows.append(dict(op=op, size_bytes=nbytes, dtype=str(dtype).replace("torch.", ""),
                             world_size=n, backend=backend, comm_lib=lib.name, iters=iters,
                             latency_us=sec * 1e6, algbw_GBps=algbw,
                             busbw_GBps=algbw * _BUS_FACTOR[op](n)))
    lib.summary()
    if rank == 0:
        print(format_table(rows))
        if json_path:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            with open(json_path, "w") as f:
                json.dump({"comm_lib": lib.name, "backend": backend, "world_size": n,
                           "results": rows}, f, indent=2)
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no results)"
    r0 = rows[0]
    lines = [f"# comm bench: {r0['comm_lib']} on {r0['backend']}, {r0['world_size']} ranks, "
             f"{r0['dtype']}, {r0['iters']} iters",
             f"{'op':<12}{'size(B)':>14}{'time(us)':>12}{'algbw(GB/s)':>14}{'busbw(GB/s)':>14}"]
    for r in rows:
        lines.append(f"{r['op']:<12}{r['size_bytes']:>14}{r['latency_us']:>12.1f}"
                     f"{r['algbw_GBps']:>14.4f}{r['busbw_GBps']:>14.4f}")
    return "\n".join(lines)


def model_message_sizes(hidden_size: int, num_tokens_list: list[int], dtype_bytes: int, tp: int,
                        moe_topk: int | None = None, vocab_size: int | None = None
                        ) -> dict[str, list[int]]:
    """Message sizes (bytes, nccl-tests convention) that a model's parallel layers produce.

    - all_reduce: the [tokens, hidden] output of every row-parallel layer (attention out-proj,
      MLP down-proj), twice per layer per step, when tp > 1.
    - all_gather: the [tokens, vocab] logits gathered from the vocab-parallel LM head, when tp > 1
      and vocab_size is given (only sampled positions in practice, so an upper bound).
    - all_to_all: the routed tokens of an expert-parallel MoE layer, [tokens * topk, hidden] sent
      per rank for dispatch (and the same for combine), when moe_topk is given.
    Returns {op: sorted distinct sizes}, ready for `run_comm_bench(sizes, ops=(op,))`.
    """
    out: dict[str, set[int]] = {}
    for t in num_tokens_list:
        if tp > 1:
            out.setdefault("all_reduce", set()).add(t * hidden_size * dtype_bytes)
            if vocab_size:
                out.setdefault("all_gather", set()).add(t * vocab_size * dtype_bytes)
        if moe_topk:
            out.setdefault("all_to_all", set()).add(t * moe_topk * hidden_size * dtype_bytes)
    return {op: sorted(s) for op, s in out.items()}


_NEEDS = {"all_reduce": "it needs --tp > 1", "all_gather": "it needs --tp > 1",
          "all_to_all": "it needs a MoE model with --enable-expert-parallel"}


def select_model_ops(requested: list[str] | None, available) -> tuple[list[str], str | None]:
    """Ops to time at a model's own sizes: (ops, notice of the ones left out).

    `requested` None means every op the model sends (the others are named in the notice); an op
    requested by name that the model does not send is an error, never dropped silently.
    """
    if requested is None:
        ops = [op for op in OPS if op in available]
        skipped = [f"{op} ({_NEEDS[op]})" for op in OPS if op not in available]
        if not ops:
            raise ValueError("the model sends no collectives in this layout (" + "; ".join(skipped)
                             + "); pass --tp, --enable-expert-parallel or --sizes")
        return ops, ("not timed, the model does not send them here: " + "; ".join(skipped)
                     if skipped else None)
    missing = [op for op in requested if op not in available]
    if missing:
        raise ValueError("--ops " + ", ".join(f"{op}: the model sends none here ({_NEEDS[op]})"
                                              for op in missing) + "; pass --sizes to time it anyway")
    return requested, None
