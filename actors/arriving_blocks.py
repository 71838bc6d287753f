"""A decode engine's prompt blocks still on their way, found by prefix hash.

D's reservation shares what its prefix cache holds, and a block is cached only
once its KV is in it (the request's activation publishes it). A burst of requests
that begin with a new system prompt reached D before any of them had landed, so
each reservation allocated the prompt's blocks again and each P sent them again:
16 requests sharing a 512-token prompt held 16 copies of it, and the burst
waited in D's line for room that sharing would have left (docs/benchmarks.md,
"Blocks still on their way").

So a reservation also registers its full prompt blocks here, the moment it is
granted, and the next reservation whose prompt begins the same way borrows them
after its cached hits: it takes a reference, and its P skips them as it skips the
cached ones (delta transfer). The borrower may then not start decoding until the
blocks are written; the decode worker holds its activation until they are, and
ends it if the owner ends before writing them (actors/decode_worker.py). Entries
leave when the owner's reservation activates (the blocks are then in the prefix
cache proper) or is cancelled (then those written go into the prefix cache:
`DecodeWorker._release_aborted`).

Plain Python, on the engine thread. The same hash chain as the prefix cache
(`block_pool.block_hashes`), tokens verified on a match.
"""

from __future__ import annotations

from collections.abc import Sequence


class ArrivingBlocks:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_hash: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (block id, its tokens)
        self._hashes_of: dict[str, list[bytes]] = {}  # owner request id -> the hashes it registered

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def add(self, owner: str, hashes: Sequence[bytes], block_ids: Sequence[int], token_ids: Sequence[int],
            first: int) -> list[int]:
        """Register the owner's full blocks from index `first` on (`hashes` and
        `block_ids` index by block); a hash already registered keeps its first
        owner. Returns the block ids registered."""
        added = []
        for index in range(first, len(hashes)):
            if hashes[index] in self._by_hash:
                continue
            start = index * self.block_size
            self._by_hash[hashes[index]] = (block_ids[index], tuple(token_ids[start:start + self.block_size]))
            self._hashes_of.setdefault(owner, []).append(hashes[index])
            added.append(block_ids[index])
        return added

    def match(self, hashes: Sequence[bytes], token_ids: Sequence[int], first: int) -> list[int]:
        """Block ids continuing a prefix that ends at block `first`, for as long as
        the chain goes on here (tokens verified). Takes no references."""
        found = []
        for index in range(first, len(hashes)):
            entry = self._by_hash.get(hashes[index])
            start = index * self.block_size
            if entry is None or entry[1] != tuple(token_ids[start:start + self.block_size]):
                break
            found.append(entry[0])
        return found

    def forget(self, owner: str) -> None:
        """The owner's reservation activated or ended: its blocks are no longer lent."""
        for block_hash in self._hashes_of.pop(owner, ()):
            del self._by_hash[block_hash]
