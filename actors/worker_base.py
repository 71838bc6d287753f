"""What every worker actor shares: an engine on its own thread, token streams, and
the small control surface (ping, abort, stats, accounting).

Worker classes are plain Python classes; `cluster/` turns them into Ray actors with
`ray.remote(cls).options(...)` (resources and labels from the manifest). They are
async actors: methods run on one event loop, the engine on `EngineLoop`'s thread, and
blocking transfers on the worker's thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import ray
import torch

from actors.abort_marks import AbortMarks
from actors.background import background_task, every
from actors.config import EngineConfig, ModelLocation
from actors.deadlines import within
from actors.engine import Engine
from actors.engine_loop import EngineLoop
from actors.event_log import CacheEvents, Cursor
from actors.kv_store import KVStoreSettings
from actors.messages import GenerateRequest, PrefillStep, ProfileRunning
from actors.profiler import EngineProfile, profile_engine
from actors.startup_heap import freeze_startup_heap
from actors.step_profile import StepProfile
from actors.store_imports import StoreImports
from actors.token_streams import TokenStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    transfer_timeout_s: float = 30.0  # one chunk's transfer, end to end
    reservation_ttl_s: float = 60.0  # a reservation no chunk came for in this long is freed
    watchdog_interval_s: float = 0.5  # how often D checks its pending reservations, any worker its feeds' owners
    pipelined_transfer: bool = True  # False: P sends all KV after its last chunk (to compare)
    kv_store: KVStoreSettings | None = None  # None: no tiers behind the device pool
    stream_interval: int = 1  # new tokens a request's token event waits for (`actors.token_streams`)


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int
    num_channels: int
    last_step_s: float
    num_store_loaded_blocks: int = 0  # prompt blocks served by the KV store, not computed
    node_id: str = ""  # the Ray node (whose KV store the worker uses)
    num_waiting_handshakes: int = 0  # a decode worker's handshakes waiting for KV blocks
    num_waiting_blocks: int = 0  # the KV blocks those handshakes ask for
    num_reservations_granted: int = 0  # a decode worker's reservations since it started
    num_reserved_blocks: int = 0  # KV blocks a decode worker holds only for prompts whose KV is still coming
    num_free_seqs: int | None = None  # requests a decode worker may take before its batch is full; None: no bound
    num_preemptions: int = 0  # running requests preempted (by recompute) for room, since the worker started
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, since the worker started
    num_accepted_draft_tokens: int = 0  # ... those its samples confirmed
    prefill_steps: tuple[PrefillStep, ...] = ()  # the latest prompt-only steps, timed (actors/prefill_steps.py)
    profile_error: str | None = None  # why it failed: the engine could not step, so it runs no request


@dataclass(frozen=True)
class WorkerStartup:
    """Wall-clock times of a worker's start, for explaining slow scale-ups."""

    process_started: float  # the actor's process was created
    init_started: float  # its constructor began (Ray worker boot and imports before this)
    ready: float  # its engine was built

    def describe(self, requested: float) -> str:
        """Where the time went since `requested` (when the actor was asked for). Ray
        may place an actor in a worker process it started ahead (its idle pool):
        that process was up before the request."""
        up = self.process_started - requested
        process = (f"process up {up:.1f} s after the request (node, scheduling)" if up >= 0
                   else f"a Ray worker process up since {-up:.1f} s before the request")
        return (f"{process}, boot and imports {self.init_started - max(self.process_started, requested):.1f} s, "
                f"engine {self.ready - self.init_started:.1f} s")


