"""Paged KV-cache bookkeeping: block pool with an LRU free list, prefix caching by chained block
hashes, ref-counted sharing. The device tensors themselves live in the model runner; this module
only hands out block ids.

A block's hash is H(parent_hash, its token ids, extra keys); the first block's extra keys hold the
cache salt, so tenants with different salts never share. A free block keeps its hash (and stays
findable) until it is reused, so the free list doubles as the prefix cache's LRU eviction order.

Sliding-window models (every attention layer with the same window W, e.g. Mistral): a block whose
tokens all lie before the window of a request's next query (position < num_computed - W + 1) is
released at the request's next allocation, and its place in the request's block list becomes the
null block (id 0, reserved, never handed out), so block tables keep their logical layout; the
attention kernels never read blocks outside the window. Admission therefore counts only a
request's live window plus its new tokens. Prefix caching stays correct conservatively: a hit
needs every block of the prefix still cached (released window blocks stay findable until evicted,
like any freed block), and the blocks of a hit that lie outside the window are never taken (the
null block stands in for them).
Models that mix sliding and full layers keep every block (their kernels still skip the dead ones).

With `--kv-offload-size` a host tier sits behind it (runtime/kv_offload.py): freed cached blocks
are copied to host memory, and a lookup that misses here continues there.
"""
from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict

from .kv_offload import HostHit, HostTierManager
from .request import Request


