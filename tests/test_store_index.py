"""Routing counts KV store tiers: a node's host and disk tiers serve only that node's
workers, the shared path serves every node; a chain counts while some index holds it."""

from __future__ import annotations

from actors.event_log import CacheEvents
from actors.kv_store import KVStoreSettings
from cluster.router import PrefixIndex, match_any
from cluster.store_index import StoreIndex

CHAIN = [bytes([i]) * 32 for i in range(8)]


def _events(reset: bool = False, **tiers) -> dict[str, CacheEvents]:
    return {tier: CacheEvents(("log", len(events)), reset, events) for tier, events in tiers.items()}


def test_node_tiers_and_shared_path_extend_the_device_prefix():
    index = StoreIndex(b"ns", KVStoreSettings(shared_path="/mnt/kv"))
    index.apply("node-a", _events(host=[(True, h) for h in CHAIN[1:3]], disk=[(True, CHAIN[3])],
                                  shared=[(True, h) for h in CHAIN[4:6]]))
    index.apply("node-b", _events(host=[(True, CHAIN[6])], shared=[(False, CHAIN[5])]))
    device = PrefixIndex(100)
    device.insert(CHAIN[:1])
    assert match_any([device, *index.indexes_for("node-a")], CHAIN) == 5  # device, host x2, disk, shared
    assert match_any([device, *index.indexes_for("node-b")], CHAIN) == 1  # A's tiers are not B's
    assert match_any(index.indexes_for("node-c"), CHAIN[4:]) == 1  # the shared path is everyone's


def test_a_snapshot_rebuilds_a_node_tier_and_adds_to_the_shared_path():
    index = StoreIndex(b"ns", KVStoreSettings(shared_path="/mnt/kv"))
    index.apply("node-a", _events(host=[(True, CHAIN[0]), (True, CHAIN[1])], shared=[(True, CHAIN[4])]))
    index.apply("node-b", _events(shared=[(True, CHAIN[5])]))
    index.apply("node-a", _events(reset=True, host=[(True, CHAIN[2])], shared=[(True, CHAIN[6])]))
    (host,) = index.node_tiers["node-a"].values()
    assert [h in host for h in CHAIN[:3]] == [False, False, True]  # what node A's host tier holds now
    assert all(h in index.shared for h in CHAIN[4:7])  # node B's view of the shared path stays


def test_a_store_that_does_not_answer_holds_up_no_refresh_and_is_asked_once_at_a_time(ray_local, monkeypatch):
    """A node store busy past STORE_ANSWER_S (a save on a hung NFS mount, say: it
    is a serial actor) kept the view's refresh, membership and worker stats with
    it, waiting. The refresh now goes on without it, does not ask it again while it
    answers the first question, and reads that answer at the next refresh. The
    store here is a real named actor answering when told (the thing under test is
    the index's refresh)."""
    import asyncio
    import time

    import ray

    from actors.kv_store_client import STORE_NAMESPACE, node_store_name
    from cluster import store_index

    @ray.remote
    class SlowStore:
        def __init__(self, events):
            self.events, self.num_asked, self.answer = events, 0, asyncio.Event()

        async def events_since(self, cursor):
            self.num_asked += 1
            await self.answer.wait()
            return self.events

        async def answer_now(self):
            self.answer.set()

        async def asked(self) -> int:
            return self.num_asked

    monkeypatch.setattr(store_index, "STORE_ANSWER_S", 0.3)
    settings = KVStoreSettings(shared_path="/mnt/kv")
    store = SlowStore.options(name=node_store_name("node-slow", b"ns", settings), namespace=STORE_NAMESPACE) \
        .remote(_events(host=[(True, CHAIN[0])]))
    index = StoreIndex(b"ns", settings)

    async def asked(count: int) -> None:  # (the index's calls come by a handle of its own: no order with ours)
        deadline = time.monotonic() + 10
        while await store.asked.remote() != count:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def refreshes():
        await store.asked.remote()  # (started)
        await asyncio.wait_for(index.refresh({"node-slow"}), 10)  # (waited for the store before: hung)
        await asked(1)
        await asyncio.wait_for(index.refresh({"node-slow"}), 10)
        await asyncio.sleep(0.5)  # (a second question, had it been asked, would be there by now)
        assert await store.asked.remote() == 1 and "node-slow" not in index.node_tiers
        await store.answer_now.remote()
        deadline = time.monotonic() + 10
        while "node-slow" not in index.node_tiers:  # the late answer, read at a refresh
            assert time.monotonic() < deadline
            await asyncio.wait_for(index.refresh({"node-slow"}), 10)
        assert await store.asked.remote() == 1 and CHAIN[0] in index.node_tiers["node-slow"]["host"]
        await asyncio.wait_for(index.refresh({"node-slow"}), 10)  # asked again, answered at once
        await asked(2)

    try:
        asyncio.run(refreshes())
    finally:
        ray.kill(store)
