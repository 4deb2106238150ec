"""The host tier of the prefix cache (`--kv-offload-size GiB`): prefix-cache blocks evicted from
the device are kept in pinned host memory and copied back on a prefix hit instead of being
recomputed.

Two halves, like the device tier:
- `HostTierManager` (rank 0, inside the KVCacheManager): which block hashes sit in which host
  block, LRU order, and the copies the next step plan carries.
- `HostKVCache` (every rank, beside its model runner): the pinned host memory of its shard of
  each block, and the copies themselves.

When blocks go to the host ("write-back on free"): a cached block whose last holder lets go
(a request finished, was aborted or preempted) is queued; the next step plan copies it to a host
block, device → host, on a side CUDA stream that overlaps that step's forward. By the time the
device tier evicts the block (reuses it for other tokens) its copy has long been made, so
eviction costs nothing on the step's critical path. Only when a block is freed and reused within
one step is the copy made in that step, and that step's forward waits for it (`wait_for_copies`).
A block already in the host tier is not copied again.

When blocks come back: a prefix lookup that misses on the device continues in the host tier; a
hit takes a fresh device block, registers it under the hash at once, and the plan copies it host
→ device before the forward (which waits for it: the step reads it). The request counts those
tokens as computed, exactly as a device hit.

Ordering: every rank runs a plan's copies in one stream, device → host first, then host →
device, after the work of earlier steps (the side stream waits for the main stream), and a
forward never starts before the copies of the previous step are done. So a host block written
and read in one plan, a host block reassigned while a load from it is queued, or a device block
copied out and then overwritten in one step, all see the right data. The scheduler never evicts
a host block that a queued load reads.

Preemption: a victim's full blocks are freed like any others, so they go to the host tier and
the victim resumes from there (prefix hits) instead of recomputing them; only its partial last
block is recomputed.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from .config import ConfigError

log = logging.getLogger("rankserve.kv_offload")


class HostHit:
    """A prefix block found in the host tier (the device tier missed it)."""
    __slots__ = ("block_hash", "host_id")

    def __init__(self, block_hash: bytes, host_id: int):
        self.block_hash, self.host_id = block_hash, host_id


class HostTier:
    """Which hash sits in which host block; `lru` runs from least to most recently used."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.busy: set[int] = set()  # read by a load the plan being built carries

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def store(self, block_hash: bytes) -> int | None:
        """A host block for this hash (evicting the least recently used entry that no queued
        load reads), or None if the hash is already here or no block can be had."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return None
        if self.free:
            hid = self.free.pop()
        else:
            victim = next((h for h, i in self.lru.items() if i not in self.busy), None)
            if victim is None:
                return None
            hid = self.lru.pop(victim)
        self.lru[block_hash] = hid
        return hid

    def drop_block(self, hid: int) -> None:
        for h, i in self.lru.items():
            if i == hid:
                del self.lru[h]
                self.free.append(hid)
                return

    def reset(self) -> None:
        self.lru.clear()
        self.busy.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))


class HostTierManager:
    """Rank 0's side of the host tier: the KVCacheManager calls it when a cached block is freed
    (`on_free`), when the device pool evicts one (`on_evict`), on a device miss (`lookup`) and
    for a host hit (`load`); the scheduler starts each step with `begin_step` and moves the
    queued copies into a non-empty plan with `take_copies`."""

    def __init__(self, num_blocks: int):
        self.tier = HostTier(num_blocks)
        self.pending: dict[int, bytes] = {}  # device block → hash: freed, not copied yet
        self.to_host: list[tuple[int, int]] = []  # (device block, host block), for the next plan
        self.from_host: list[tuple[int, int]] = []  # (host block, device block)
        self.outgoing: set[int] = set()  # device blocks in to_host
        self.sync = False  # the next plan overwrites a block it copies out
        # cumulative, for /metrics
        self.queries = 0  # tokens looked up here (the device tier missed them)
        self.hits = 0
        self.blocks_stored = 0
        self.blocks_loaded = 0

    # ---- events from the device tier --------------------------------------------------------
    def on_free(self, block_id: int, block_hash: bytes) -> None:
        """A cached block lost its last holder: copy it out with the next plan, unless the host
        tier has it already (then it is only marked as used)."""
        if block_hash in self.tier.lru:
            self.tier.lru.move_to_end(block_hash)
        else:
            self.pending[block_id] = block_hash

    def on_evict(self, block_id: int) -> None:
        """The device pool reuses this block in the plan being built: copy it out now if it was
        waiting, and make the forward wait for a copy of it that this plan carries."""
        h = self.pending.pop(block_id, None)
        if h is not None:
            self._store(block_id, h)
        if block_id in self.outgoing:
            self.sync = True

    def begin_step(self) -> None:
        """Blocks freed since the last plan go out with this one."""
        for bid, h in self.pending.items():
            self._store(bid, h)
        self.pending.clear()

    def _store(self, block_id: int, block_hash: bytes) -> None:
        hid = self.tier.store(block_hash)
        if hid is not None:
            self.to_host.append((block_id, hid))
            self.outgoing.add(block_id)
            self.blocks_stored += 1

    # ---- prefix hits ------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> HostHit | None:
        hid = self.tier.lru.get(block_hash)
        return None if hid is None else HostHit(block_hash, hid)

    def reserve(self, hits: list[HostHit]) -> None:
        """The host blocks a request is about to load: not to be evicted in this plan."""
        self.tier.busy.update(h.host_id for h in hits)

    def load(self, hit: HostHit, block_id: int) -> None:
        self.from_host.append((hit.host_id, block_id))
        self.tier.busy.add(hit.host_id)
        if hit.block_hash in self.tier.lru:
            self.tier.lru.move_to_end(hit.block_hash)
        self.blocks_loaded += 1

    def record_lookup(self, num_tokens: int, host_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += host_tokens

    # ---- the plan ---------------------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], bool]:
        out = (self.to_host, self.from_host, self.sync or bool(self.from_host))
        self.to_host, self.from_host, self.sync = [], [], False
        self.outgoing.clear()
        self.tier.busy.clear()
        return out

    def reset(self, host: bool) -> None:
        """The device tier is dropped (its blocks' contents go away): forget what was still to
        be copied out, and the whole host tier too if `host`. Only while no request holds
        blocks, so no load is queued."""
        self.pending.clear()
        if host:
            self.tier.reset()
        else:
            for _bid, hid in self.to_host:
                self.tier.drop_block(hid)
        self.to_host, self.from_host, self.sync = [], [], False
        self.outgoing.clear()
        self.tier.busy.clear()

    def check_invariants(self, pool) -> None:
        t = self.tier
        ids = list(t.lru.values())
        assert len(set(ids)) == len(ids), "a host block holds two hashes"
        assert not set(ids) & set(t.free) and len(ids) + len(t.free) == t.num_blocks, "host blocks"
        assert len(set(t.free)) == len(t.free), "a host block free twice"
        assert not self.from_host and not t.busy, "loads outside a plan"
        assert self.outgoing == {bid for bid, _ in self.to_host}, "outgoing"
        for bid, h in self.pending.items():
            assert pool.blocks[bid].block_hash == h, f"pending block {bid} lost its hash"


# ---- every rank: the host memory and the copies ----------------------------------------------
class HostBuffer:
    """`nbytes` of host memory, page-locked (on CUDA) for asynchronous copies. Registered with
    CUDA at exactly that size: torch's pinned allocator rounds every allocation up to a power of
    two, so a 20 GiB host tier would lock 32 GiB. Falls back to that allocator if registration
    fails; `release()` ends the registration before the memory goes."""

    def __init__(self, nbytes: int, cuda: bool):
        self.ptr = None
        if not cuda or nbytes == 0:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
            return
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096  # page-aligned
        self.tensor = raw[start:start + nbytes]
        rt = torch.cuda.cudart()
        if rt.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0) == rt.cudaError.success:
            self.ptr = self.tensor.data_ptr()
        else:
            log.warning("cudaHostRegister of %.2f GiB failed; using torch's pinned allocator",
                        nbytes / 2**30)
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        if self.ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.ptr = None
        self.tensor = None


def kv_tensors(model) -> list[torch.Tensor]:
    """The per-layer KV-cache tensors of this rank (first dimension: blocks)."""
    out = []
    for a in model.attention_layers():  # an MLA layer's V cache has width 0: nothing to copy
        out += [t for t in (a.k_cache, a.v_cache) if t.dim() < 4 or t.shape[-1]]
    return out


def num_host_blocks(gib: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` (every rank's shard together) in `--kv-offload-size` GiB; a size
    that holds none is refused (it would be no host tier at all, and no swap)."""
    n = int(gib * 2**30) // block_bytes
    if n == 0:
        raise ConfigError(f"--kv-offload-size {gib} GiB holds no KV block (one takes {block_bytes} "
                          f"bytes of host memory): give at least {block_bytes / 2**30:.3g}, or 0 for no host tier")
    return n


def bytes_per_block(model) -> int:
    return sum(t[0].numel() * t.element_size() for t in kv_tensors(model))


class HostKVCache:
    """This rank's shard of the host tier: one pinned row of bytes per host block (every layer's
    K and V side by side), and the plans' block copies (`run`, before the forward)."""

    STAGING_BYTES = 64 << 20  # device buffer the copies go through, a chunk of blocks at a time

    def __init__(self, model, num_blocks: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.bind(model)
        nbytes = num_blocks * self.block_bytes
        try:
            self.buffer = HostBuffer(nbytes, self.cuda)
        except (MemoryError, RuntimeError) as e:
            raise ConfigError(f"--kv-offload-size {nbytes / 2**30:.1f} GiB: cannot allocate that much "
                              f"host memory for this rank's share of the host KV tier "
                              f"({str(e).splitlines()[0]})") from None
        self.host = self.buffer.tensor.view(num_blocks, self.block_bytes)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.last_event = None  # copies of an earlier step a forward has not waited for yet
        self.staging: torch.Tensor | None = None

    def bind(self, model) -> None:
        """(Re)read the device KV tensors: at start and after the KV cache is reallocated."""
        self.kv = [t.view(torch.uint8).view(t.shape[0], -1) for t in kv_tensors(model)]
        sizes = [t.shape[1] for t in self.kv]
        self.cols = [(sum(sizes[:j]), sum(sizes[:j + 1])) for j in range(len(sizes))]
        self.block_bytes = sum(sizes)

    def release_device(self) -> None:
        """Sleep: wait for the copies in flight and let go of the device memory."""
        if self.stream is not None:
            self.stream.synchronize()
        self.last_event = None
        self.staging = None
        self.kv = []

    def run(self, plan) -> None:
        out, back = plan.blocks_to_host, plan.blocks_from_host
        if not self.cuda:  # plain copies, in plan order
            if out or back:
                self._copy(out, back)
            return
        main = torch.cuda.current_stream(self.device)
        if not out and not back:
            if self.last_event is not None:
                main.wait_event(self.last_event)
                self.last_event = None
            return
        self.stream.wait_stream(main)  # the KV written by the steps issued so far
        with torch.cuda.stream(self.stream):
            self._copy(out, back)
            event = torch.cuda.Event()
            event.record(self.stream)
        if self.last_event is not None:  # blocks copied out last step may be overwritten now
            main.wait_event(self.last_event)
        if back or plan.wait_for_copies:  # this step reads loaded blocks / overwrites copied ones
            main.wait_event(event)
            self.last_event = None
        else:
            self.last_event = event

    def _copy(self, out: list[tuple[int, int]], back: list[tuple[int, int]]) -> None:
        """Device → host, then host → device, a staging buffer's worth of blocks at a time:
        per KV tensor one gather (scatter) kernel, per run of consecutive host blocks one copy."""
        if self.staging is None:
            rows = max(1, self.STAGING_BYTES // self.block_bytes)
            self.staging = torch.empty((rows, self.block_bytes), dtype=torch.uint8, device=self.device)
        rows = self.staging.shape[0]
        for i in range(0, len(out), rows):
            self._to_host(out[i:i + rows])
        for i in range(0, len(back), rows):
            self._from_host(back[i:i + rows])

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a host sync (through pinned memory): a blocking
        copy would wait for the step in flight, which the side stream waits for."""
        t = torch.tensor(ids, dtype=torch.long)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _runs(ids: list[int]):
        """(position, first id, length) of the runs of consecutive ids."""
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                yield start, ids[start], i - start
                start = i

    def _to_host(self, pairs: list[tuple[int, int]]) -> None:
        n = len(pairs)
        idx = self._index([d for d, _ in pairs])
        st = self.staging[:n]
        for t, (a, b) in zip(self.kv, self.cols):
            st[:, a:b].copy_(t.index_select(0, idx))
        # in plan order: a host block written twice in one plan keeps the later copy
        for pos, h, k in self._runs([h for _, h in pairs]):
            self.host[h:h + k].copy_(st[pos:pos + k], non_blocking=True)

    def _from_host(self, pairs: list[tuple[int, int]]) -> None:
        n = len(pairs)
        st = self.staging[:n]
        for pos, h, k in self._runs([h for h, _ in pairs]):
            st[pos:pos + k].copy_(self.host[h:h + k], non_blocking=True)
        idx = self._index([d for _, d in pairs])
        for t, (a, b) in zip(self.kv, self.cols):
            t.index_copy_(0, idx, st[:, a:b])