def make_hasher(algo: str):
    if algo == "sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    if algo == "xxhash":
        import xxhash
        return lambda obj: xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5))
    raise ValueError(f"unknown prefix-caching hash {algo!r} (sha256 or xxhash)")


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null: bool = False):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block 0 as the null block (sliding windows): a placeholder, never free, never cached
        self.null = self.blocks[0] if reserve_null else None
        self.free: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null)
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        self.on_evict = None  # called with a block id when a cached block is reused (host tier)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[Block]:
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)  # least recently used first
            if block.block_hash is not None:  # evict it from the prefix cache
                if self.on_evict is not None:
                    self.on_evict(block.block_id)
                self.forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        # callers pass tail blocks first so a request's last blocks are evicted first
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} freed twice"
            if b.ref_cnt == 0:
                self.free[b.block_id] = b

    def forget(self, block: Block) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def register(self, block: Block, block_hash: bytes) -> None:
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", num_host_blocks: int = 0, sliding_window: int = 0):
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window (0: full attention)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, reserve_null=sliding_window > 0)
        self.num_blocks = num_blocks - (sliding_window > 0)  # usable blocks
        self.enable_caching = enable_prefix_caching
        self.hash = make_hasher(hash_algo)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_registered: dict[str, int] = {}  # blocks of a request already in the cache
        self.prefix_queries = 0
        self.prefix_hits = 0
        # the host tier (--kv-offload-size): None when off
        self.offload = HostTierManager(num_host_blocks) if num_host_blocks > 0 and enable_prefix_caching else None
        if self.offload is not None:
            self.pool.on_evict = self.offload.on_evict

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def update_hashes(self, req: Request) -> None:
        """Extend the request's chain of full-block hashes to cover its known tokens."""
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            extra = ()
            if i == 0:  # the chain's root: the cache salt and the LoRA adapter key every block
                lr = getattr(req, "lora_request", None)
                extra = ((req.cache_salt,) if req.cache_salt else ()) + (
                    ("lora", lr.lora_int_id) if lr is not None else ())
            req.block_hashes.append(
                self.hash((parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]), extra)))

    def get_computed_blocks(self, req: Request) -> tuple[list[Block | HostHit], int]:
        """Longest cached prefix of full blocks, each on the device (a Block) or, with the host
        tier, in host memory (a HostHit). The last token is always recomputed, so a full hit
        never yields a zero-length query."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None and self.offload is not None:
                block = self.offload.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, req: Request, num_cached: int, computed: list | None = None) -> None:
        """Count a lookup once, when its request is admitted (not at every blocked attempt):
        the device tier's hits, and the host tier's (of the tokens the device missed)."""
        if self.enable_caching:
            host = 0
            if self.offload is not None:
                host = sum(1 for b in computed or () if type(b) is HostHit) * self.block_size
                self.offload.record_lookup(req.num_tokens - (num_cached - host), host)
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_cached - host

    def release_outside_window(self, req: Request, num_computed: int) -> None:
        """Sliding window: release the request's blocks wholly before the window of a query at
        position `num_computed` (they become the null block in its list)."""
        blocks = self.req_blocks.get(req.request_id)
        if not self.sliding_window or not blocks:
            return
        dead = self._num_dead(num_computed)
        gone = [b for b in blocks[:dead] if b is not self.pool.null]
        if gone:
            blocks[:dead] = [self.pool.null] * dead
            self.pool.release(gone)
            if self.offload is not None:
                self._to_host(gone)

    def _num_dead(self, num_computed: int) -> int:
        """Blocks wholly before the window of a query at position `num_computed` (0: no window)."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int, computed: list[Block]) -> int:
        have = len(self.req_blocks.get(req.request_id, ())) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[Block] | None = None, num_ahead: int = 0) -> list[int] | None:
        """Reserve blocks for `num_new_tokens` more tokens (after the cached prefix `computed`).
        The last `num_ahead` of them are slots this step computes no token of the request's KV
        in (speculative decoding: drafts, a proposer's lookahead): their blocks are not
        registered for prefix hits yet (a chunk cut by the budget has known tokens there).
        Returns the ids of newly added blocks, or None if the pool cannot supply them."""
        self.release_outside_window(req, req.num_computed_tokens)
        if not computed:  # the common decode case: usually no new block, nothing to register
            total = req.num_computed_tokens + num_new_tokens
            need = -(-total // self.block_size) - len(self.req_blocks.get(req.request_id, ()))
            if need <= 0:
                done = total - num_ahead
                if self.enable_caching and done // self.block_size > self.num_registered.get(req.request_id, 0):
                    self._register_full_blocks(req, done)
                return []
        computed = computed or []
        need = self.blocks_needed(req, num_new_tokens, computed)
        num_hit = len(computed) * self.block_size
        # a prefix hit's blocks before the window of its first query are never read: the null
        # block stands in for them (taking them could wait forever for blocks released at once)
        dead = self._num_dead(req.num_computed_tokens + num_hit) if computed else 0
        live = computed[dead:]
        from_host = sum(1 for b in live if type(b) is HostHit) if self.offload else 0
        # cached blocks that sit in the free list are taken out of it by touch()
        evictable_hits = sum(1 for b in live if type(b) is Block and b.ref_cnt == 0)
        if need + from_host > self.pool.num_free - evictable_hits:
            return None
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if from_host:
            live = self._load_from_host(live)
        else:
            self.pool.touch(live)
        new = [self.pool.null] * dead + live + self.pool.take(need)
        blocks.extend(new)
        if self.enable_caching:
            self._register_full_blocks(req, req.num_computed_tokens + num_hit + num_new_tokens - num_ahead)
        return [b.block_id for b in new]

    def _load_from_host(self, computed: list) -> list[Block]:
        """Device blocks for a prefix hit that is partly in the host tier: device hits as they
        are, a fresh block (registered at once, filled by the plan's copy) for each host hit."""
        self.pool.touch([b for b in computed if type(b) is Block])  # before take() evicts
        hits = [b for b in computed if type(b) is HostHit]
        self.offload.reserve(hits)  # take() may copy evicted blocks out: not into these
        fresh = iter(self.pool.take(len(hits)))
        out = []
        for b in computed:
            if type(b) is HostHit:
                block = next(fresh)
                self.pool.register(block, b.block_hash)
                self.offload.load(b, block.block_id)
                b = block
            out.append(b)
        return out

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        self.update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        start = self.num_registered.get(req.request_id, 0)
        end = min(num_tokens // self.block_size, len(req.block_hashes), len(blocks))
        for i in range(start, end):
            if blocks[i] is not self.pool.null:
                self.pool.register(blocks[i], req.block_hashes[i])
        self.num_registered[req.request_id] = max(start, end)

    def free(self, req: Request, num_valid_tokens: int | None = None, to_host: bool = True) -> None:
        """Release the request's blocks. Blocks past `num_valid_tokens` were allocated for a step
        that will not run: drop them from the prefix cache, their KV was never written.
        `to_host` False (a preemption that recomputes): none of them goes to the host tier."""
        held = self.req_blocks.pop(req.request_id, [])
        self.num_registered.pop(req.request_id, None)
        if num_valid_tokens is not None:  # (indexed before the window's null blocks are dropped)
            for b in held[num_valid_tokens // self.block_size:]:
                if b is not self.pool.null and b.ref_cnt == 1 and b.block_hash is not None:
                    self.pool.forget(b)
        blocks = [b for b in held if b is not self.pool.null]
        self.pool.release(list(reversed(blocks)))
        if self.offload is not None and to_host:
            self._to_host(list(reversed(blocks)))

    def _to_host(self, blocks: list[Block]) -> None:
        """Cached blocks nobody holds any more go to the host tier."""
        for b in blocks:
            if b.ref_cnt == 0 and b.block_hash is not None:
                self.offload.on_free(b.block_id, b.block_hash)

    def check_invariants(self) -> None:
        """Every block is owned (ref_cnt = number of holders) or free, exactly once."""
        holders: dict[int, int] = {}
        null = self.pool.null
        for rid, blocks in self.req_blocks.items():
            blocks = [b for b in blocks if b is not null]
            assert len({b.block_id for b in blocks}) == len(blocks), "a block held twice"
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
            if null is not None:  # null blocks only before the live window, contiguous
                live = self.req_blocks[rid]
                k = sum(b is null for b in live)
                assert all(b is null for b in live[:k]), f"{rid}: a null block inside the window"
        if null is not None:
            assert null.block_id not in self.pool.free and null.block_hash is None
        for b in self.pool.blocks:
            if b is null:
                continue
            assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id} ref_cnt"
            assert (b.block_id in self.pool.free) == (b.ref_cnt == 0), f"block {b.block_id} free"
            if b.block_hash is not None:
                assert self.pool.cached.get(b.block_hash) is b, f"block {b.block_id} hash"
        assert len(self.pool.free) + len(holders) == self.num_blocks
        if self.offload is not None:
            self.offload.check_invariants(self.pool)

    def trim(self, req: Request, num_tokens: int) -> bool:
        """Speculative decoding: keep only the blocks of the first `num_tokens` tokens (rejected
        drafts and a proposer's lookahead wrote past them). Blocks past the known tokens were
        never registered in the prefix cache."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return False
        gone = blocks[keep:]
        del blocks[keep:]
        for b in gone:
            if b.ref_cnt == 1 and b.block_hash is not None:
                self.pool.forget(b)
        self.pool.release(list(reversed(gone)))
        self.num_registered[req.request_id] = min(self.num_registered.get(req.request_id, 0), keep)
        return True

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, ())]

    def reset_prefix_cache(self, host: bool = True) -> bool:
        """Forget every cached block (only when no request holds one); the host tier's too
        unless `host` is False (sleep level 1 keeps it: its contents stay valid)."""
        if self.pool.num_free != self.num_blocks:
            return False
        for b in self.pool.blocks:
            if b is self.pool.null:
                continue
            b.block_hash = None
        self.pool.cached.clear()
        if self.offload is not None:
            self.offload.reset(host)
        return True
