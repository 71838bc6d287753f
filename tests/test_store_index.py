"""Routing counts KV store tiers: a node's host and disk tiers serve only that node's
workers, the shared path serves every node; a chain counts while some index holds it."""

from __future__ import annotations

from actors.kv_store import KVStoreSettings
from cluster.router import PrefixIndex, match_any
from cluster.store_index import StoreIndex

CHAIN = [bytes([i]) * 32 for i in range(8)]


def test_node_tiers_and_shared_path_extend_the_device_prefix():
    index = StoreIndex(b"ns", KVStoreSettings(shared_path="/mnt/kv"))
    index.apply("node-a", {"host": [(True, h) for h in CHAIN[1:3]], "disk": [(True, CHAIN[3])],
                           "shared": [(True, h) for h in CHAIN[4:6]]})
    index.apply("node-b", {"host": [(True, CHAIN[6])], "shared": [(False, CHAIN[5])]})
    device = PrefixIndex(100)
    device.insert(CHAIN[:1])
    assert match_any([device, *index.indexes_for("node-a")], CHAIN) == 5  # device, host x2, disk, shared
    assert match_any([device, *index.indexes_for("node-b")], CHAIN) == 1  # A's tiers are not B's
    assert match_any(index.indexes_for("node-c"), CHAIN[4:]) == 1  # the shared path is everyone's
