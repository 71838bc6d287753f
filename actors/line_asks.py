"""The KV blocks the handshakes in a decode worker's line ask for, a prefix they
share counted once.

A handshake waits in D's line (actors/reservation_queue.py) until D grants its
reservation, and D's stats say what the line asks for (`num_waiting_blocks`),
which admission takes from D's free room (cluster/decode_rooms.py). Counted as
each prompt's whole reservation, a burst sharing a system prompt, passing through
the line one engine call each, read as asking for the prompt once a request: 8
handshakes of 536 tokens asked for 272 blocks of a D with 208 free, where they
take about 32 (the first allocates the prefix or revives it, the rest share it, or
borrow it on its way: actors/arriving_blocks.py). Admission saw no room, predicted
a wait of 0.7 to 1.5 s for D's blocks and answered 429 (docs/benchmarks.md,
session 60).

So a handshake's ask leaves out its leading blocks that D holds for a request (in
use, or on their way) or that a handshake ahead of it in the line will hold.
Cached blocks no request holds count once, for the first to ask: it takes them
from D's free room. An estimate read off the engine thread, by hash alone. A
prompt is hashed the first time the line's total is asked for while it waits, not
as it joins: most handshakes leave the line within an engine call, and hashing a
32k-token prompt takes about 7 ms of D's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class _Ask:
    num_blocks: int  # the blocks its reservation takes
    prompt_token_ids: Sequence[int]
    shareable: Sequence[bytes] | None = None  # the hashes of its blocks a reservation may share, once hashed


class LineAsks:
    def __init__(self, shareable_hashes: Callable[[Sequence[int]], Sequence[bytes]]) -> None:
        self._shareable_hashes = shareable_hashes  # a prompt's -> the hashes of its blocks a reservation may share
        # Request id -> its ask, in the order the handshakes joined the line: the order D grants them in
        self._asks: dict[str, _Ask] = {}

    def add(self, request_id: str, num_blocks: int, prompt_token_ids: Sequence[int]) -> None:
        self._asks[request_id] = _Ask(num_blocks, prompt_token_ids)

    def remove(self, request_id: str) -> None:
        self._asks.pop(request_id, None)

    def total(self, held: Callable[[bytes], bool]) -> int:
        """The blocks the line takes: each handshake's less its leading blocks
        `held` by D for a request, or shared with one ahead of it."""
        ahead: set[bytes] = set()
        total = 0
        for ask in list(self._asks.values()):
            if ask.shareable is None:
                ask.shareable = self._shareable_hashes(ask.prompt_token_ids)
            shared = 0
            for block_hash in ask.shareable:
                if block_hash not in ahead and not held(block_hash):
                    break
                shared += 1
            total += ask.num_blocks - shared
            ahead.update(ask.shareable)
        return total
