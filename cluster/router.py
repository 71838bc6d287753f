"""Choosing the P and D for a request: policies and the scheduler's prefix index.

`PrefixIndex` is the scheduler's view of one worker's prefix cache, fed by the
worker's cache events (blocks stored and evicted, polled every refresh) and, between
polls, by the prompts the scheduler routed there. A routed prompt's blocks count as
held for `ROUTED_S`, or until the worker's events say it stored them (then they are
its) or evicted them: a prompt the worker never caches (its prefix cache off, a
retry on another pair, an abort before its prefill) left hits that stayed until
LRU pushed them out, and cache-aware routing sent every request of that prefix to
a worker that did not hold it (a review's repro: 16 of 256 tokens predicted to
compute, all 256 computed). Kept apart, routed blocks no longer push the worker's
own out either: the index, LRU-bounded by the worker's block count, dropped a
chain's first blocks first, which the worker keeps longest. A stale entry costs
only a worse prediction, never wrong output: the worker verifies tokens itself.

Policies pick P among candidates that each carry a `Prediction`:
- `round_robin`: in turn, blind to load and cache;
- `least_load`: the least queued prefill work;
- `cache_aware`: the lowest predicted TTFT, which counts prefix hits (Mooncake's
  cache- and load-aware choice), as the cost models predict it: without the
  learned bias, the tail of their misses that admission adds (`CacheAware`).
D is picked in `GlobalScheduler.plan`: within the TBT SLO the least busy, then the
most KV headroom, then the least routed to; past the SLO the fastest.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from actors.event_log import CacheEvents
from cluster.admission import Prediction


ROUTED_S = 10.0  # how long a routed prompt's blocks count as held without the worker's word


class PrefixIndex:
    def __init__(self, capacity_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = max(1, capacity_blocks)
        self._hashes: OrderedDict[bytes, None] = OrderedDict()  # the worker's, as its events say
        self._routed: OrderedDict[bytes, float] = OrderedDict()  # routed here, not yet stored: hash -> until
        self._clock = clock

    def __contains__(self, block_hash: bytes) -> bool:
        return self._holds(block_hash, self._clock())

    def _holds(self, block_hash: bytes, now: float) -> bool:
        return block_hash in self._hashes or self._routed.get(block_hash, now) > now

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of this chain the worker likely holds."""
        now, count = self._clock(), 0  # (one reading of the clock for the chain: planning calls this per worker)
        for block_hash in hashes:
            if not self._holds(block_hash, now):
                break
            count += 1
        return count

    def route(self, hashes: Sequence[bytes]) -> None:
        """A prompt routed to this worker: its blocks count as held until its events
        say, or for `ROUTED_S` (bounded by the capacity too)."""
        now = self._clock()
        for block_hash in hashes:
            if block_hash not in self._hashes:
                self._routed[block_hash] = now + ROUTED_S
                self._routed.move_to_end(block_hash)
        while self._routed and (len(self._routed) > self.capacity or next(iter(self._routed.values())) <= now):
            self._routed.popitem(last=False)  # (in the order they expire: each routed moved to the end)

    def apply(self, events: Sequence[tuple[bool, bytes]]) -> None:
        """A worker's cache events: (True, hash) stored, (False, hash) evicted."""
        for stored, block_hash in events:
            self._routed.pop(block_hash, None)
            if stored:
                self.insert([block_hash])
            else:
                self._hashes.pop(block_hash, None)

    def update(self, batch: CacheEvents) -> None:
        """Events read from a cache's log (actors/event_log.py); a snapshot replaces
        what the index held."""
        if batch.reset:
            self._hashes.clear()
        self.apply(batch.events)

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Blocks the worker holds (stored events; tests)."""
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


def match_any(indexes: Sequence[PrefixIndex], hashes: Sequence[bytes]) -> int:
    """Leading blocks of the chain that some index holds (device cache, store tiers)."""
    count = 0
    for block_hash in hashes:
        if not any(block_hash in index for index in indexes):
            break
        count += 1
    return count


def num_common_blocks(chain: Sequence[bytes], hashes: Sequence[bytes]) -> int:
    """How many leading blocks two prompts' hash chains share."""
    return next((i for i, (a, b) in enumerate(zip(chain, hashes)) if a != b), min(len(chain), len(hashes)))


def _worker(candidate: Prediction) -> str:
    """The worker a candidate's prefill runs on (its P, or the colocated worker)."""
    return candidate.prefill_id or candidate.decode_id


class PrefillPolicy:
    """Picks one candidate. `queued_s`: predicted prefill seconds still queued per
    worker; `inflight`: requests the scheduler has in flight per worker (the
    tie-break, so a busy worker never ties with an idle one)."""

    name = "base"

    def choose(self, candidates: list[Prediction], queued_s: dict[str, float], inflight: dict[str, int]) -> Prediction:
        raise NotImplementedError


class RoundRobin(PrefillPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates, queued_s, inflight):
        return candidates[next(self._turn) % len(candidates)]


class LeastLoad(PrefillPolicy):
    name = "least_load"

    def choose(self, candidates, queued_s, inflight):
        return min(candidates, key=lambda c: (queued_s.get(_worker(c), 0.0), inflight.get(_worker(c), 0)))


class CacheAware(PrefillPolicy):
    """Ranks by the modelled TTFT (queue, prefill of the uncached tokens, transfer,
    D's line), leaving out each P's learned bias: that is a quantile of its recent
    misses, there for the SLO check (`WorkerModels.observe_ttft`), and a P's few
    samples of it differ by chance: a first request's cold start (300 ms on the
    tiny model) outweighed any prefix hit and sent every request to the other P
    until it faded. A P that runs late now shows in its queue (`queued_prefill_s`
    counts overdue requests); admission still checks the choice with its bias."""

    name = "cache_aware"

    def choose(self, candidates, queued_s, inflight):
        return min(candidates, key=lambda c: (c.ttft_s - c.ttft_bias_s, c.uncached_tokens, inflight.get(_worker(c), 0)))


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoad, CacheAware)}


def make_policy(name: str) -> PrefillPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
