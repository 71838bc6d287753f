"""What one scheduler replica knows of its pool, refreshed each second: the
members (from the pool manager), each worker's stats, prefix index and cache
cursor, the cost models (`WorkerModels`, with this replica's requests in flight),
decode lines, start failures, and readiness; and, from them, each D's room
(cluster/decode_rooms.py).

Each refresh sends the pool manager a report for its autoscaler
(cluster/scaling_signals.py): SLO outcomes, backlog and requests in flight; the
answer is the other replicas' load (`WorkerModels.peers`). Each replica reads
every worker's prefix-cache events from a cursor of its own (actors/event_log.py),
so all of them route by the whole cache. The scheduler (cluster/service.py)
admits and pairs by this view and runs requests; this file decides nothing.

A worker's answers to a refresh (stats, cache events, its start-up profile) are
waited for at most `WORKER_ANSWER_S`, and one late is asked again next time: one
worker that stopped answering (a node cut off, not yet declared dead) held the
refresh, and so this replica's reports: the pool manager forgot it after 30 s,
and a drain killed its worker under the requests it still had there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import ray

from actors.background import background_call
from actors.deadlines import within
from actors.event_log import CacheEvents, Cursor
from actors.messages import ProfileRunning, error_message
from cluster.actor_errors import actor_died, actor_unavailable
from cluster.admission import WorkerModels
from cluster.api_models import ApiError
from cluster.config import AppSettings
from cluster.cost_model import decode_features
from cluster.decode_lines import DecodeLines
from cluster.decode_rooms import DecodeRooms
from cluster.metrics import Metrics
from cluster.pool_settings import pools_keep, redeploy_refusal
from cluster.restart_backoff import StartFailure
from cluster.router import PrefixIndex, match_any, num_common_blocks
from cluster.scaling_signals import OutcomeRecorder, PeerLoad
from cluster.store_index import StoreIndex

log = logging.getLogger("tandem.scheduler")
WORKER_ANSWER_S = 5.0  # a worker's answer to one refresh's call, at most (then asked again at the next)


class PoolView:
    def __init__(self, settings: AppSettings, pool, kv_seed: bytes, metrics: Metrics,
                 outcomes: OutcomeRecorder, max_model_len: int) -> None:
        self.settings = settings
        self.pool = pool
        self.block_size = settings.engine.block_size
        self.max_model_len = max_model_len  # the workers' context: no request grows past it
        self.metrics = metrics
        self.outcomes = outcomes  # this replica's SLO outcomes: each refresh reports them
        self.models = WorkerModels(self.block_size, bias_quantile=settings.slo.attainment,
                                   prefill_chunk_size=settings.engine.prefill_chunk_size,
                                   max_num_batched_tokens=settings.engine.max_num_batched_tokens)
        self.lines = DecodeLines(settings.timeouts.handshake_s)  # waits for D's KV blocks, for admission
        self.members: dict[str, object] = {}  # worker_id -> Member
        self.stats: dict[str, object] = {}  # worker_id -> WorkerStats
        self.rooms = DecodeRooms(self)  # each D's room, as this replica reckons it
        self.prefix: dict[str, PrefixIndex] = {}
        self.cache_cursors: dict[str, Cursor] = {}  # worker_id -> where this replica read its cache events to
        self.store_index = StoreIndex(kv_seed, settings.kv_store.store_settings()) if settings.kv_store else None
        self.profiled: set[str] = set()
        self.start_failures: dict[str, StartFailure] = {}  # role -> its latest, from the pool manager (/health)
        self.num_routed: dict[str, int] = {}  # requests routed per decode (or colocated) worker
        self.ready = False
        self.pools_applied = False  # this deployment's pool sizes given to the pool manager (`refresh`)
        self.settings_kept: list[str] = []  # what the pools run that this deployment changes (`refresh`)

    async def refresh(self) -> None:
        """Members from the pool manager; stats (and a start-up profile) per worker.
        The first also gives the pool manager this deployment's pool sizes: a
        redeploy's, where the pools outlived the replicas before; unless the pools
        run settings this deployment changes (`_pools_keep_settings`)."""
        if not self.pools_applied:
            if await self._pools_keep_settings():
                return
            try:
                changed = await self.pool.apply_pools.remote(self.settings.model_dump())
                if changed:
                    log.info("settings of this deployment applied to the pools: %s", ", ".join(changed))
            except (ray.exceptions.RayTaskError, AttributeError) as exc:  # (AttributeError: an older pool manager)
                log.warning("could not apply this deployment's pool sizes: %s", exc)
            self.pools_applied = True
        members = await self.pool.list_members.remote()
        self.members = {m.worker_id: m for m in members}
        for gone in (set(self.stats) | self.profiled) - set(self.members):
            self._forget(gone)
        # A reading is as of when it was asked for: a request admitted while the calls
        # were on their way counts as sent since (`DecodeRooms`), not as in it.
        asked_s = time.monotonic()
        results = await asyncio.gather(*(within(m.handle.stats.remote(), WORKER_ANSWER_S) for m in members),
                                       return_exceptions=True)
        for member, stats in zip(members, results):
            if actor_died(stats):
                await self.report_dead(member.worker_id, member.handle)
            elif not isinstance(stats, BaseException) and self._still_listed(member):
                self.stats[member.worker_id] = stats
                if stats.profile_error is not None:  # never routed (a seeded one whose profile failed since)
                    self.profiled.discard(member.worker_id)
                if member.role == "decode":
                    self.lines.observe(member.worker_id, stats.num_reservations_granted, stats.num_waiting_handshakes,
                                       asked_s)
                self.prefix.setdefault(member.worker_id, PrefixIndex(stats.num_blocks))
                self.metrics.set("kv_blocks_used", "KV blocks in use per worker", stats.num_used_blocks,
                                 worker=member.worker_id, role=member.role)
                self.metrics.set("queue_depth", "requests waiting or running per worker",
                                 stats.num_waiting + stats.num_running, worker=member.worker_id, role=member.role)
                self.metrics.set("handshakes_waiting", "handshakes waiting in a decode worker's line for KV blocks",
                                 stats.num_waiting_handshakes, worker=member.worker_id, role=member.role)
                self.metrics.set_total("preemptions_total", "running requests preempted by recompute for KV room",
                                       stats.num_preemptions, worker=member.worker_id, role=member.role)
                self.metrics.set_total("draft_tokens_total", "speculative decoding: draft tokens verified",
                                       stats.num_draft_tokens, worker=member.worker_id, role=member.role)
                self.metrics.set_total("draft_tokens_accepted_total",
                                       "speculative decoding: draft tokens the samples confirmed",
                                       stats.num_accepted_draft_tokens, worker=member.worker_id, role=member.role)
                if member.role != "decode" and member.worker_id in self.profiled:
                    self.models.observe_prefill_steps(member.worker_id, stats.prefill_steps)
        indexed = [m for m in members if m.worker_id in self.prefix]
        batches = await asyncio.gather(
            *(within(m.handle.cache_events.remote(self.cache_cursors.get(m.worker_id)), WORKER_ANSWER_S)
              for m in indexed),
            return_exceptions=True,
        )
        for member, batch in zip(indexed, batches):
            if not isinstance(batch, BaseException):
                self._apply_cache_events(member.worker_id, batch)
        if self.store_index is not None:
            await self.store_index.refresh({s.node_id for s in self.stats.values() if s.node_id})
        members = [m for m in members if self._still_listed(m)]
        await self._profile_new(members)
        # (a draining worker takes no request: with only those, a role is not ready)
        roles = {m.role for m in members if m.worker_id in self.stats and m.worker_id in self.profiled
                 and not m.draining}
        needed = {"prefill", "decode"} if self.settings.mode == "disaggregated" else {"colocated"}
        self.ready = needed <= roles
        draining = [m.worker_id for m in members if m.draining]
        report = self.outcomes.report(list(self.models.inflight.values()), draining)
        try:  # (serving goes on without it: the autoscaler misses it for now)
            peers = await self.pool.report.remote(report)
        except AttributeError as exc:  # a pool manager left running by an older version (restart it to autoscale)
            log.warning("could not report to the pool manager: %s", exc)
            return
        except ray.exceptions.RayError as exc:
            self.outcomes.put_back(report)  # (not received: the next report carries its outcomes)
            log.warning("could not report to the pool manager: %s", exc)
            return
        self.models.peers = peers if isinstance(peers, PeerLoad) else PeerLoad()
        try:
            self.start_failures = await self.pool.start_failures.remote()
        except (ray.exceptions.RayError, AttributeError) as exc:
            log.warning("could not read the pool manager's start failures: %s", exc)

    async def _pools_keep_settings(self) -> bool:
        """Whether the pools run settings this deployment changes and cannot apply
        (cluster/pool_settings.py): then this replica routes nothing, and says why,
        until the pools are torn down (its next refresh starts new ones from its
        own settings) or the manifest they run is deployed again."""
        try:
            running = await self.pool.running_settings.remote()
        except AttributeError:  # an older pool manager: nothing to compare
            return False
        kept = pools_keep(running, self.settings.model_dump())
        changed, self.settings_kept = kept != self.settings_kept, kept
        if kept and changed:
            log.error("%s", self.settings_refusal)
        return bool(kept)

    @property
    def settings_refusal(self) -> str | None:
        """Why this replica routes nothing (pools keep settings this deployment
        changes), for /health and every request; None when it may route."""
        return redeploy_refusal(self.settings.pool_name, self.settings_kept) if self.settings_kept else None

    def health(self) -> tuple[int, dict]:
        """/health's status code and body: 200 "ready" once a worker of each role
        needed can be routed; until then 503, "starting", or "failing" when the
        latest start of a role failed. Either names those roles ("failing"): the
        worker, why, how many in a row, and when the pool manager starts the next
        (cluster/restart_backoff.py)."""
        if self.settings_kept:
            return 503, {"status": "failing", "settings_not_applied": self.settings_kept,
                         "error": self.settings_refusal}
        if self.ready:
            body = {"status": "ready", "pools": sorted({m.role for m in self.members.values()}),
                    "workers": len(self.members)}
        else:
            body = {"status": "failing" if self.start_failures else "starting"}
        if self.start_failures:
            body["failing"] = {role: dataclasses.asdict(failure) for role, failure in self.start_failures.items()}
        return (200 if self.ready else 503), body

    def _apply_cache_events(self, worker_id: str, batch: CacheEvents) -> None:
        """A worker's prefix-cache events since this replica's cursor, or a snapshot
        of its cache (a first read, or one that fell behind its log). None for a
        worker forgotten while they came (a KeyError that failed the refresh)."""
        index = self.prefix.get(worker_id)
        if index is None:
            return
        index.update(batch)
        self.cache_cursors[worker_id] = batch.cursor

    def _still_listed(self, member) -> bool:
        """Whether `member`, listed as a refresh began, still is: a request may have
        found it dead since (`report_dead`), at any of the refresh's awaits. Its
        answer stored after that, and a peer's profile seeded, made it routable
        again until the next refresh, every request sent to it a retry."""
        return self.members.get(member.worker_id) is member

    def replace_pool(self, pool) -> None:
        """A new pool manager replaced a dead one: its workers are new processes
        even where their ids repeat the old ones (p0, d1, ...), so nothing learned
        about the old workers (cost models, prefix indexes, stats) carries over;
        and this deployment's pools are given to it at the next refresh (a
        replica of an earlier manifest may have made it, from its own)."""
        self.pool = pool
        self.ready = False
        self.pools_applied = False
        for worker_id in set(self.members) | set(self.stats) | self.profiled:
            self._forget(worker_id)
        self.members = {}

    def _forget(self, worker_id: str) -> None:
        """Drop everything learned about one worker."""
        self.stats.pop(worker_id, None)
        self.prefix.pop(worker_id, None)
        self.cache_cursors.pop(worker_id, None)
        self.profiled.discard(worker_id)
        self.num_routed.pop(worker_id, None)
        self.models.forget(worker_id)
        self.lines.forget(worker_id)
        self.metrics.forget(worker=worker_id)

    async def _profile_new(self, members) -> None:
        """Cost models for workers that have none. The first worker of a role
        gives its profile (a few real prefills and decode steps, run as it
        started: every replica gets the same one); a later one (scale-up,
        replacement) runs the same model on the same node type, so it starts from
        a peer's fitted models and is routable at once, without waiting for its
        own profile, which ran on cores the load that made us scale up keeps busy
        (it would make it look slower than it is). Live timings refit both (a
        P's prefill steps, a D's token gaps) and a P's TTFT bias.

        A worker whose own profile failed (its engine could not step: its stats
        say why) is never routed, seeded or not; the pool manager starts another
        (cluster/restart_backoff.py). One worker of a role with no profiled peer
        is asked for its profile a refresh, the roles' at once (one after
        another, eight cold workers held a refresh 40 s)."""
        asked: dict[str, object] = {}  # role -> the member asked for its own profile
        for member in members:
            worker_id = member.worker_id
            stats = self.stats.get(worker_id)
            if worker_id in self.profiled or stats is None or stats.profile_error is not None:
                continue
            peer = next((w for w in self.profiled if w in self.members and self.members[w].role == member.role), None)
            if peer is not None:
                self.models.seed_from(peer, worker_id)
                self.profiled.add(worker_id)
            else:
                asked.setdefault(member.role, member)
        profiles = await asyncio.gather(*(within(m.handle.profile.remote(), WORKER_ANSWER_S) for m in asked.values()),
                                        return_exceptions=True)
        for member, profile in zip(asked.values(), profiles):
            # Profiling still or not answering (asked again next refresh), dead (its stats call reports it),
            # or its engine raised (its stats say so from now on, and the pool manager logs it):
            if isinstance(profile, (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.RayTaskError)):
                continue
            if isinstance(profile, ray.exceptions.RayError):  # on the way, not the engine's: asked again next refresh
                log.warning("profiling %s failed: %s", member.worker_id, profile)
                continue
            if isinstance(profile, BaseException):
                raise profile
            if not self._still_listed(member):
                continue
            self.models.observe_prefill_steps(member.worker_id, profile.prefill_steps)
            self.models.skip_prefill_steps(member.worker_id, profile.num_steps)
            for batch, kv_tokens, seconds in profile.decode:
                self.models.decode_model(member.worker_id).observe(decode_features(batch, kv_tokens), seconds)
            self.models.transfers.block_bytes = profile.kv_bytes_per_block
            self.profiled.add(member.worker_id)

    async def flush_prefix_caches(self) -> list[str]:
        """Each worker's device prefix cache reset (`/flush_cache`); returns the
        workers flushed. Every replica's prefix index learns it from their cache
        events (evictions) at its next refresh; a worker found dead is reported
        (the one started in its place starts cold). A worker unreachable for now
        keeps its cache: ApiError 503 names it, after the others are flushed
        (a cold benchmark run would have read its prefixes as cached)."""
        unreachable: list[str] = []
        answers = await self._ask_each(self._up(), lambda handle: handle.reset_prefix_cache.remote(),
                                       unreachable)
        if unreachable:
            raise ApiError(503, f"workers {', '.join(sorted(unreachable))} could not be reached: their prefix caches "
                                f"were not flushed ({len(answers)} others were); retry shortly",
                           kind="service_unavailable", headers={"Retry-After": "1"})
        return sorted(answers)

    async def abort_named(self, client_rid: str | None) -> set[str]:
        """`/abort_request`: the requests the client named `client_rid` (every one
        for None) ended as aborted on every worker (`WorkerBase.abort_named`),
        whichever replica started them; returns their ids. Decode and colocated
        workers first, where the streams end as aborted, then prefill workers."""
        members = self._up()
        asked_s = time.time()  # requests that arrived before it, still on their way to a worker, end too
        aborted = set()
        for side in ([m for m in members if m.role != "prefill"], [m for m in members if m.role == "prefill"]):
            answers = await self._ask_each(side, lambda handle: handle.abort_named.remote(client_rid, asked_s))
            aborted.update(*answers.values())
        return aborted

    async def start_profiles(self, folder: str, num_steps: int | None, record_shapes: bool,
                             with_stack: bool) -> dict[str, str]:
        """`/start_profile` on every worker (`WorkerBase.start_profile`); the paths
        their traces will have, by worker. A worker tracing already: ApiError
        409, the others started (`/stop_profile` ends every one). A worker that
        cannot write to the folder: ApiError 500, and the others stopped (they
        traced on without bound, every event held in memory, and nothing said to
        stop them)."""
        members = self._up()
        try:
            return await self._ask_each(members, lambda handle: handle.start_profile.remote(
                folder, num_steps, record_shapes, with_stack))
        except ProfileRunning as exc:
            raise ApiError(409, f"{error_message(exc)}: POST /stop_profile ends every worker's trace",
                           kind="conflict") from None
        except OSError as exc:  # the folder cannot be made on a worker's node
            await asyncio.gather(*(m.handle.stop_profile.remote() for m in members), return_exceptions=True)
            raise ApiError(500, f"a worker cannot write to profile_dir {folder!r}: {error_message(exc)} "
                                "(no worker traces)", kind="internal_error") from None

    async def stop_profiles(self) -> dict[str, str]:
        """`/stop_profile` on every worker: the traces written, by worker."""
        answers = await self._ask_each(self._up(), lambda handle: handle.stop_profile.remote())
        return {worker_id: path for worker_id, path in sorted(answers.items()) if path is not None}

    def _up(self) -> list:
        """The members that answered their start-up profile: what the worker
        endpoints ask. One still loading its model would hold the call (and a
        flush, an abort) until it came up; it holds no request, nor any cache."""
        return [m for m in self.members.values() if m.worker_id in self.profiled]

    async def _ask_each(self, members: list, ask, unreachable: list[str] | None = None) -> dict:
        """`ask(handle)`'s answer from each member at once, by worker id; one found
        dead is reported and left out, one unreachable for now left out (and
        added to `unreachable`), another failure raised."""
        results = await asyncio.gather(*(ask(m.handle) for m in members), return_exceptions=True)
        answers = {}
        for member, result in zip(members, results):
            if actor_died(result):
                await self.report_dead(member.worker_id, member.handle)
            elif actor_unavailable(result):
                log.warning("worker %s is unreachable for now: left out", member.worker_id)
                if unreachable is not None:
                    unreachable.append(member.worker_id)
            elif isinstance(result, BaseException):
                raise result
            else:
                answers[member.worker_id] = result
        return answers

    async def report_dead(self, worker_id: str, handle) -> None:
        """A worker found dead (a call's error, `actor_died`): out of the view at
        once, all that was learned of it (`_forget`: one that died before its
        profile ran was in neither `stats` nor `profiled` at the next refresh, and
        its prefix index and gauges stayed for good), and told to the pool
        manager, which replaces it. `handle`: the actor the caller's call went to.
        A worker the view does not list, or lists as another actor, is left
        alone: the manager stopped listing it, or it was an earlier manager's
        (`replace_pool`), and the new one, whose ids repeat the old ones, killed
        its own worker of that id as a start failure, or replaced it."""
        member = self.members.get(worker_id)
        if member is None or member.handle != handle:
            return
        del self.members[worker_id]
        self._forget(worker_id)
        try:  # maybe in a request: the replacement it starts must not go with that request
            await background_call(lambda: self.pool.report_dead.remote(worker_id))
        except ray.exceptions.RayError as exc:
            log.warning("could not report dead worker %s: %s", worker_id, exc)

    def routable(self, role: str, exclude: set[str] = frozenset()) -> list[str]:
        """The workers of a role that may take a request: profiled, not draining, not excluded."""
        return [w for w, m in self.members.items()
                if m.role == role and not m.draining and w in self.profiled and w not in exclude]

    def cached_tokens(self, worker_id: str, hashes: list[bytes]) -> int:
        """Prompt tokens the worker need not compute: its device prefix cache, then
        its node's KV store tiers (a load costs far less than a recompute), or the
        blocks a request this replica has in prefill there shares with the prompt:
        they are cached by the time this one's turn comes, or it waits for them
        (`Scheduler._waits_for_prefix`), so a burst sharing a new system prompt is
        not charged it once a request. Not one predicted to wait in a D's line:
        the worker starts it only once D reserves its blocks. None where the
        workers' prefix caches are off: they reuse nothing."""
        index = self.prefix.get(worker_id)
        if index is None or not self.settings.engine.enable_prefix_cache:
            return 0
        indexes = [index]
        stats = self.stats.get(worker_id)
        if self.store_index is not None and stats is not None:
            indexes += self.store_index.indexes_for(stats.node_id)
        cached = match_any(indexes, hashes)
        for request in self.models.inflight.values() if cached < len(hashes) else ():
            if (request.in_prefill and (request.prefill_id or request.decode_id) == worker_id
                    and request.first_token_due_s is not None):
                cached = max(cached, num_common_blocks(request.prefix_hashes, hashes))
        return cached * self.block_size
