"""The local batch scheduler: which requests run this step, and how many tokens each.

Plain Python over a `BlockPool`; no torch. One `schedule()` call returns a
`SchedulerOutput` (the plan); the engine runs it, then calls `update()` with the same
plan. Policy:
- Running requests first, in arrival order: a decode takes 1 token, a request still
  prefilling takes a chunk of at most `prefill_chunk_size` tokens; all under the
  step's token budget (`max_num_batched_tokens`). Chunks need not align with blocks.
- When a running request needs a block and none is free, the most recently admitted
  running request is preempted by recompute (blocks released, counters reset, back
  to the front of the waiting queue).
- Then waiting requests, oldest first, up to `max_num_seqs` running, each starting
  from its longest prefix-cache hit (never the last token: its logits are needed).
  One whose next block a running request is computing waits (`_waits_for_prefix`):
  it will find the block cached once that request's chunk has run, and a burst of
  requests sharing a new system prompt computes it once, not once per request the
  step's budget admits (SGLang's in-batch prefix caching defers such requests too).
  Blocks a worker imported from the KV store for a waiting request are held until
  it is admitted, unless memory runs short: they go before anyone is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from actors.block_pool import BlockPool, block_hashes, num_usable_blocks
from actors.config import EngineConfig
from actors.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:  # not frozen: one a request a step, and frozen construction costs 3x
    request: Request
    num_new_tokens: int  # draft tokens included
    start: int  # request.num_computed_tokens when scheduled
    # Drafts to verify after the chunk's known tokens (a decode's one, or the text
    # jump-forward wrote): their KV computed after them, a token sampled at the last
    # known token and at each draft.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def known_end(self) -> int:
        """The end of the request's own tokens in this chunk (drafts follow)."""
        return self.end - len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """One known token (and any drafts): a decode row a token, not a prefill span."""
        return self.num_new_tokens - len(self.draft_token_ids) == 1

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens (a token is sampled)."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, hash_seed: bytes = b"") -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.hash_seed = hash_seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start, for stats and tests

    # ---- bookkeeping ---------------------------------------------------------
    def prepare(self, request: Request) -> None:
        """Hash the prompt's full blocks (for prefix-cache lookups)."""
        request.block_hashes = block_hashes(request.prompt_token_ids, self.block_size, self.hash_seed)

    def add(self, request: Request) -> None:
        self.prepare(request)
        self.waiting.append(request)

    def cached_prefix(self, request: Request, computes_prompt: bool = True) -> list[int]:
        """Block ids of the request's longest cached prefix, never covering its last
        token (whose logits are needed). Takes no references. None for a request
        whose prompt is computed here for its logprobs, until they are all in:
        they come from computing every position (a decode worker's reservation
        still reuses its cache, and so does a request preempted after its prompt,
        which recomputed the whole prompt, one a decode worker never computed)."""
        if not self.config.enable_prefix_cache or (computes_prompt and request.params.prompt_logprobs is not None
                                                   and not request.has_all_prompt_logprobs):
            return []
        return self.pool.lookup(self.usable_hashes(request), request.all_token_ids)

    def usable_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's blocks a cache may serve: its full blocks
        but the one holding its last token (whose logits are needed)."""
        return request.block_hashes[:num_usable_blocks(request.num_tokens, self.block_size)]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a request wherever it is and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.block_table)
        request.block_table = []
        self.unpin(request)
        request.status = RequestStatus.FINISHED

    def unpin(self, request: Request) -> None:
        """Drop the hold on blocks imported for this request (see `Request`)."""
        self.pool.release(request.pinned_block_ids)
        request.pinned_block_ids = []

    def add_running(self, request: Request) -> None:
        """Adopt a request whose KV is already in its block table (a decode worker
        activating a transferred prompt)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_table))

    # ---- planning ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The step: every running request's known tokens first (preempting the
        latest ones where blocks run out), then waiting requests, then drafts
        from the budget and blocks left: no one is preempted, or left out of the
        step, for a guess. (Drafts before the waiting, 60 requests drafting 16
        tokens each took 1020 of a 1024-token budget, and a new prompt waited
        as long as they drafted: vLLM schedules drafts with their running
        requests, before its waiting ones.)"""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Request, int]] = []  # (request, its known tokens this step)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_pending_tokens, self.config.prefill_chunk_size, budget)
            if self._grow(request, request.num_computed_tokens + num_new):
                planned.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            if self._release_waiting_pins():
                continue  # try again before preempting anyone
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
        admitted = []
        deferred = []  # (back at the queue's front, in order, after the loop)
        computing = self._prompt_blocks_in_compute() if self.waiting else set()
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if computing and self._still_waits(request, computing):
                deferred.append(self.waiting.popleft())
                continue
            hits = self.cached_prefix(request)  # (pins released below leave these cached)
            if computing and self._waits_for_prefix(request, hits, computing):
                deferred.append(self.waiting.popleft())
                continue
            chunk = self._admit(request, budget, hits)
            if chunk is None and self._release_waiting_pins():
                chunk = self._admit(request, budget, hits)
            if chunk is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(chunk)
            budget -= chunk.num_new_tokens
            if self.config.enable_prefix_cache:
                computing.update(request.block_hashes[chunk.start // self.block_size:])
        self.waiting.extendleft(reversed(deferred))
        for request, num_new in planned:
            drafts = self._drafts(request, num_new, budget)
            budget -= len(drafts)
            out.chunks.append(ScheduledChunk(request, num_new + len(drafts), request.num_computed_tokens, drafts))
        out.chunks += admitted
        return out

    def _prompt_blocks_in_compute(self) -> set[bytes]:
        """The hashes of the prompt blocks running requests have yet to compute (each
        is published to the prefix cache once its chunk has run: `update`)."""
        if not self.config.enable_prefix_cache:
            return set()
        return {block_hash for request in self.running if request.num_computed_tokens < request.num_prompt_tokens
                for block_hash in request.block_hashes[request.num_computed_tokens // self.block_size:]}

    def _waits_for_prefix(self, request: Request, hits: list[int], computing: set[bytes]) -> bool:
        """Whether the block after the request's cached prefix (`hits`) is one a
        running request is computing: admitted now, it would compute it again.
        Notes the last of the blocks in compute that follow it, which the
        request waits for (`_still_waits`)."""
        request.awaited_block_hash = None
        if not hits and request.params.prompt_logprobs is not None and not request.has_all_prompt_logprobs:
            return False  # (it computes its whole prompt anyway)
        usable = self.usable_hashes(request)
        index = len(hits)
        if index < len(usable) and usable[index] in computing:
            request.num_blocks_cached_then = index
            while index + 1 < len(usable) and usable[index + 1] in computing:
                index += 1
            request.awaited_block_hash = usable[index]
        return request.awaited_block_hash is not None

    def _still_waits(self, request: Request, computing: set[bytes]) -> bool:
        """Whether a request that waits for blocks in compute (`_waits_for_prefix`)
        waits on without a new lookup: the last of them is still in compute and
        not yet cached, and the prefix it found cached is still there (with none,
        the first block it waits for is cached or in compute). A lookup walks the
        whole cached prefix, and a burst of requests behind a long new prompt
        walked it each, every step (a thousand behind an 8k-token one: 135 to
        205 ms a step, `tandem bench deferred`).

        The prefix is there while its last block is: free blocks are evicted in
        the order they were freed, and a table is freed tail first, so a chain's
        later blocks go before its earlier ones. A prefix lost meanwhile (evicted,
        `reset_cache`) means a new lookup, as every step made one before: the
        request may no longer gain by waiting. (Not seen: a loss in a chain whose
        blocks two requests computed, each holding part of the cached copies, as
        a prompt-logprobs one does; the request then waits longer, at most until
        that block is computed: 3 of 969 such waits in 300 seeded random
        workloads, compared with a lookup each time, in a review's harness.)"""
        block_hash = request.awaited_block_hash
        if block_hash is None or block_hash not in computing or self.pool.finds(block_hash):
            return False
        num_cached, hashes = request.num_blocks_cached_then, request.block_hashes
        if num_cached:
            return self.pool.finds(hashes[num_cached - 1])
        return hashes[0] in computing or self.pool.finds(hashes[0])

    def _drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The drafts a request verifies this step, its blocks grown for them: those
        proposed, within what is left of the step's token budget and of the pool,
        after a chunk of `num_new` tokens that reaches its last known token (its
        last drawn one, or the text jump-forward wrote after it)."""
        if not request.draft_token_ids or num_new != request.num_pending_tokens:
            return ()
        known_end = request.num_computed_tokens + num_new
        room = (len(request.block_table) + self.pool.num_available) * self.block_size - known_end
        drafts = tuple(request.draft_token_ids[: max(0, min(budget, room))])
        self._grow(request, known_end + len(drafts))  # (fits: `room`)
        return drafts

    def _release_waiting_pins(self) -> bool:
        """Under memory pressure, imported prefixes held for waiting requests go
        first (they stay cached, just evictable): they must never make a running
        request or the queue's head wait. Whether any were held."""
        held = [r for r in self.waiting if r.pinned_block_ids]
        for request in held:
            self.unpin(request)
        return bool(held)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        needed = self.blocks_needed(request, num_tokens)
        if needed > self.pool.num_available:
            return False
        request.block_table += self.pool.allocate(needed)
        return True

    def _admit(self, request: Request, budget: int, hits: list[int]) -> ScheduledChunk | None:
        """Start the request from its cached prefix `hits` (`cached_prefix`)."""
        self.pool.take(hits)
        self.unpin(request)
        request.block_table = list(hits)
        request.num_computed_tokens = len(hits) * self.block_size
        num_new = min(request.num_pending_tokens, self.config.prefill_chunk_size, budget)
        if not self._grow(request, request.num_computed_tokens + num_new):
            self.pool.release(request.block_table)
            request.block_table = []
            request.num_computed_tokens = 0
            return None
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
        return ScheduledChunk(request, num_new, request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.draft_token_ids = []  # (recomputed in chunks: the drafts would wait for its last one)
        request.awaited_block_hash = None  # (it waited for a block before it ran, if at all)
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def schedule_next_decodes(self, starts: list[tuple[Request, int]]) -> SchedulerOutput | None:
        """A decode chunk for each (request, position), planned while the step before
        is still running (the tokens it samples unknown here): a request of that
        step decodes at its chunk's end, a request that joins at its first pending
        token. None when that needs more blocks than are free or more tokens than
        a step's budget: a full `schedule()` after the step decides who waits."""
        if len(starts) > self.config.max_num_batched_tokens:
            return None
        # A block only when a sequence crosses into a new one (one step in block_size):
        # position `start` lies in block start // size.
        size = self.block_size
        growing = [(request, needed) for request, start in starts
                   if (needed := start // size + 1 - len(request.block_table)) > 0]
        if sum(needed for _, needed in growing) > self.pool.num_available:
            return None
        for request, needed in growing:
            request.block_table += self.pool.allocate(needed)
        return SchedulerOutput([ScheduledChunk(request, 1, start) for request, start in starts])

    # ---- after the step ------------------------------------------------------
    def update(self, chunks: list[ScheduledChunk]) -> None:
        """Advance counters for chunks that ran, and publish newly full blocks. A
        chunk's drafts count only once confirmed (`accept_drafts`)."""
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.known_end
            if self.config.enable_prefix_cache:
                self.publish_full_blocks(request, chunk.start // self.block_size)

    def accept_drafts(self, request: Request, num_accepted: int) -> None:
        """`num_accepted` drafts of the request's last step are now its tokens, their
        KV computed by that step: count them, publish the blocks they fill."""
        first = request.num_computed_tokens // self.block_size
        request.num_computed_tokens += num_accepted
        if self.config.enable_prefix_cache:
            self.publish_full_blocks(request, first)

    def publish_full_blocks(self, request: Request, first: int) -> None:
        """Register the request's full computed blocks from index `first` on."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= first:
            return
        all_ids = request.all_token_ids
        if len(request.block_hashes) < num_full:
            request.block_hashes = block_hashes(
                all_ids[: num_full * self.block_size], self.block_size, self.hash_seed, request.block_hashes
            )
        for index in range(first, num_full):
            start = index * self.block_size
            block_tokens = all_ids[start : start + self.block_size]
            self.pool.register(request.block_table[index], request.block_hashes[index], block_tokens)
