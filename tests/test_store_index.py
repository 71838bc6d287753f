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
