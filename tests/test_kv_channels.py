"""Conformance tests every KV channel backend must pass: the bytes that arrive are
the bytes that were sent, in order, for each dtype and shape a KV chunk takes."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.kv_channel import (
    GlooPair,
    GlooReceiver,
    GlooSender,
    NcclPair,
    NcclReceiver,
    ObjectStoreReceiver,
    ObjectStoreSender,
    StoreReceiver,
    StoreSender,
    nccl_available,
)

BLOCK_SHAPE = (2, 2, 16, 2, 32)  # layers, K/V, block size, KV heads, head dim


def _gloo_pair(name):
    store, port = GlooPair.host_store("127.0.0.1", 10)
    receiver_box = {}
    joiner = threading.Thread(target=lambda: receiver_box.setdefault("r", GlooReceiver(GlooPair(name, "127.0.0.1", port, 1, 10))))
    joiner.start()
    sender = GlooSender(name, GlooPair(name, "127.0.0.1", port, 0, 10, store))
    joiner.join()
    return sender, receiver_box["r"]


def _object_store_pair(name):
    return ObjectStoreSender(name), ObjectStoreReceiver()


def _store_pair(name):
    import re
    import tempfile

    shared, name = tempfile.mkdtemp(prefix="tandem-shared-"), re.sub(r"[^\w.-]", "_", name)
    return StoreSender(name, shared), StoreReceiver(name, shared)


BACKENDS = {
    "gloo": _gloo_pair,
    "object_store": _object_store_pair,
    "store": _store_pair,
}


def transfer(sender, receiver, kv: torch.Tensor) -> torch.Tensor:
    """One chunk, the way P and D drive it: D starts receiving, P pushes."""
    box = {}
    payload = sender.payload(kv)
    thread = threading.Thread(target=lambda: box.setdefault("kv", receiver.recv(tuple(kv.shape), kv.dtype, payload)))
    thread.start()
    sender.push(kv)
    thread.join(timeout=30)
    assert not thread.is_alive(), "receive did not complete"
    return box["kv"]


@pytest.fixture(params=list(BACKENDS.values()), ids=list(BACKENDS))
def channel(request):
    sender, receiver = request.param(f"conformance-{request.node.name}")
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_blocks", [1, 3, 8])
def test_bytes_arrive_unchanged(channel, dtype, num_blocks):
    sender, receiver = channel
    kv = torch.randn(num_blocks, *BLOCK_SHAPE).to(dtype)
    got = transfer(sender, receiver, kv)
    assert got.dtype == dtype and got.shape == kv.shape
    assert torch.equal(got.contiguous().view(torch.uint8), kv.view(torch.uint8))  # bit for bit


def test_chunks_arrive_in_order(channel):
    sender, receiver = channel
    chunks = [torch.full((i + 1, *BLOCK_SHAPE), float(i)) for i in range(5)]
    for chunk in chunks:
        assert torch.equal(transfer(sender, receiver, chunk), chunk)


def test_a_non_contiguous_selection_of_blocks(channel):
    """P sends `kv_cache[block_ids]` for scattered ids: the copy must be faithful."""
    sender, receiver = channel
    cache = torch.randn(20, *BLOCK_SHAPE)
    ids = torch.tensor([7, 2, 15, 3])
    assert torch.equal(transfer(sender, receiver, cache[ids]), cache[ids])


def test_object_store_receiver_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        ObjectStoreReceiver().recv((2, *BLOCK_SHAPE), torch.float32, torch.zeros(1, *BLOCK_SHAPE))


def test_store_receiver_refuses_foreign_names_and_corrupt_chunks(tmp_path):
    sender, receiver = StoreSender("pair", tmp_path), StoreReceiver("pair", tmp_path)
    with pytest.raises(ValueError, match="not one this channel writes"):
        receiver.recv((1, *BLOCK_SHAPE), torch.float32, "../../etc/passwd")
    name = sender.payload(torch.randn(1, *BLOCK_SHAPE))
    path = sender.dir / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        receiver.recv((1, *BLOCK_SHAPE), torch.float32, name)
    assert not path.exists()  # a bad chunk is not left behind
    sender.close()
    assert not sender.dir.exists()


# ---- nccl: two actors, one GPU each (a process holds one rank of a group) ---------
class _NcclEnd:  # pragma: no cover - needs two GPUs
    """One end of an NCCL pair inside a Ray actor, driven the way the workers drive
    it: sends and receives enqueued from a thread on the legacy default stream."""

    def open(self, name: str, rank: int) -> None:
        self.pair = NcclPair(name, rank)
        self.receiver = NcclReceiver(self.pair)

    def send(self, kv: torch.Tensor) -> None:
        self.pair.send(kv.cuda())
        torch.cuda.synchronize()

    def recv(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return self.receiver.recv(shape, dtype, None).cpu()  # .cpu() waits for the receive


@pytest.mark.skipif(not nccl_available() or torch.cuda.device_count() < 2, reason="NCCL P2P needs two GPUs")
def test_nccl_pair_between_two_actors(ray_local):  # pragma: no cover - needs two GPUs
    end = ray_local.remote(num_gpus=1)(_NcclEnd)
    p, d = end.remote(), end.remote()
    ray_local.get([p.open.remote("conformance-nccl", 0), d.open.remote("conformance-nccl", 1)], timeout=120)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for num_blocks in (1, 3, 8):
            kv = torch.randn(num_blocks, *BLOCK_SHAPE).to(dtype)
            got = d.recv.remote(tuple(kv.shape), dtype)
            ray_local.get(p.send.remote(kv), timeout=60)
            got = ray_local.get(got, timeout=60)
            assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))


def test_chunks_never_read_are_swept_when_a_store_channel_opens(tmp_path):
    """A P that died left its unread chunk files under `<shared>/transfer/`, where
    no tier's sweep goes: they stayed for good. A new channel removes those an
    hour old, and their folders, and keeps the recent ones."""
    import os
    import time

    from actors.kv_channel import ABANDONED_CHUNK_S, StoreSender, transfer_dir

    dead = transfer_dir(tmp_path, "kv-p0-d0-dead")
    live = transfer_dir(tmp_path, "kv-p1-d0-live")
    for folder in (dead, live):
        folder.mkdir(parents=True)
    old = time.time() - ABANDONED_CHUNK_S - 60
    for path in (dead / ("a" * 32 + ".kv"), dead / ("b" * 32 + ".tmp"), live / ("c" * 32 + ".kv")):
        path.write_bytes(b"x")
        if path.parent == dead:
            os.utime(path, (old, old))
    os.utime(dead, (old, old))
    StoreSender("kv-p2-d0-new", tmp_path)
    assert not dead.exists() and [p.name for p in live.iterdir()] == ["c" * 32 + ".kv"]
