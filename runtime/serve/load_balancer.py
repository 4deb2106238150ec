"""Which data-parallel replica serves a request (`--data-parallel-size N`, API process).

Load: a replica's requests in flight (counted here, so up to date at every pick) plus its
waiting queue and KV-cache usage as its engine last reported them (`SchedulerStats`): a queue
means the replica is saturated, a full KV cache means it is about to preempt, so both weigh on
top of the plain count.

Prefix-cache affinity: each request's prompt is cut into KV blocks and their chained hashes
(as the engine's prefix cache does) are remembered with the replica that got the request. A new
request goes to the replica that holds its longest remembered prefix, unless that replica is
busier than the least loaded one by more than `slack` (then load wins, as in SGLang's cache-aware
router). A request with no remembered prefix goes to the least loaded replica.
"""
from __future__ import annotations

from collections import OrderedDict

MAX_PREFIX_BLOCKS = 256  # hash at most this many leading blocks of a prompt
MAX_ENTRIES = 1 << 18  # remembered block hashes (LRU)


class LoadBalancer:
    def __init__(self, num_engines: int, block_size: int = 16, slack: float = 4.0,
                 waiting_weight: float = 1.0, kv_weight: float = 4.0):
        self.n = num_engines
        self.block_size = block_size
        self.slack = slack
        self.waiting_weight, self.kv_weight = waiting_weight, kv_weight
        self.inflight = [0] * num_engines
        self.waiting = [0] * num_engines
        self.kv_usage = [0.0] * num_engines
        self.served = [0] * num_engines  # requests sent to each replica (for tests and logs)
        self.affinity_hits = 0
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # block hash → replica

    def load(self, e: int) -> float:
        return self.inflight[e] + self.waiting_weight * self.waiting[e] + self.kv_weight * self.kv_usage[e]

    def _block_hashes(self, token_ids: list[int], salt) -> list[int]:
        bs, h, out = self.block_size, hash(("rankserve", salt)), []
        for i in range(min(len(token_ids) // bs, MAX_PREFIX_BLOCKS)):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def pick(self, token_ids: list[int], salt=None, count: int = 1) -> int:
        """The replica for a request of `count` sequences (n > 1 keeps them together)."""
        if self.n == 1:
            chosen = 0
        else:
            hashes = self._block_hashes(token_ids, salt)
            least = min(range(self.n), key=lambda e: (self.load(e), self.served[e]))
            chosen = least
            for h in reversed(hashes):  # the longest remembered prefix
                e = self.prefixes.get(h)
                if e is not None:
                    if self.load(e) - self.load(least) <= self.slack:
                        chosen = e
                        self.affinity_hits += e != least
                    break
            for h in hashes:
                self.prefixes[h] = chosen
                self.prefixes.move_to_end(h)
            while len(self.prefixes) > MAX_ENTRIES:
                self.prefixes.popitem(last=False)
        self.inflight[chosen] += count
        self.served[chosen] += 1
        return chosen

    def finished(self, e: int, count: int = 1) -> None:
        self.inflight[e] = max(0, self.inflight[e] - count)

    def record_stats(self, e: int, num_waiting: int, kv_usage: float) -> None:
        self.waiting[e], self.kv_usage[e] = num_waiting, kv_usage
