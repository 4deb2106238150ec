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
