"""The engine: one model, one KV pool, one step loop (schedule -> run -> update).

Not thread-safe: one caller drives `step()`; the Ray actors wrap it with their own
loop. `add_request` validates and queues; `step` runs one batch and returns a
`RequestOutput` for every request that got a token or finished in it.

Overlapped decode (`EngineConfig.overlap_decode`, on by default on CUDA). A step's
host work (reading the tokens, stop checks, detokenizing, outputs, planning the next
step, building its inputs) takes about as long as a small model's decode step on a
GPU; done in turn, the device idles through it. So while the batch only decodes and
nothing else asks to be scheduled, `run_step` launches step N+1 before reading step
N's tokens: N+1's input ids are N's sampled ids, still on the device, and N+1's
positions and blocks follow from N's alone. Then it reads N's tokens, updates the
requests and returns N's outputs while N+1 runs. SGLang's overlap scheduler and
vLLM's async scheduling do the same; here the overlap is kept to runs of decode-only
steps with a fixed batch, where it pays, and the rest of the engine is unchanged:
- a request that N ends by length is left out of N+1 (its end is known);
- one that N ends otherwise (a stop token, a stop string) or that is aborted while
  N+1 runs wastes N+1's row: the token is dropped. Its blocks go back to the pool at
  once: all device work runs in order on the engine's stream, so N+1 writes before
  any later step does, and transfers wait for the latest step's event;
- a decode worker's activations (prompt KV received, first token known) join the
  next step with their token from the host; arrivals that need a prefill, and a
  short pool, end the run: N is read before anything is scheduled again
  (`schedule()` never runs with a step in flight);
- a penalised row counts its input token on the device (kernels/penalties.py);
- where a row's draw reads its output (a pattern's mask, a bad word of several
  tokens: `Request.reads_output`) only N+1's forward is launched ahead: it is
  sampled once N's tokens are read (`ModelRunner.sample_deferred`), before
  `run_step` returns, so the device computes N+1 while the host reads N and
  walks the patterns. A row after which jump-forward wrote text is stale: its
  token is dropped and the run ends (the text needs a chunk of its own);
- a request's draws follow from its seed and the index of the token being
  sampled (`kernels.sampling.uniform_draws`), never from the order of the calls,
  so outputs are identical either way (the CPU tests hold them to it).
On CPU the step runs while it is launched, so overlap saves nothing there and is off
unless asked for.

Speculative decoding (`EngineConfig.num_speculative_tokens`, off by default; then
no overlap): after the tokens a request takes in a step, `Drafter.propose` guesses
its next ones by prompt lookup; its next decode chunk carries them, a row a token,
and `_take_confirmed` keeps the samples for as long as the drafts match them, and
one more: the tokens of plain decoding (actors/speculation.py).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.arriving_blocks import ArrivingBlocks
from actors.bad_words import BadWords, encode_bad_words
from actors.block_pool import BlockPool, blocks_to_reserve, kv_namespace
from actors.config import CheckpointError, EngineConfig, ModelConfig
from actors.decode_room import owed_blocks, reservation_tokens
from actors.detokenizer import ByteLevelTables, IncrementalDetokenizer
from actors.host_tensors import int64_tensor
from actors.launched_step import LaunchedStep
from actors.model_runner import ModelRunner
from actors.output_writer import OutputWriter
from actors.prefill_steps import PrefillStepLog
from actors.request import FinishReason, Request, RequestOutput, SampledToken, TokenLogprob
from actors.sampling_params import InvalidRequestError, SamplingParams
from actors.scheduler import ScheduledChunk, Scheduler
from actors.speculation import Drafter, num_confirmed
from actors.stop_strings import StopStrings
from actors.store_bridge import StoreBridge
from actors.structured_output import TokenIndexes
from actors.tokenization import encode_prompt, load_engine_tokenizer


@dataclass(frozen=True)
class ExportedChunk:
    """A chunk of an `exports_kv` request computed in a step: its KV now covers
    tokens [0, end) in `block_ids` (a snapshot of the table, taken before the request
    may finish and release it)."""

    request_id: str
    start: int
    end: int
    block_ids: list[int]


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode engine holds for a prompt plus its first output token.
    The first `num_cached_blocks` hold the prompt's KV (prefix cache) or will hold
    it without this request's transfer: the last `borrowed_block_ids` of them are
    another reservation's, still on their way (actors/arriving_blocks.py).
    `arriving_block_ids`: this one's blocks that later reservations may borrow."""

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int
    borrowed_block_ids: list[int] = field(default_factory=list)
    arriving_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _StepInFlight:
    """A launched step whose tokens the engine has not read yet."""

    chunks: list[ScheduledChunk]
    launched: LaunchedStep

    @property
    def decodes_only(self) -> bool:
        """Every chunk a single-token decode that samples (one sampled row each)."""
        return len(self.launched.requests) == len(self.chunks) and all(c.num_new_tokens == 1 for c in self.chunks)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: " + ("a file, not a checkpoint folder" if model_dir.exists()
                                                      else "no such checkpoint folder"))
        self.config = config or EngineConfig()
        self.model_config = ModelConfig.from_hf(model_dir)
        self.tokenizer = load_engine_tokenizer(model_dir)  # (no transformers for a folder Tandem built)
        self.byte_level = ByteLevelTables.of(self.tokenizer, self.model_config.vocab_size)  # fast detokenizing
        self.token_indexes = TokenIndexes(None if self.byte_level is None else self.byte_level.without_special)
        self.runner = ModelRunner(self.model_config, self.config, model_dir)
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.pool = BlockPool(self.runner.num_blocks, self.config.block_size)
        self.kv_namespace = kv_namespace(model_dir, self.config.dtype, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.pool, self.kv_namespace)
        self.drafter = Drafter(self.config, self.max_model_len)  # speculative decoding (actors/speculation.py)
        self.writer = OutputWriter(self.tokenizer, self.byte_level, self.scheduler, self.max_model_len)
        # Between the pool and a KV store: prefix imports, write-through (its `sink`).
        self.store_bridge = StoreBridge(self.pool, self.runner, self.kv_namespace,
                                        self.config.enable_prefix_cache)
        self.requests: dict[str, Request] = {}
        self.reservations: dict[str, Request] = {}  # decode side: awaiting their KV
        self.arriving = ArrivingBlocks(self.config.block_size)  # ... and their blocks, for later ones to share
        # The blocks only reservations hold (one int: read off the engine thread), each reservation's
        # `_reserved_only` counted: those it allocated and the cached hits it revived, not those it shares
        # with running requests or borrows (counted again, a burst sharing a system prompt read as a decode
        # pool at rest: `num_used_blocks - num_reserved_blocks`, cluster/pool_autoscaler.py, came to 0).
        self.num_reserved_blocks = 0
        self._reserved_only: dict[str, int] = {}
        self._seed_rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_steps_launched_ahead = 0  # overlapped decode steps, since start
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, since start
        self.num_accepted_draft_tokens = 0  # ... and those the samples confirmed
        self.prefill_steps = PrefillStepLog()  # the latest prompt-only steps, timed: for the scheduler's cost model
        self._in_flight: _StepInFlight | None = None
        # The last step found nothing it could run: its requests wait for blocks held
        # elsewhere (transfers, reservations), which only a call frees (actors/engine_loop.py).
        self.stalled = False

    # ---- requests ------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams, bad_words: BadWords | None = None) -> None:
        """Refuse what cannot be served; `bad_words`: the params' (encoded here if not given)."""
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad_words = bad_words or encode_bad_words(self.tokenizer, params.bad_words, vocab)
        params.check_token_ids(vocab, self.model_config.eos_token_ids, bad_words and bad_words.always_banned)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len} "
                "tokens, prompt plus at least one new token"
            )
        needed = -(-min(len(prompt_ids) + params.max_new_tokens, self.max_model_len) // self.pool.block_size)
        if needed > self.pool.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks, the pool has {self.pool.num_blocks}; "
                "shorten the prompt or max_new_tokens"
            )

    def _new_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None) -> Request:
        prompt_ids = self.tokenize(prompt)
        bad_words = encode_bad_words(self.tokenizer, params.bad_words, self.model_config.vocab_size)
        self.validate(prompt_ids, params, bad_words)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests or request_id in self.reservations:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stop_token_ids = params.stop_ids(self.model_config.eos_token_ids)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, self.byte_level, prompt_ids),
            stop_strings=StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None,
            stop_token_ids=stop_token_ids,
            bad_words=bad_words,
            constraint=None if params.regex is None else self.token_indexes.constraint(params.regex, stop_token_ids),
            jumps_forward=params.regex is not None and params.logprobs is None and self.config.jump_forward,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids),
        )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        exports_kv: bool = False,
        pinned_block_ids: list[int] | None = None,
    ) -> str:
        """Queue a request. `pinned_block_ids` come from `StoreBridge.import_prefix`: the engine
        takes over their hold (released once the request is admitted or ends)."""
        try:
            request = self._new_request(prompt, params, request_id)
        except Exception:
            self.pool.release(pinned_block_ids or [])
            raise
        request.exports_kv = exports_kv
        request.pinned_block_ids = list(pinned_block_ids or [])
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    # ---- decode side of a P/D pair -------------------------------------------
    def reserve(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, pinned_block_ids: list[int] | None = None
    ) -> Reservation | None:
        """Hold blocks for the prompt plus the first output token, reusing what the
        prefix cache already has (including `pinned_block_ids` from `StoreBridge.import_prefix`,
        whose hold this ends). None when the pool cannot hold it now, with room
        kept for the next tokens of every request (`reservation_room`), or when the
        batch is full (`batch_full`)."""
        try:
            request = self._new_request(prompt_ids, params, request_id)
        finally:
            self.pool.release(pinned_block_ids or [])  # the prefix lookup below re-takes them
        if self.batch_full:
            return None
        self.scheduler.prepare(request)
        hits = self.scheduler.cached_prefix(request, computes_prompt=False)
        borrowed = []
        if self.config.enable_prefix_cache:  # (as the cached hits: the last token's block is sent)
            borrowed = self.arriving.match(self.scheduler.usable_hashes(request), request.prompt_token_ids, len(hits))
        shared = hits + borrowed
        num_tokens, num_kept_blocks = self.reservation_room(request.num_prompt_tokens, params)
        if not self.pool.can_hold(num_tokens, shared, num_kept_blocks):
            return None
        revived = sum(self.pool.blocks[block_id].ref_count == 0 for block_id in hits)  # (in no table until now)
        self.pool.take(shared)
        request.block_table = shared + self.pool.allocate(
            blocks_to_reserve(request.num_prompt_tokens, self.pool.block_size) - len(shared))
        arriving = []
        if self.config.enable_prefix_cache:
            arriving = self.arriving.add(request_id, request.block_hashes, request.block_table,
                                         request.prompt_token_ids, len(shared))
        self.reservations[request_id] = request
        self._reserved_only[request_id] = len(request.block_table) - len(shared) + revived
        self.num_reserved_blocks += self._reserved_only[request_id]
        return Reservation(request_id, list(request.block_table), len(shared), borrowed, arriving)

    @property
    def batch_full(self) -> bool:
        """Whether a decode engine holds `max_num_seqs` requests, running or
        reserved: the next reservation waits in D's line for one to end. (They
        started running past it: a batch past the budget of tokens a step leaves
        the requests at its back without a token until those ahead end, and on
        CUDA, one past the captured graphs is stepped without them.)"""
        return self.num_free_seqs <= 0

    @property
    def num_free_seqs(self) -> int:
        """Requests a decode engine may take before its batch is full (`batch_full`)."""
        return self.config.max_num_seqs - len(self.requests) - len(self.reservations)

    def reservation_room(self, num_prompt_tokens: int, params: SamplingParams) -> tuple[int, int]:
        """What a reservation must find free now (actors/decode_room.py): room for
        this many tokens of its own, and this many blocks besides, kept for the
        next tokens of the requests the engine holds."""
        reserve = self.config.decode_reserve_tokens
        held = [*self.requests.values(), *self.reservations.values()]
        return (reservation_tokens(num_prompt_tokens, params.max_new_tokens, reserve, self.max_model_len),
                owed_blocks(held, reserve, self.pool.block_size, self.max_model_len))

    def holds_block(self, block_hash: bytes) -> bool:
        """Whether a decode engine holds the block of this hash for a request: in
        use (running or reserved) or on its way (`arriving`). By hash alone, and
        safe off the engine thread (dict lookups): for estimates (actors/line_asks.py)."""
        return self.pool.in_use(block_hash) or block_hash in self.arriving

    def keep_arrived_blocks(self, request_id: str, num_blocks: int) -> None:
        """A reservation about to be cancelled whose first `num_blocks` blocks hold
        their KV (cached, or sent before it ended): make its full prompt blocks
        among them findable in the prefix cache. Without it their KV was freed
        unfindable, and the same prompt sent again was sent whole."""
        request = self.reservations.get(request_id)
        if request is None or not self.config.enable_prefix_cache:
            return
        request.num_computed_tokens = min(num_blocks * self.pool.block_size, request.num_prompt_tokens)
        self.scheduler.publish_full_blocks(request, 0)

    def cancel_reservation(self, request_id: str) -> bool:
        request = self.reservations.pop(request_id, None)
        if request is None:
            return False
        self.arriving.forget(request_id)
        self.num_reserved_blocks -= self._reserved_only.pop(request_id)
        self.pool.release(request.block_table)
        request.block_table = []
        return True

    def activate(self, request_id: str, first_token: SampledToken, seed: int | None,
                 prompt_logprobs: list | None = None, num_cached_tokens: int = 0) -> RequestOutput:
        """The prompt's KV is in the reserved blocks: start decoding after the first
        token (sampled by the prefill worker, with `seed`: the draws go on from it;
        the prompt's logprobs, if asked for, computed there too; and how many of
        its tokens the prefill worker found cached). Its borrowed blocks must hold
        their KV by now (the decode worker waits for them)."""
        request = self.reservations.pop(request_id)
        self.arriving.forget(request_id)  # (its blocks are published to the prefix cache below)
        self.num_reserved_blocks -= self._reserved_only.pop(request_id)
        self.requests[request_id] = request  # (from here a failure leaves it to `abort`, which frees its blocks)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = num_cached_tokens
        if seed is not None:
            request.seed = seed
        if self.config.enable_prefix_cache:
            self.scheduler.publish_full_blocks(request, 0)
        self.scheduler.add_running(request)
        self.writer.take_drawn(request, first_token.token_id, first_token.logprob, time.monotonic())
        if request.is_finished:
            del self.requests[request_id]
        elif self.drafter.can_draft(request):
            self.drafter.propose(request, len(self.scheduler.running))
        return request.output()

    # ---- prefill side of a P/D pair ------------------------------------------
    def hold_blocks(self, block_ids: list[int]) -> None:
        """Keep blocks from reuse while their KV is sent; `release_blocks` after."""
        self.pool.take(block_ids)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.pool.release(block_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.writer.finish(request, FinishReason.ABORT)
        return request.output()

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.run_step()[1]

    def run_step(self) -> tuple[list[ExportedChunk], list[RequestOutput]]:
        """One step. Returns the chunks of `exports_kv` requests it computed, and an
        output for every request that got a token or finished. With overlapped
        decode the step returned may be one launched by the previous call, and the
        next one is then already running (see the module docstring)."""
        step, self._in_flight = self._in_flight, None  # read once, even if what follows raises
        if step is None:
            if self.drafter.is_on:
                self.drafter.trim(self.scheduler.running)  # the drafts worth their rows
            plan = self.scheduler.schedule()
            self.stalled = not plan.chunks
            if self.stalled:
                return [], []
            step = _StepInFlight(plan.chunks, self.runner.launch(plan.chunks))
        self._in_flight = self._launch_next_decodes(step) if self.config.overlaps_decode else None
        finished = self._finish_step(step)
        if self._in_flight is not None and self._in_flight.launched.unsampled is not None:
            self.runner.sample_deferred(self._in_flight.launched)  # (its rows read what `step` sampled)
        return finished

    def _launch_next_decodes(self, step: _StepInFlight) -> _StepInFlight | None:
        """Launch the decode step after `step` before its tokens are read, when the
        batch only decodes, nobody waits for a seat it has free (a full batch
        admits no one until a request ends: it decoded without overlap all the
        while, under the load overlap is for; a review's probe) and the blocks are
        there. Requests that `step` ends by length are left out; running requests
        that were not in it and have one token pending (a decode worker's
        activations) join, their input token from the host."""
        if not step.decodes_only or step.launched.stale_rows:
            return None
        rows, starts, num_unfinished = [], [], 0
        for row, chunk in enumerate(step.chunks):
            request = chunk.request
            if request.is_finished:
                continue
            num_unfinished += 1
            if not self._next_token_is_last(request):
                rows.append(row)
                starts.append((request, chunk.end))
        # (a seat `step` frees by length counts as free: the waiting request is admitted a step sooner)
        num_ending = num_unfinished - len(rows)
        if self.scheduler.waiting and len(self.scheduler.running) - num_ending < self.config.max_num_seqs:
            return None
        # The step's unfinished requests are running (nothing is preempted while a
        # step is in flight): any other running request joins.
        joining = []
        if len(self.scheduler.running) > num_unfinished:
            in_step = {id(c.request) for c in step.chunks}
            joining = [r for r in self.scheduler.running if id(r) not in in_step]
            if any(r.num_pending_tokens != 1 for r in joining):
                return None  # a prompt still being computed: a full schedule
            starts += [(r, r.num_computed_tokens) for r in joining]
        plan = self.scheduler.schedule_next_decodes(starts) if starts else None
        if plan is None:
            return None
        device = step.launched.token_ids.device
        input_ids = step.launched.token_ids
        if len(rows) < len(step.chunks):
            input_ids = input_ids[int64_tensor(rows, device)]
        if joining:
            known = int64_tensor([r.token_ids_between(r.num_computed_tokens, r.num_tokens)[0] for r in joining], device)
            input_ids = torch.cat([input_ids, known])
        self.num_steps_launched_ahead += 1
        return _StepInFlight(plan.chunks, self.runner.launch(plan.chunks, input_ids))

    def _next_token_is_last(self, request: Request) -> bool:
        """Whether the token being sampled for `request` ends it by length."""
        return (len(request.output_token_ids) + 1 >= request.params.max_new_tokens
                or request.num_tokens + 1 >= self.max_model_len)

    def _finish_step(self, step: _StepInFlight) -> tuple[list[ExportedChunk], list[RequestOutput]]:
        """Read a launched step's tokens and bring its requests up to date. Requests
        aborted since its launch are skipped (their tokens dropped)."""
        token_ids, logprobs = self.runner.collect(step.launched)
        chunks = [c for c in step.chunks if not c.request.is_finished]
        self.scheduler.update(chunks)
        self.store_bridge.save_computed(chunks)
        self.num_steps += 1
        self.prefill_steps.record(self.num_steps, step.chunks, self.runner.last_step_s)
        blocks_for = lambda end: -(-end // self.pool.block_size)  # noqa: E731
        exported = [
            ExportedChunk(c.request.request_id, c.start, c.end, c.request.block_table[: blocks_for(c.end)])
            for c in chunks
            if c.request.exports_kv
        ]
        now = time.monotonic()
        outputs = []
        drafting = self.drafter.is_on
        drafts_of = {id(c.request): c.draft_token_ids for c in step.chunks if c.draft_token_ids} if drafting else {}
        if drafting and all(c.is_decode for c in step.chunks):
            self.drafter.step_costs.record(sum(c.num_new_tokens for c in step.chunks), self.runner.last_step_s)
        skip = 0  # rows still to pass: those of the drafts of the request just taken
        for row, request in enumerate(step.launched.requests):
            if skip:
                skip -= 1
                continue
            drafts = drafts_of.get(id(request)) if drafts_of else None
            if drafts:
                skip = len(drafts)
            if request.is_finished or row in step.launched.stale_rows:
                continue
            if drafts:
                end = row + 1 + len(drafts)
                self._take_confirmed(request, drafts, token_ids[row:end], logprobs and logprobs[row:end], now)
            else:
                self.writer.take_drawn(request, token_ids[row], None if logprobs is None else logprobs[row], now)
            if request.is_finished:
                del self.requests[request.request_id]
            elif drafting and self.drafter.can_draft(request):
                self.drafter.propose(request, len(self.scheduler.running))
            outputs.append(request.output())
        return exported, outputs

    def _take_confirmed(self, request: Request, drafts: tuple[int, ...], token_ids: list[int],
                        logprobs: list[TokenLogprob | None] | None, now: float) -> None:
        """A drafted decode's samples (one a row, `drafts` + 1): those the drafts
        confirm and the one after (actors/speculation.py), counted, then taken
        (`OutputWriter.take_confirmed`)."""
        num_stood = num_confirmed(drafts, token_ids)
        self.num_draft_tokens += len(drafts)
        self.drafter.record(request, len(drafts), num_stood)
        # (those taken into the output: not drafts that stood past a token that ended the request)
        self.num_accepted_draft_tokens += self.writer.take_confirmed(
            request, token_ids[: num_stood + 1], logprobs and logprobs[: num_stood + 1], now)
