"""Multi-LoRA serving: the request type, the runner's adapter slots, and the API's adapter table.

- `LoRARequest(lora_name, lora_int_id, lora_path)` (vLLM's) travels with a request to every rank.
- The scheduler keeps the adapters of the running requests at most `--max-loras` (a waiting
  request whose adapter would exceed it waits; the others go ahead), so every step's adapters
  fit in the device slots.
- `LoRASlots` (one per rank, owned by the model runner) loads each adapter's shard of this rank
  from disk into a host LRU (`--max-cpu-loras`), copies it into a free or least recently used
  device slot when a step needs it, and fills the per-token slot indices the kernels read.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable

import numpy as np

from ..models.lora_config import adapter_rank, read_adapter_config
from .messages import LoRARequest

__all__ = ["LoRARequest", "LoRASlots", "LoRATable", "parse_lora_modules"]

log = logging.getLogger("rankserve.lora")


class LoRASlots:
    """This rank's adapter slots (see the module doc)."""

    def __init__(self, model, lora_cfg, max_tokens: int, max_seqs: int, dtype, device):
        from ..models.lora import LoRAContext, wrap_model
        self.cfg = lora_cfg
        self.dtype = dtype
        self.ctx = LoRAContext(max_tokens, max_seqs, device)
        self.model = model
        self.layers = wrap_model(model, self.ctx, lora_cfg.max_loras, lora_cfg.max_lora_rank,
                                 dtype, device)
        self.host: collections.OrderedDict[int, dict] = collections.OrderedDict()  # id → weights
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU order
        self.req_lora: dict[str, int] = {}
        self.requests: dict[int, LoRARequest] = {}

    def _host_weights(self, lr: LoRARequest) -> dict:
        w = self.host.get(lr.lora_int_id)
        if w is None:
            from ..models.lora import load_adapter
            w = load_adapter(lr.lora_path, self.model, self.layers, self.cfg.max_lora_rank, self.dtype)
            self.host[lr.lora_int_id] = w
            while len(self.host) > self.cfg.cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lr.lora_int_id)
        return w

    def _slot(self, lid: int, needed: set[int]) -> int:
        if lid in self.slot_of:
            self.slot_of.move_to_end(lid)
            return self.slot_of[lid]
        used = set(self.slot_of.values())
        free = [s for s in range(self.cfg.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # evict the least recently used adapter this step does not need
            victim = next((v for v in self.slot_of if v not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than --max-loras {self.cfg.max_loras} "
                                   "adapters (scheduler bug)")
            slot = self.slot_of.pop(victim)
        from ..models.lora import set_slot
        set_slot(self.layers, slot, self._host_weights(self.requests[lid]))
        self.slot_of[lid] = slot
        log.debug("LoRA adapter %s (id %d) in slot %d", self.requests[lid].lora_name, lid, slot)
        return slot

    def check(self, path: str) -> None:
        """ValueError if the adapter at `path` cannot run on this model (a request naming it is
        refused up front, instead of failing the step that would load it)."""
        from ..models.lora import check_adapter
        check_adapter(path, self.model, self.layers, self.cfg.max_lora_rank)

    def forget_slots(self) -> None:
        """The device slots lost their contents (sleep level 2): load adapters again on use."""
        self.slot_of.clear()

    def prepare(self, plan, req_ids: list[str], counts: np.ndarray, is_decode: bool,
                put: Callable) -> None:
        """Bring this step's adapters into slots and stage the slot indices."""
        for rid in plan.finished_req_ids:
            self.req_lora.pop(rid, None)
        for r in plan.new_reqs:
            lr = getattr(r, "lora_request", None)
            if lr is not None:
                self.req_lora[r.req_id] = lr.lora_int_id
                self.requests[lr.lora_int_id] = lr
        lids = [self.req_lora.get(rid) for rid in req_ids]
        needed = {lid for lid in lids if lid is not None}
        slots = np.array([-1 if lid is None else self._slot(lid, needed) for lid in lids],
                         dtype=np.int32)
        B = len(req_ids)
        c = self.ctx
        put(np.repeat(slots, counts), c.token_slot)
        n = c.seg_slot.shape[0]
        seg_start = np.full(n + 1, int(counts.sum()), dtype=np.int32)
        seg_start[:B + 1] = np.concatenate([[0], np.cumsum(counts)])
        seg_slot = np.full(n, -1, dtype=np.int32)
        seg_slot[:B] = slots
        put(seg_start, c.seg_start)
        put(seg_slot, c.seg_slot)
        c.sgmv.fill_(not is_decode)
        # forget the requests of adapters that no request holds and no slot keeps
        live = set(self.req_lora.values())
        for lid in [x for x in self.requests if x not in live and x not in self.slot_of]:
            del self.requests[lid]


class LoRATable:
    """The API's adapters: name → LoRARequest, with ids handed out once (never reused, so a
    reloaded adapter never meets the prefix-cache blocks of an older one of that name)."""

    def __init__(self, max_lora_rank: int):
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        cfg = read_adapter_config(path)
        if adapter_rank(cfg) > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter_rank(cfg)} > "
                             f"--max-lora-rank {self.max_lora_rank}")
        lr = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        self.adapters[name] = lr
        return lr

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise KeyError(name)
        return self.adapters.pop(name)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None


def parse_lora_modules(items) -> list[tuple[str, str, str | None]]:
    """`--lora-modules` values: `name=path` or JSON {"name", "path", "base_model_name"}."""
    import json
    out = []
    for item in items or ():
        item = item.strip()
        if item.startswith("{"):
            d = json.loads(item)
            extra = d.keys() - {"name", "path", "base_model_name"}
            if extra:
                raise ValueError(f"--lora-modules {item!r}: unknown key(s) {sorted(extra)} "
                                 "(name, path, base_model_name)")
            name, path, base = d.get("name"), d.get("path"), d.get("base_model_name")
            if not (name and path and isinstance(name, str) and isinstance(path, str)
                    and isinstance(base, (str, type(None)))):
                raise ValueError(f"--lora-modules {item!r}: the JSON form needs name and path "
                                 "(strings)")
        else:
            name, sep, path = item.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path or JSON")
        if any(name == o[0] for o in out):
            raise ValueError(f"--lora-modules: adapter name {name!r} twice")
        out.append((name, path, base))
    return out
