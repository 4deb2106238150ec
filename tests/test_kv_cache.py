"""KV-cache accounting: every block returns to the pool after any mix of finish, abort and
preemption; shared prefix blocks are ref-counted."""
import random

from rankserve.runtime.config import CacheConfig, SchedulerConfig
from rankserve.runtime.kv_cache import KVCacheManager
from rankserve.runtime.messages import EngineCoreRequest, FinishReason
from rankserve.runtime.request import Request
from rankserve.runtime.sampling_params import SamplingParams
from rankserve.runtime.model_runner import ModelRunnerOutput
from rankserve.runtime.scheduler import Scheduler


def mkreq(rid, ids, max_tokens=8, salt=None):
    return Request(EngineCoreRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                     arrival_time=float(len(rid)), cache_salt=salt), 512)


def test_shared_prefix_is_ref_counted_and_lru_evicted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = mkreq("a", list(range(10))), mkreq("b", list(range(10)))
    assert kv.allocate_slots(a, 10) is not None
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.ref_cnt for h in hits] == [1, 1]
    kv.allocate_slots(b, 2, hits)
    assert [h.ref_cnt for h in hits] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    # cached blocks survive in the free list until their space is needed
    c = mkreq("c", list(range(10)))
    assert kv.get_computed_blocks(c)[1] == 8
    big = mkreq("big", list(range(100, 132)))
    assert kv.allocate_slots(big, 32) is not None  # takes all 8 blocks, evicting the cache
    assert kv.get_computed_blocks(mkreq("d", list(range(10))))[1] == 0
    kv.free(big)
    assert kv.num_free_blocks == 8


def test_random_mix_of_finish_abort_preempt_returns_every_block():
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24),
                      CacheConfig(block_size=4), num_blocks=20, max_model_len=512)
    prefixes = [list(range(k, k + 9)) for k in (0, 50)]
    n = 0
    for _step in range(400):
        if rng.random() < 0.3 and n < 60:
            ids = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 12))]
            sched.add_request(mkreq(f"r{n}", ids, max_tokens=rng.randrange(1, 15)))
            n += 1
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests([rng.choice(list(sched.requests))], FinishReason.ABORT)
        plan = sched.schedule()
        # fake runner: a token for each request whose scheduled tokens reach its end
        done = [rid for rid, k in plan.num_scheduled_tokens.items()
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        sched.update(plan, ModelRunnerOutput(done, [rng.randrange(500) for _ in done]))
        sched.check_invariants()  # every block owned (ref_cnt = holders) or free, exactly once
    while sched.has_work:
        plan = sched.schedule()
        done = [rid for rid in plan.num_scheduled_tokens
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        sched.update(plan, ModelRunnerOutput(done, [7] * len(done)))
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == 20
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_host_tier_keeps_evicted_prefixes_and_loads_them_back():
    """Freed cached blocks are queued, copied out with the next step, found there after the
    device evicted them; a hit takes fresh device blocks registered at once and listed as loads;
    the host tier evicts its least recently used entry, never one a queued load reads."""
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=3)
    host = kv.offload
    a = mkreq("a", list(range(13)))  # 3 full blocks + 1 token
    kv.allocate_slots(a, 13)
    kv.free(a)
    assert sorted(host.pending) == [0, 1, 2]  # the partial 4th block was never cached
    host.begin_step()
    to_host, from_host, wait = host.take_copies()
    assert sorted(d for d, _ in to_host) == [0, 1, 2] and not from_host and not wait
    kv.check_invariants()
    big = mkreq("big", list(range(100, 116)))
    kv.allocate_slots(big, 16)  # takes all 4 device blocks: the device tier forgets a's
    assert not host.take_copies()[0]  # already in the host tier: not copied again
    b = mkreq("b", list(range(13)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and all(type(h).__name__ == "HostHit" for h in hits)
    assert kv.allocate_slots(b, 1, hits) is None  # no device block free: nothing changes
    kv.free(big)
    kv.check_invariants()
    assert kv.allocate_slots(b, 1, hits) is not None
    kv.record_lookup(b, n, hits)
    assert (host.queries, host.hits, kv.prefix_hits) == (13, 12, 0)
    dev = kv.block_ids(b)[:3]
    assert host.from_host == [(h.host_id, d) for h, d in zip(hits, dev)]
    assert kv.get_computed_blocks(mkreq("c", list(range(13))))[1] == 12  # now on the device too
    # a full host tier evicts its LRU entry, but not one a queued load reads
    assert host.tier.store(b"new") is None and len(host.tier.lru) == 3
    out, back, wait = host.take_copies()
    assert back and wait  # the forward waits for loads
    kv.free(b)
    kv.check_invariants()
    assert kv.reset_prefix_cache() and not host.tier.lru and not host.pending


def test_host_blocks_about_to_be_loaded_are_not_reused_by_evictions():
    """Taking fresh device blocks for a host hit may evict a block still waiting to be copied
    out (freed in the same step, e.g. by a preemption); its copy must not land in a host block
    the hit is about to load."""
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=3)
    host = kv.offload
    a = mkreq("a", list(range(13)))
    kv.allocate_slots(a, 13)
    kv.free(a)
    host.begin_step()
    host.take_copies()  # a's 3 full blocks fill the host tier
    big = mkreq("big", list(range(100, 116)))
    kv.allocate_slots(big, 16)
    kv.free(big)  # 4 cached blocks waiting to be copied out (no step started since)
    b = mkreq("b", list(range(13)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    kv.allocate_slots(b, 1, hits)  # evicts big's blocks from the device: host tier is busy
    out, back, _ = host.take_copies()
    assert {h for _, h in out}.isdisjoint({h for h, _ in back}), (out, back)
    assert sorted(h for h, _ in back) == sorted(h.host_id for h in hits)
    kv.free(b)
    kv.check_invariants()
