"""Collective admin calls on the model runners: sleep / wake-up and weight updates. Rank 0's
engine core asks its executor (`collective_rpc`), which broadcasts the call to every rank like a
step plan (runtime/executor.py, runtime/worker.py); each rank runs it on its own runner and the
results come back to rank 0. A call that fails on a rank returns its error rather than taking
the job down (a bad checkpoint path is the client's mistake, not a crash)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from .kv_offload import HostKVCache, bytes_per_block
from .parallel import global_rank
from .profiler import RankProfiler
from .sleep import RunnerSleep
from .weight_update import WeightsUpdateGroup, load_from_disk, receive_weights, untaken_names

log = logging.getLogger("rankserve.rpc")


class RunnerRPC:
    """The admin calls one rank serves; `rank` is its rank in the engine's job."""

    def __init__(self, runner, rank: int):
        self.runner = runner
        self.rank = rank
        self.sleep_state = RunnerSleep(runner)
        self.groups: dict[str, WeightsUpdateGroup] = {}
        params, pi = runner.cfg.profiler.params, runner.pi
        self.profiler = RankProfiler(params, global_rank(pi, pi.pp_rank), runner.device) if params else None

    def call(self, method: str, args: tuple) -> tuple:
        """("ok", result) or ("error", exception type name, message)."""
        try:
            return "ok", getattr(self, "rpc_" + method)(*args)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it there
            log.exception("rank %d: %s failed", self.rank, method)
            return "error", type(e).__name__, str(e)

    # ---- host KV tier -----------------------------------------------------------------------
    def rpc_host_kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.runner.model)

    def rpc_init_host_kv(self, num_blocks: int) -> None:
        r = self.runner
        r.host_kv = HostKVCache(r.model, num_blocks, r.device) if num_blocks > 0 else None

    # ---- profiling (runtime/profiler.py) ------------------------------------------------------
    def rpc_profile(self, action: str, tag: str) -> str | None:
        if action == "start":
            return self.profiler.start(tag)
        return self.profiler.stop()

    def rpc_copy_kv_to_host(self, to_host: list[tuple[int, int]]) -> None:
        """Copies outside a step (before a sleep): (device block, host block) pairs."""
        plan = SimpleNamespace(blocks_to_host=to_host, blocks_from_host=[], wait_for_copies=True)
        with torch.inference_mode():  # as in a step (its staging buffer is an inference tensor)
            self.runner.host_kv.run(plan)

    # ---- sleep mode -------------------------------------------------------------------------
    def rpc_sleep(self, level: int) -> dict:
        return self.sleep_state.sleep(level)

    def rpc_wake_up(self, tags: list[str] | None) -> dict:
        return self.sleep_state.wake_up(tags)

    # ---- weight updates ---------------------------------------------------------------------
    def rpc_load_weights_from_disk(self, model_path: str) -> int:
        if self.runner.cfg.cache.fp8_kv:  # the fp8 cache's scales come with the weights (first:
            self.runner.load_kv_scales(model_path)  # unusable ones refuse the checkpoint)
        return load_from_disk(self.runner.model, model_path)

    def rpc_reload_weights(self) -> None:
        """The weights the engine started with: its checkpoint, or the same dummy weights."""
        cfg = self.runner.cfg
        if cfg.load.load_format == "dummy":
            from ..models.loader import init_dummy_weights
            init_dummy_weights(self.runner.model, cfg.model.seed, self.runner.hf_config)
        else:
            self.rpc_load_weights_from_disk(cfg.model.model)

    def rpc_init_weights_update_group(self, master_address: str, master_port: int,
                                      rank_offset: int, world_size: int, group_name: str,
                                      backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"a weight-update group named {group_name!r} exists already")
        self.groups[group_name] = WeightsUpdateGroup(master_address, master_port,
                                                     rank_offset + self.rank, world_size,
                                                     group_name, backend)

    def rpc_untaken_weight_names(self, names: list[str], group_name: str) -> list[str]:
        self._group(group_name)
        return untaken_names(self.runner.model, names)

    def rpc_update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                            group_name: str, load: bool = True) -> list[str]:
        return receive_weights(self.runner.model, self._group(group_name), names, dtypes, shapes,
                               self.runner.device, load)

    def _group(self, group_name: str) -> WeightsUpdateGroup:
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight-update group named {group_name!r} "
                             "(POST /init_weights_update_group first)")
        return group

    def rpc_destroy_weights_update_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        group.destroy()


def raise_errors(results: list[tuple]) -> list:
    """The results of a collective call by rank; the first rank's error raised as such (a
    ValueError stays a ValueError: the client's mistake)."""
    for rank, res in enumerate(results):
        if res[0] == "error":
            _, kind, msg = res
            where = f"rank {rank}: " if len(results) > 1 else ""
            if kind == "ValueError":
                raise ValueError(where + msg)
            raise RuntimeError(f"{where}{kind}: {msg}")
    return [res[1] for res in results]
