"""Each decode worker's room for more requests, as one scheduler replica reckons
it between readings of D's stats (cluster/pool_view.py reads them): the blocks and
batch places D had free at the last reading, less what D's line then asked for, the
growth D keeps for this replica's requests (actors/decode_room.py), and what this
replica sent D since, and the prompt's blocks D holds already, which a reservation
shares (`held_prefix_blocks`). Admission's wait for D's blocks (`release_wait_s`,
the requests that joined D's line: `num_joined_line`) and the D choice's
`headroom` (cluster/service.py) read it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from actors.block_pool import blocks_to_reserve
from actors.decode_room import growth_blocks
from cluster.admission import InFlight
from cluster.router import match_any, num_common_blocks

if TYPE_CHECKING:
    from cluster.pool_view import PoolView


class DecodeRooms:
    def __init__(self, view: PoolView) -> None:
        self.view = view  # its stats as its refreshes read them, D's lines, this replica's requests in flight

    def headroom(self, worker_id: str) -> int:
        """D's free KV blocks now, as far as this replica knows: those free at the
        last reading of D's stats, less those the handshakes then in D's line ask
        for (they take what comes free first), less those of this replica's
        requests sent to D since (the reading does not show them yet), less the
        growth D keeps for this replica's requests there (actors/decode_room.py;
        the other replicas' are not known request by request). None at all
        where D's batch is full (`Engine.batch_full`: it holds `max_num_seqs`
        requests with its line's and those sent since): D grants the next
        reservation only as a request ends, whatever blocks are free, and a D
        routed to as if it had room kept the request in its line up to the
        handshake's wait. Counting no headroom while any handshake waited
        instead, a burst passing through an idle D's line (one engine-thread
        call each) read as a full D: admission predicted a 4.7 s wait there and
        answered 429."""
        room, seqs, sent = self._room_and_sent(worker_id)
        if len(sent) >= seqs:
            return 0
        return max(room - sum(blocks for _, blocks in sent), 0)

    def num_joined_line(self, worker_id: str) -> int:
        """This replica's requests that joined D's line since the last reading of
        D's stats: sent to D since, still in their handshake, and past the room
        `headroom` counts (blocks or places in D's batch), taken in the order
        they were sent (those the room held are granted as they come). Counting
        every request still in its handshake instead, a burst's own first
        requests read as a line ahead of its last (with the grant rate of
        readings before D's line, `tandem bench bursts --size 80 --prompt 96
        --output 160` had 49-78 of 320 answered 429, predicted at up to 14 s,
        while every first token served came within 3 s)."""
        room, seqs, sent = self._room_and_sent(worker_id)
        joined = 0
        for index, (request, blocks) in enumerate(sent):
            room -= blocks
            past_room = room < 0 or index >= seqs
            joined += past_room and request.prefill_id is not None and request.reserved_s is None
        return joined

    def release_wait_s(self, worker_id: str, needed_blocks: int, step_s: float) -> float | None:
        """How long until D frees `needed_blocks` more blocks than `headroom`
        leaves (what the requests ahead of one more in its line take first),
        and, where D's batch is full, until enough of its requests end for one
        more; from this replica's requests D holds: each runs to its
        `max_new_tokens` at `step_s` a token (as `WorkerModels.tbt_at` takes
        them to) and then frees its blocks and the growth D kept for it. Past
        what they hold, D is taken to free blocks at the pace they did (it turns
        its pool over again). None with nothing of this replica's on D to go by.
        For a D whose line no reading has shown yet (`DecodeLines.wait_s` is
        None): with no prediction there, the start of an overload admitted a
        second's arrivals whole, and D's line made them late. A request run to
        its end is the most it can take: one that stops early frees its blocks
        sooner."""
        room, seqs, sent = self._room_and_sent(worker_id)
        short = needed_blocks - (room - sum(blocks for _, blocks in sent))
        short_seqs = len(sent) + 1 - seqs  # requests that must end before D's batch takes one more
        if short <= 0 and short_seqs <= 0:
            return 0.0
        now = time.monotonic()
        releases = []
        for r in self.view.models.inflight.values():
            if r.decode_id != worker_id or r.reserved_s is None:
                continue
            first_token_in_s = 0.0 if r.first_token_s is not None else max((r.first_token_due_s or now) - now, 0.0)
            releases.append((first_token_in_s + (r.max_new_tokens - r.num_generated) * step_s, sum(self._blocks(r))))
        releases.sort()
        freed = 0
        for ended, (at_s, blocks) in enumerate(releases, 1):
            freed += blocks
            if freed >= short and ended >= short_seqs:
                return at_s
        if not freed or step_s <= 0:
            return None
        return releases[-1][0] * max(short / freed, short_seqs / len(releases))

    def held_prefix_blocks(self, worker_id: str, hashes: list[bytes]) -> int:
        """The prompt's first blocks the worker's device prefix cache holds for
        running requests, at least, as routing and its last reading knew them: a
        D's reservation shares those. A hit on a cached block no request holds
        saves nothing (D counts it free, and reusing it takes it from there:
        `BlockPool.can_hold`), and which hits are idle is not known here: at most
        the blocks the reading found cached and idle (on a D short of room, few).
        The blocks a request this replica has in flight on D shares with the
        prompt are held too, from D's reservation for it to its end, cached or
        still on their way (D lends those: actors/arriving_blocks.py): the first
        of a burst sharing a system prompt D holds idle revives it, and the rest
        share it (each was charged the whole prompt, and after D's next reading
        still, as its idle blocks, any prompt's, outnumbered the prompt's); a
        burst sharing a new one shares the first's blocks as they come.
        Its node's store tiers aside: blocks loaded from them are new blocks.
        None where the workers' prefix caches are off: a reservation shares nothing."""
        view = self.view
        index, stats = view.prefix.get(worker_id), view.stats.get(worker_id)
        held = 0
        if not view.settings.engine.enable_prefix_cache:
            return 0
        if index is not None and stats is not None:
            cached = match_any([index], hashes)
            held = max(cached - stats.num_cached_blocks, 0)
        for request in view.models.inflight.values() if held < len(hashes) else ():
            if request.decode_id == worker_id:
                held = max(held, num_common_blocks(request.prefix_hashes, hashes))
        return held

    def _blocks(self, request: InFlight) -> tuple[int, int]:
        """The blocks `request` holds on its D, and the growth D keeps for it
        (actors/decode_room.py)."""
        view = self.view
        num_tokens = request.num_prompt_tokens + request.num_generated
        held = blocks_to_reserve(num_tokens, view.block_size)
        return held, growth_blocks(num_tokens, request.num_generated, request.max_new_tokens, held,
                                   view.settings.engine.decode_reserve_tokens, view.block_size, view.max_model_len)

    def _room_and_sent(self, worker_id: str) -> tuple[int, int | float, list[tuple[InFlight, int]]]:
        """D's free blocks at the last reading of its stats, less those its line
        then asked for and the growth D keeps for this replica's requests read
        there; the requests D's batch then had places for, less its line's (no
        bound where D did not say); and this replica's requests sent to D since,
        in the order they were sent, each with the blocks it takes (its prompt's
        less those D held for running requests as it was sent, and its growth: a
        burst sharing a system prompt D serves was charged the prompt once a
        request)."""
        stats = self.view.stats.get(worker_id)
        if stats is None:
            return 0, 0, []
        seqs = math.inf if stats.num_free_seqs is None else stats.num_free_seqs - stats.num_waiting_handshakes
        read_at = self.view.lines.read_at_s(worker_id)
        room = stats.num_blocks - stats.num_used_blocks - stats.num_waiting_blocks
        sent = []
        for r in self.view.models.inflight.values():
            if r.decode_id != worker_id:
                continue
            held, owed = self._blocks(r)
            if read_at is not None and r.admitted_s > read_at:
                sent.append((r, max(held - r.decode_held_blocks, 0) + owed))
            else:
                room -= owed
        return room, seqs, sent