class WorkerBase(StoreImports):
    def __init__(
        self,
        worker_id: str,
        model: str | ModelLocation,
        engine_config: EngineConfig,
        options: WorkerOptions | None = None,
    ) -> None:
        init_started = time.time()
        self.worker_id = worker_id
        self.options = options or WorkerOptions()
        model_dir = model.resolve() if isinstance(model, ModelLocation) else model
        self.engine = Engine(model_dir, self._engine_config(engine_config))
        self.startup = WorkerStartup(_process_started(init_started), init_started, time.time())
        self.node = _current_node_id()
        self._open_kv_store(self.options.kv_store)
        self.executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"{worker_id}-io")
        self.loop: EngineLoop | None = None
        self._profiled: Future | None = None  # the start-up profile, once the engine thread runs (`profile`)
        self.streams: TokenStreams | None = None
        self.aio: asyncio.AbstractEventLoop | None = None
        self.abort_marks = AbortMarks()  # aborts asked, for requests still on their way here
        self._step_profile: StepProfile | None = None  # a trace of the engine's steps under way (engine thread)
        self._trace_written: str | None = None  # the latest trace that ended after its num_steps
        freeze_startup_heap()  # last: a full collection must never walk the engine (actors/startup_heap.py)

    def _engine_config(self, config: EngineConfig) -> EngineConfig:
        """Hook: the engine settings this kind of worker runs with."""
        return config

    # ---- start-up (on the actor's event loop) ---------------------------------
    def _ensure_started(self) -> None:
        if self.loop is not None:
            return
        self.aio = asyncio.get_running_loop()
        self.streams = TokenStreams(self.aio, self.options.stream_interval)
        self.loop = EngineLoop(self.engine, self._stepped, self._on_tick, self._on_engine_error)
        self.loop.start()
        self._profiled = self.loop.call(profile_engine)  # the engine thread's first call: before any request's
        self._feed_owners: dict[str, object] = {}  # subscription -> its consumer's actor handle
        # (a task of its own, not part of the request that starts the worker)
        background_task(every(self.options.watchdog_interval_s, self._watch_feed_owners,
                              f"{self.worker_id}'s feed watch"))
        self._on_started()

    def _on_started(self) -> None:
        """Hook: start background tasks."""

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps."""
        self._ensure_started()
        return await asyncio.wrap_future(self.loop.call(fn))

    async def in_thread(self, fn, *args):
        self._ensure_started()
        return await self.aio.run_in_executor(self.executor, fn, *args)

    async def prepare_pattern(self, request: GenerateRequest) -> None:
        """A structured-output request's automaton, and the vocabulary's bytes at the
        first one (actors/structured_output.py), made here, off the engine thread:
        up to about a second for the largest, once a pattern, which would stall
        every request's step there."""
        if request.params.regex is not None:
            await self.in_thread(self.engine.token_indexes.prepare, request.params.regex)

    # ---- a trace of the engine's steps (/start_profile, /stop_profile) ------------------
    async def start_profile(self, folder: str, num_steps: int | None = None, record_shapes: bool = False,
                            with_stack: bool = False) -> str:
        """Trace this worker's engine steps (actors/step_profile.py) until
        `stop_profile`, or for `num_steps`; returns the trace's path. Raises
        ProfileRunning if a trace is under way."""
        profile = StepProfile(folder, self.worker_id, num_steps, record_shapes, with_stack)

        def start(engine: Engine) -> None:
            if self._step_profile is not None:
                raise ProfileRunning(f"worker {self.worker_id} is tracing already (to {self._step_profile.path})")
            profile.start()
            self._step_profile, self._trace_written = profile, None

        await self.call(start)
        return str(profile.path)

    async def stop_profile(self) -> str | None:
        """End the trace under way and write it, or name the one that ended after
        its steps; None if there is neither."""
        def stop(engine: Engine) -> str | None:
            profile, self._step_profile = self._step_profile, None
            written, self._trace_written = self._trace_written, None
            return profile.stop() if profile is not None else written

        return await self.call(stop)

    # ---- engine-thread hooks ----------------------------------------------------
    def _stepped(self, exported, outputs) -> None:
        """After each step: the role's own hook, then the step's trace."""
        self._on_step(exported, outputs)
        if self._step_profile is not None and self._step_profile.step():
            profile, self._step_profile = self._step_profile, None
            try:
                self._trace_written = profile.stop()
            except Exception:  # (a trace that could not be written fails no request)
                log.exception("worker %s: the trace of its steps was not written", self.worker_id)

    def _on_step(self, exported, outputs) -> None:
        self.streams.publish(outputs)

    def _on_tick(self, engine: Engine) -> None:
        pass

    def _num_channels(self) -> int:
        """Open KV channels (P-D pairs) this worker holds."""
        return 0

    def _num_waiting_handshakes(self) -> int:
        """Handshakes waiting for this worker's KV blocks (a decode worker's)."""
        return 0

    def _num_waiting_blocks(self) -> int:
        """The KV blocks those handshakes ask for."""
        return 0

    def _num_reservations_granted(self) -> int:
        """Reservations this worker granted since it started (a decode worker's)."""
        return 0

    def _on_engine_error(self, exc: BaseException) -> None:
        """A step failed: fail every request this worker holds, keep serving."""
        message = f"worker {self.worker_id} step failed: {type(exc).__name__}: {exc}"
        log.error("%s; failing its %d requests", message, len(self.engine.requests), exc_info=exc)
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self.streams.fail(request_id, message)

    # ---- control surface --------------------------------------------------------
    async def ping(self) -> str:
        """Answers at once; the first starts the engine thread, and so the profile."""
        self._ensure_started()
        return self.worker_id

    async def startup_times(self) -> WorkerStartup:
        """Answers once the worker is up, like `ping`, with where its start went."""
        return self.startup

    async def node_id(self) -> str:
        """The Ray node this worker runs on (placement checks)."""
        return self.node

    # ---- token events ---------------------------------------------------------------
    async def feed(self, subscription: str, owner=None):
        """Every token event of the requests started here for `subscription`, as
        lists (`actors.token_streams`): a consumer's one Ray stream from this
        worker. Runs until the consumer cancels it or, when it names itself as
        `owner` (its actor handle), dies: Ray does not cancel a stream whose
        caller was killed, so without this a dead scheduler replica's requests
        would decode to their end. Its requests still running then are aborted."""
        self._ensure_started()
        if owner is not None:
            self._feed_owners[subscription] = owner
        try:
            async for batch in self.streams.batches(subscription):
                yield batch
        finally:
            self._feed_owners.pop(subscription, None)
            for request_id in self.streams.close(subscription):
                await self._drop(request_id, "the consumer's feed closed")

    async def _watch_feed_owners(self) -> None:
        """End the feeds whose consumers (scheduler replicas) died."""
        for subscription, owner in list(self._feed_owners.items()):
            if await self._is_dead(owner.__ray_ready__.remote()):
                self.streams.end(subscription)

    async def _is_dead(self, probe) -> bool:
        """Whether the actor a probe call (an ObjectRef) went to is dead; a slow or
        unreachable one is not (yet)."""
        try:
            await within(probe, self.options.watchdog_interval_s * 4)
        except ray.exceptions.ActorUnavailableError:
            return False  # unreachable for now, may come back
        except ray.exceptions.RayActorError:
            return True
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            return False  # busy for now
        return False

    async def _drop(self, request_id: str, reason: str) -> None:
        """Cancel a request nobody will read: free what it holds."""
        await self._end_failed(request_id, reason)

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Cancel a request wherever it is on this worker; frees its blocks. Its
        stream, if any, ends with an error event carrying `reason`."""
        return await self._end_failed(request_id, reason)

    async def _end_failed(self, request_id: str, reason: str) -> bool:
        """Free what `request_id` holds here and end its stream with an error
        event carrying `reason`, in one call on the engine thread, where a request
        starts (added, reserved): one that started first is ended, one that comes
        after finds its stream ended (`_aborted_on_its_way`) and does not start.
        Ending the stream after the call let a request start between the two and
        keep its blocks (decode) or run to its end (colocated) with nobody reading.
        Returns whether the engine held the request."""
        return await self.call(lambda engine: self._end_failed_on_engine(engine, request_id, reason))

    def _end_failed_on_engine(self, engine: Engine, request_id: str, reason: str) -> bool:
        """`_end_failed`'s work, on the engine thread."""
        self._release_aborted(request_id)
        out = engine.abort(request_id) or engine.cancel_reservation(request_id)
        if request_id in self.streams:
            self.streams.fail(request_id, reason)
        return bool(out)

    async def abort_named(self, client_rid: str | None, asked_s: float | None = None) -> list[str]:
        """`/abort_request`, asked at `asked_s` (wall time): end the requests
        streaming from here that the client named `client_rid` (every one for
        None) as aborted, with finish_reason "abort" and the tokens made so far,
        not as errors (which a scheduler would retry elsewhere); frees what they
        hold. Returns their ids. One that arrives later but was sent before the
        abort is ended as it would start (`abort_marks`)."""
        self._ensure_started()
        self.abort_marks.mark(client_rid, asked_s or time.time())
        request_ids = self.streams.named(client_rid)
        if request_ids:
            await self.end_aborted(request_ids)
        return request_ids

    async def end_aborted(self, request_ids: list[str]) -> None:
        """End requests here as aborted by their client (as `abort_named`), in one
        call on the engine thread, every stream's one writer; a request about to
        start here (added, reserved) finds its stream closed and does not."""
        self._ensure_started()

        def end(engine: Engine) -> None:
            for request_id in request_ids:
                self._release_aborted(request_id, also_ending=request_ids)
                output = engine.abort(request_id)
                engine.cancel_reservation(request_id)
                self.streams.end_aborted(request_id, output)

        await self.call(end)

    def _release_aborted(self, request_id: str, also_ending: Collection[str] = ()) -> None:
        """What this role holds for an ended request besides the engine's (on
        the engine thread); `also_ending`: the requests ended with it, each in
        turn, as aborted by their client (`end_aborted`)."""

    def _aborted_on_its_way(self, request: GenerateRequest) -> bool:
        """On the engine thread, as a request would start here (added, reserved):
        whether its client aborted it meanwhile, its stream ended by
        `end_aborted`, or before it came here (`abort_marks`)."""
        return not self.streams.is_open(request.request_id) or self.abort_marks.ends(request)

    async def stats(self) -> WorkerStats:
        """Load and KV figures now, read without waiting for the engine thread: a
        prefill step can take seconds, and the scheduler's refresh (membership,
        routing state) must not wait for the slowest worker's step. Each figure is
        one atomic read (a length or a counter); together they may be a step apart."""
        self._ensure_started()
        engine = self.engine
        return WorkerStats(
            worker_id=self.worker_id,
            num_blocks=engine.pool.num_blocks,
            num_used_blocks=engine.pool.num_used,
            num_cached_blocks=engine.pool.num_cached,
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_reserved=len(engine.reservations),
            num_channels=self._num_channels(),
            last_step_s=engine.runner.last_step_s,
            num_store_loaded_blocks=self.num_store_loaded_blocks,
            node_id=self.node,
            num_waiting_handshakes=self._num_waiting_handshakes(),
            num_waiting_blocks=self._num_waiting_blocks(),
            num_reservations_granted=self._num_reservations_granted(),
            num_reserved_blocks=engine.num_reserved_blocks,
            num_free_seqs=engine.num_free_seqs,
            num_preemptions=engine.scheduler.num_preemptions,
            num_draft_tokens=engine.num_draft_tokens,
            num_accepted_draft_tokens=engine.num_accepted_draft_tokens,
            prefill_steps=engine.prefill_steps.latest(),
            profile_error=self._profile_error(),
        )

    async def check_accounting(self) -> WorkerStats:
        """Assert the block pool's invariants; return the counts."""
        await self.call(lambda e: e.pool.check())
        return await self.stats()

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these KV blocks (for tests and debugging)."""
        return await self.call(lambda e: e.runner.kv_cache[torch.tensor(block_ids, dtype=torch.long)].cpu())

    async def prefix_block_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """Ids of this worker's cached blocks for a prompt's prefix (tests, routing)."""

        def lookup(engine: Engine) -> list[int]:
            from actors.block_pool import block_hashes

            hashes = block_hashes(prompt_token_ids, engine.pool.block_size, engine.scheduler.hash_seed)
            return engine.pool.lookup(hashes, prompt_token_ids)

        return await self.call(lookup)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix in the device pool (blocks in use keep theirs);
        the KV store keeps its copies."""
        await self.call(lambda e: e.pool.reset_cache())

    async def cache_events(self, cursor: Cursor | None = None) -> CacheEvents:
        """Prefix-cache events after the caller's `cursor`: (True, hash) stored,
        (False, hash) evicted; or a snapshot (see actors/event_log.py). Each global
        scheduler replica keeps its own cursor and prefix index. Read here, not on
        the engine thread, for the same reason as `stats`."""
        self._ensure_started()
        return self.engine.pool.events_since(cursor)

    async def profile(self) -> EngineProfile:
        """The start-up profile (prefill and decode-step timings) for cost models:
        run once, as the engine thread's first call, so before any request; the
        same one answered to every caller (each scheduler replica asks). Run on
        demand, as it was, it stepped the engine with whatever was live: a
        scheduler replica that started after another had sent requests profiled
        the worker under them, the profile's steps took their tokens, and they
        waited for the rest to their timeout (300 s; a fresh app's first
        requests, in about one start in ten of a one-off probe on 2 CPUs).
        Shielded: a caller that gives up (its own timeout, `ray.cancel`) before
        the engine thread has taken the call must not cancel the one profile
        every other caller, and `stats`, read."""
        self._ensure_started()
        return await asyncio.shield(asyncio.wrap_future(self._profiled))

    def _profile_error(self) -> str | None:
        """Why the start-up profile failed (None while it runs and once it has
        run): the engine could not run its first steps, so neither will it run a
        request's. Read through `stats`, by the schedulers (which route it
        nothing) and the pool manager (which starts another, see
        cluster/restart_backoff.py)."""
        if not self._profiled.done():
            return None
        if self._profiled.cancelled():  # (`profile` shields it; `exception()` would raise here)
            return "CancelledError: the start-up profile was cancelled"
        error = self._profiled.exception()
        return None if error is None else f"{type(error).__name__}: {error}"

    async def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _current_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _process_started(default: float) -> float:
    """Wall time this process was created (Linux /proc), or `default` elsewhere: now
    less its age, the uptime (10 ms resolution) less its start in clock ticks since
    boot. (The boot time in /proc/stat is whole seconds: up to a second off.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return default
