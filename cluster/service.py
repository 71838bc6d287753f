"""The global scheduler's core, free of HTTP: validate and tokenize, admit or reject
early, pair P with D, run the request, retry once before the first token.

One instance per Serve replica (`scheduler_replicas`). Worker membership comes from
the pool manager; load figures from the workers' stats (polled), from this
scheduler's own bookkeeping of what it admitted (`WorkerModels.inflight`) and from
the other replicas' (`WorkerModels.peers`). Draining members get no new requests.
Each refresh sends the pool manager a report for its autoscaler
(cluster/scaling_signals.py): SLO outcomes, backlog and requests in flight; the
answer is the other replicas' load. Each replica reads every worker's prefix-cache
events from a cursor of its own (actors/event_log.py), so all of them route by the
whole cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
import uuid

import ray

from actors.background import background_call
from actors.block_pool import block_hashes, blocks_to_reserve
from actors.deadlines import within
from actors.decode_room import growth_blocks, reservation_tokens
from actors.event_log import CacheEvents, Cursor
from actors.messages import GenerateRequest, ReservationRefused, TokenEvent, WorkerDied, error_message
from actors.sampling_params import SamplingParams
from cluster.admission import InFlight, Prediction, SloRejected, WorkerModels
from cluster.api_models import ApiError
from cluster.config import AppSettings
from cluster.cost_model import decode_features
from cluster.decode_lines import DecodeLines
from cluster.metrics import Metrics
from cluster.pd_request import DisaggregatedCall
from cluster.prompt_limits import prompt_ids_within_limits
from cluster.restart_backoff import StartFailure
from cluster.router import PrefixIndex, make_policy, match_any
from cluster.scaling_signals import OutcomeRecorder, PeerLoad
from cluster.store_index import StoreIndex
from cluster.token_feeds import FeedLost, TokenFeeds, colocated_events

log = logging.getLogger("tandem.scheduler")

# A request's token gaps reach D's decode model as their mean over this many: the
# model's load features (batch, KV tokens) change little between, and one
# observation a token and request cost the scheduler O(batch) work each. A
# request's last gaps are observed at its end however few they are: requests of
# fewer than 8 tokens taught D's model nothing, which kept its start-up profile.
GAPS_PER_OBSERVATION = 8


class GlobalScheduler:
    def __init__(self, settings: AppSettings, tokenizer, pool, max_model_len: int, kv_seed: bytes,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # the model's end tokens: a request's params are checked against them
        self.pool = pool
        self.max_model_len = max_model_len
        self.block_size = settings.engine.block_size
        self.kv_seed = kv_seed  # the workers' hash-chain namespace, so hashes match theirs
        self.models = WorkerModels(self.block_size, ttft_quantile=settings.slo.attainment,
                                   prefill_chunk_size=settings.engine.prefill_chunk_size,
                                   max_num_batched_tokens=settings.engine.max_num_batched_tokens)
        self.lines = DecodeLines(settings.timeouts.handshake_s)  # waits for D's KV blocks, for admission
        self.policy = make_policy(settings.routing)
        self.metrics = Metrics()
        self.members: dict[str, object] = {}  # worker_id -> Member
        self.stats: dict[str, object] = {}  # worker_id -> WorkerStats
        self.prefix: dict[str, PrefixIndex] = {}
        self.cache_cursors: dict[str, Cursor] = {}  # worker_id -> where this replica read its cache events to
        self.store_index = StoreIndex(kv_seed, settings.kv_store.store_settings()) if settings.kv_store else None
        self.profiled: set[str] = set()
        self.start_failures: dict[str, StartFailure] = {}  # role -> its latest, from the pool manager (/health)
        self.num_routed: dict[str, int] = {}  # requests routed per decode (or colocated) worker
        self.ready = False
        self.pools_applied = False  # this deployment's pool sizes given to the pool manager (`refresh`)
        self._ids = itertools.count()
        self._replica_tag = uuid.uuid4().hex[:8]
        self.outcomes = OutcomeRecorder(uuid.uuid4().hex[:12])
        self.feeds = TokenFeeds()  # this replica's subscription to each worker's token events

    # ---- membership and load ------------------------------------------------------
    async def refresh(self) -> None:
        """Members from the pool manager; stats (and a start-up profile) per worker.
        The first also gives the pool manager this deployment's pool sizes: a
        redeploy's, where the pools outlived the replicas before."""
        if not self.pools_applied:
            try:
                changed = await self.pool.apply_pools.remote(self.settings.model_dump())
                if changed:
                    log.info("pool sizes of this deployment applied: %s", ", ".join(changed))
            except (ray.exceptions.RayTaskError, AttributeError) as exc:  # (AttributeError: an older pool manager)
                log.warning("could not apply this deployment's pool sizes: %s", exc)
            self.pools_applied = True
        members = await self.pool.list_members.remote()
        self.members = {m.worker_id: m for m in members}
        for gone in (set(self.stats) | self.profiled) - set(self.members):
            self._forget(gone)
        results = await asyncio.gather(*(m.handle.stats.remote() for m in members), return_exceptions=True)
        for member, stats in zip(members, results):
            if isinstance(stats, ray.exceptions.RayActorError):
                await self._report_dead(member.worker_id)
            elif not isinstance(stats, BaseException):
                self.stats[member.worker_id] = stats
                if stats.profile_error is not None:  # never routed (a seeded one whose profile failed since)
                    self.profiled.discard(member.worker_id)
                if member.role == "decode":
                    self.lines.observe(member.worker_id, stats.num_reservations_granted, stats.num_waiting_handshakes,
                                       time.monotonic())
                self.prefix.setdefault(member.worker_id, PrefixIndex(stats.num_blocks))
                self.metrics.set("kv_blocks_used", "KV blocks in use per worker", stats.num_used_blocks,
                                 worker=member.worker_id, role=member.role)
                self.metrics.set("queue_depth", "requests waiting or running per worker",
                                 stats.num_waiting + stats.num_running, worker=member.worker_id, role=member.role)
                self.metrics.set("handshakes_waiting", "handshakes waiting in a decode worker's line for KV blocks",
                                 stats.num_waiting_handshakes, worker=member.worker_id, role=member.role)
                self.metrics.set("preemptions", "running requests preempted by recompute for KV room, since start",
                                 stats.num_preemptions, worker=member.worker_id, role=member.role)
                self.metrics.set("draft_tokens", "speculative decoding: draft tokens verified, since start",
                                 stats.num_draft_tokens, worker=member.worker_id, role=member.role)
                self.metrics.set("draft_tokens_accepted", "speculative decoding: draft tokens the samples confirmed",
                                 stats.num_accepted_draft_tokens, worker=member.worker_id, role=member.role)
                if member.role != "decode" and member.worker_id in self.profiled:
                    self.models.observe_prefill_steps(member.worker_id, stats.prefill_steps)
        indexed = [m for m in members if m.worker_id in self.prefix]
        batches = await asyncio.gather(
            *(m.handle.cache_events.remote(self.cache_cursors.get(m.worker_id)) for m in indexed),
            return_exceptions=True,
        )
        for member, batch in zip(indexed, batches):
            if not isinstance(batch, BaseException):
                self._apply_cache_events(member.worker_id, batch)
        if self.store_index is not None:
            await self.store_index.refresh({s.node_id for s in self.stats.values() if s.node_id})
        await self._profile_new(members)
        roles = {m.role for m in members if m.worker_id in self.stats and m.worker_id in self.profiled}
        needed = {"prefill", "decode"} if self.settings.mode == "disaggregated" else {"colocated"}
        self.ready = needed <= roles
        draining = [m.worker_id for m in members if m.draining]
        try:
            report = self.outcomes.report(list(self.models.inflight.values()), draining)
            peers, self.start_failures = await asyncio.gather(self.pool.report.remote(report),
                                                              self.pool.start_failures.remote())
            self.models.peers = peers if isinstance(peers, PeerLoad) else PeerLoad()
        except (ray.exceptions.RayError, AttributeError) as exc:  # the autoscaler misses it; serving goes on
            # AttributeError: a pool manager left running by an older version (restart it to autoscale)
            log.warning("could not report to the pool manager: %s", exc)

    def health(self) -> tuple[int, dict]:
        """/health's status code and body: 200 "ready" once a worker of each role
        needed can be routed; until then 503, "starting", or "failing" when the
        latest start of a role failed. Either names those roles ("failing"): the
        worker, why, how many in a row, and when the pool manager starts the next
        (cluster/restart_backoff.py)."""
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
        of its cache (a first read, or one that fell behind its log)."""
        self.prefix[worker_id].update(batch)
        self.cache_cursors[worker_id] = batch.cursor

    def replace_pool(self, pool) -> None:
        """A new pool manager replaced a dead one: its workers are new processes
        even where their ids repeat the old ones (p0, d1, ...), so nothing learned
        about the old workers (cost models, prefix indexes, stats) carries over."""
        self.pool = pool
        self.ready = False
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
        (cluster/restart_backoff.py)."""
        for member in members:
            worker_id = member.worker_id
            stats = self.stats.get(worker_id)
            if worker_id in self.profiled or stats is None or stats.profile_error is not None:
                continue
            peer = next((w for w in self.profiled if w in self.members and self.members[w].role == member.role), None)
            if peer is not None:
                self.models.seed_from(peer, worker_id)
                self.profiled.add(worker_id)
                continue
            try:
                profile = await member.handle.profile.remote()
            except ray.exceptions.RayActorError:
                continue  # dead: its stats call reports it
            except ray.exceptions.RayTaskError:
                continue  # its engine raised: its stats say so from now on (and the pool manager logs it)
            except ray.exceptions.RayError as exc:  # on the way, not the engine's: asked again next refresh
                log.warning("profiling %s failed: %s", worker_id, exc)
                continue
            self.models.observe_prefill_steps(member.worker_id, profile.prefill_steps)
            self.models.skip_prefill_steps(member.worker_id, profile.num_steps)
            for batch, kv_tokens, seconds in profile.decode:
                self.models.decode_model(member.worker_id).observe(decode_features(batch, kv_tokens), seconds)
            self.models.transfers.block_bytes = profile.kv_bytes_per_block
            self.profiled.add(member.worker_id)

    async def _report_dead(self, worker_id: str) -> None:
        self.members.pop(worker_id, None)
        self.stats.pop(worker_id, None)
        try:  # maybe in a request: the replacement it starts must not go with that request
            await background_call(lambda: self.pool.report_dead.remote(worker_id))
        except ray.exceptions.RayError as exc:
            log.warning("could not report dead worker %s: %s", worker_id, exc)

    def _role(self, role: str, exclude: set[str]) -> list[str]:
        return [w for w, m in self.members.items()
                if m.role == role and not m.draining and w in self.profiled and w not in exclude]

    # ---- validation -----------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams, *, add_special_tokens: bool = True,
                keep_last: int | None = None) -> list[int]:
        """A request's prompt ids, checked against the limits (cluster/prompt_limits.py)."""
        return prompt_ids_within_limits(self.tokenizer, self.settings.limits, self.max_model_len, prompt, params,
                                        add_special_tokens=add_special_tokens, keep_last=keep_last,
                                        eos_token_ids=self.eos_token_ids)

    # ---- admission and pairing ----------------------------------------------------------
    def plan(self, prompt_ids: list[int], exclude: set[str] = frozenset(), max_new_tokens: int = 1) -> Prediction:
        """The pair to use, or SloRejected / ApiError(503)."""
        return self._plan(prompt_ids, block_hashes(prompt_ids, self.block_size, self.kv_seed), exclude,
                          max_new_tokens)

    def _plan(self, prompt_ids: list[int], hashes: list[bytes], exclude: set[str], max_new_tokens: int) -> Prediction:
        """`plan` with the prompt's block hashes already computed (once per request)."""
        usable_hashes = hashes[: (len(prompt_ids) - 1) // self.block_size]
        # What D's reservation must find room for, as D counts it (actors/decode_room.py)
        reserve = self.settings.engine.decode_reserve_tokens
        needed_blocks = -(-reservation_tokens(len(prompt_ids), max_new_tokens, reserve) // self.block_size)
        inflight = dict(self.models.peers.inflight)  # the other scheduler replicas' requests, then ours
        for request in self.models.inflight.values():
            for worker_id in {request.prefill_id, request.decode_id} - {None}:
                inflight[worker_id] = inflight.get(worker_id, 0) + 1
        if self.settings.mode == "colocated":
            candidates = [
                self.models.predict(None, c, len(prompt_ids), self._cached_tokens(c, usable_hashes))
                for c in self._role("colocated", exclude)
            ]
        else:
            headroom = {d: self._headroom(d) for d in self._role("decode", exclude)}  # once: it sums inflight
            decodes = [d for d, room in headroom.items() if room >= needed_blocks] or list(headroom)
            tbt_slo_s = self.settings.slo.tbt_ms / 1e3
            candidates = []
            for p in self._role("prefill", exclude):
                cached = self._cached_tokens(p, usable_hashes)
                per_d = [
                    self._waiting_for(d, headroom[d] >= needed_blocks, self.models.predict(
                        p, d, len(prompt_ids), cached, self._cached_tokens(d, usable_hashes)))
                    for d in decodes
                ]
                # D: within the TBT SLO, the shortest wait for KV blocks (none where
                # there is room), the least busy (so a new decode worker takes
                # requests even if its start-up profile came out slower), then the
                # most KV headroom, then the one routed to least so far (idle equals
                # take turns, and a scaled-up worker serves from the next request);
                # past the SLO, the fastest.
                if per_d:
                    candidates.append(min(per_d, key=lambda c: (
                        c.tbt_s > tbt_slo_s, c.line_wait_s, inflight.get(c.decode_id, 0),
                        -headroom[c.decode_id], self.num_routed.get(c.decode_id, 0), c.tbt_s)))
        if not candidates:
            raise ApiError(503, "no workers are ready; retry shortly", kind="service_unavailable",
                           headers={"Retry-After": "5"})
        queued = {w: self.models.queued_prefill_s(w) for w in self.members}
        choice = self.policy.choose(candidates, queued, inflight)
        slo = self.settings.slo
        if slo.early_rejection and not choice.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3):
            best = min(candidates, key=lambda c: (not c.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3), c.ttft_s))
            if not best.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3):
                raise SloRejected(best, slo.ttft_ms / 1e3, slo.tbt_ms / 1e3)
            choice = best
        return choice

    def _waiting_for(self, decode_id: str, has_room: bool, prediction: Prediction) -> Prediction:
        """`prediction` with the wait for D's KV blocks added to its TTFT;
        `has_room`: D's headroom holds the prompt (its line's blocks counted)."""
        if has_room:
            return prediction
        read_at = self.lines.read_at_s(decode_id)
        joined = 0 if read_at is None else sum(
            1 for r in self.models.inflight.values()
            if r.decode_id == decode_id and r.prefill_id is not None and r.reserved_s is None
            and r.admitted_s > read_at)
        wait = self.lines.wait_s(decode_id, has_room=False, joined=joined)
        if not wait:
            return prediction
        return dataclasses.replace(prediction, ttft_s=prediction.ttft_s + wait, line_wait_s=wait)

    def _cached_tokens(self, worker_id: str, hashes: list[bytes]) -> int:
        """Prompt tokens the worker need not compute: its device prefix cache, then
        its node's KV store tiers (a load costs far less than a recompute)."""
        index = self.prefix.get(worker_id)
        if index is None:
            return 0
        indexes = [index]
        stats = self.stats.get(worker_id)
        if self.store_index is not None and stats is not None:
            indexes += self.store_index.indexes_for(stats.node_id)
        return match_any(indexes, hashes) * self.block_size

    def _headroom(self, worker_id: str) -> int:
        """D's free KV blocks now, as far as this replica knows: those free at the
        last reading of D's stats, less those the handshakes then in D's line ask
        for (they take what comes free first), less those of this replica's
        requests sent to D since (the reading does not show them yet), less the
        growth D keeps for this replica's requests there (actors/decode_room.py;
        the other replicas' are not known request by request). Counting
        no headroom while any handshake waited instead, a burst passing through
        an idle D's line (one engine-thread call each) read as a full D: admission
        predicted a 4.7 s wait there and answered 429."""
        stats = self.stats.get(worker_id)
        if stats is None:
            return 0
        read_at = self.lines.read_at_s(worker_id)
        mine = [r for r in self.models.inflight.values() if r.decode_id == worker_id]
        sent = 0 if read_at is None else sum(
            blocks_to_reserve(r.num_prompt_tokens, self.block_size) for r in mine if r.admitted_s > read_at)
        reserve = self.settings.engine.decode_reserve_tokens
        owed = sum(growth_blocks(r.num_prompt_tokens + r.num_generated, r.num_generated, r.max_new_tokens,
                                 blocks_to_reserve(r.num_prompt_tokens + r.num_generated, self.block_size),
                                 reserve, self.block_size) for r in mine)
        return max(stats.num_blocks - stats.num_used_blocks - stats.num_waiting_blocks - sent - owed, 0)

    # ---- running a request --------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
        """TokenEvents of one request, first token to last. Raises SloRejected or
        ApiError before anything is spent; retries once on another pair if the
        first pair fails before the first token, without the worker that failed
        (the D that had no room, else the P; a dead D is out of the pool)."""
        # Workers know a request by an id this replica makes: a caller's id (a client's
        # rid) may repeat one in flight, and a worker refusing the second as a
        # duplicate ended the first's stream with it. Errors name it as the caller did.
        said = f"request {request_id}" if request_id else "the request"
        request_id = f"{request_id or 'tandem'}-{self._replica_tag}-{next(self._ids)}"
        if params.seed is None:  # drawn here: every worker's engine draws from one sequence (EngineConfig.seed)
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        started = time.monotonic()
        timer = self.outcomes.timer(started)
        exclude: set[str] = set()
        failure = ""  # why the first attempt failed, if it did
        outcome = "error"
        hashes = block_hashes(prompt_ids, self.block_size, self.kv_seed)
        try:
            for attempt in range(2):
                try:
                    choice = self._plan(prompt_ids, hashes, exclude, params.max_new_tokens)
                except SloRejected as exc:
                    outcome = "rejected"
                    self.metrics.inc("rejections_total", "requests rejected early by SLO admission")
                    slo = self.settings.slo
                    self.outcomes.rejected(exc.best.ttft_s > slo.ttft_ms / 1e3, exc.best.tbt_s > slo.tbt_ms / 1e3)
                    raise
                except ApiError:
                    if not exclude:
                        raise
                    raise ApiError(503, f"{said} failed ({failure}), and no other worker can take it; "
                                   "retry shortly", kind="service_unavailable", headers={"Retry-After": "1"}) from None
                self.outcomes.routed((choice.prefill_id, choice.decode_id))
                self.num_routed[choice.decode_id] = self.num_routed.get(choice.decode_id, 0) + 1
                got_token = False
                attempt_id = f"{request_id}-{attempt}"
                run = self._run(GenerateRequest(attempt_id, prompt_ids, params), choice, hashes, started)
                deadline = started + self.settings.limits.request_timeout_s
                async with contextlib.aclosing(_until(run, deadline, request_id)) as events:
                    async for event in events:
                        if event.error and not got_token and attempt == 0:
                            if choice.decode_id in self.members:  # else D died (reported): P may serve again
                                exclude.add(self._failed_worker(choice, self.models.inflight[attempt_id]))
                            log.warning("request %s failed before its first token (%s); retrying", request_id, event.error)
                            failure = event.error
                            break
                        got_token = got_token or bool(event.token_ids)
                        timer.tokens(len(event.token_ids), time.monotonic())
                        if event.finished:
                            outcome = "error" if event.error else "ok"
                        yield event
                    else:
                        return
        except (WorkerDied, FeedLost, ReservationRefused) as exc:
            raise ApiError(503, f"{said} failed: {exc}", kind="service_unavailable") from None
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (task cancelled, or closed us)
            outcome = "cancelled"
            raise
        finally:
            timer.end(outcome)
            self.metrics.inc("requests_total", "requests by outcome", outcome=outcome)
            self.metrics.observe("e2e_seconds", "end-to-end latency", time.monotonic() - started)

    @staticmethod
    def _failed_worker(choice: Prediction, inflight: InFlight) -> str:
        """Whom an attempt that failed before its first token failed on: its D if
        D had not reserved its blocks yet (no room within the handshake's wait),
        else its P (or colocated worker)."""
        if choice.prefill_id is not None and inflight.reserved_s is None:
            return choice.decode_id
        return choice.prefill_id or choice.decode_id

    async def _run(self, request: GenerateRequest, choice: Prediction, hashes: list[bytes], started: float):
        inflight = InFlight(request.request_id, choice.prefill_id, choice.decode_id, len(request.prompt_token_ids),
                            request.params.max_new_tokens, choice.ttft_s, line_wait_s=choice.line_wait_s,
                            ttft_bias_s=choice.ttft_bias_s)
        self.models.inflight[request.request_id] = inflight
        for worker_id in (choice.prefill_id, choice.decode_id):
            if worker_id in self.prefix:
                self.prefix[worker_id].insert(hashes)
        last_s = None
        gaps_from_s, num_gaps = None, 0  # the decode model learns a mean gap every GAPS_PER_OBSERVATION
        try:
            async for event in self._events(request, choice, inflight):
                now = time.monotonic()
                if event.token_ids:
                    if inflight.first_token_s is None:
                        inflight.first_token_s = gaps_from_s = now
                        self.metrics.observe("ttft_seconds", "time to first token", now - started)
                        self.models.observe_ttft(choice, now - inflight.admitted_s)
                    elif last_s is not None:
                        gap = (now - last_s) / len(event.token_ids)
                        self.metrics.observe("tbt_seconds", "time between tokens", gap)
                        num_gaps += len(event.token_ids)
                        if num_gaps >= GAPS_PER_OBSERVATION or (event.finished and num_gaps):  # short ones teach too
                            self.models.observe_token_gap(choice.decode_id, (now - gaps_from_s) / num_gaps)
                            gaps_from_s, num_gaps = now, 0
                    inflight.num_generated += len(event.token_ids)
                    last_s = now
                yield event
        finally:
            self.models.inflight.pop(request.request_id, None)

    async def _events(self, request: GenerateRequest, choice: Prediction, inflight: InFlight):
        call = None
        if choice.prefill_id is None:
            events = colocated_events(self.feeds, self.members[choice.decode_id].handle, request)
        else:
            prefill = self.members[choice.prefill_id].handle
            decode = self.members[choice.decode_id].handle
            call = DisaggregatedCall(
                prefill, decode, request, self.settings.channel, self.settings.timeouts.handshake_s, self.feeds,
                on_reserved=inflight.reserved,
                on_prefilled=lambda result: self.models.transfers.observe(choice.prefill_id, choice.decode_id,
                                                                         result.chunks))
            events = call.events()
        counted = False
        try:
            async with contextlib.aclosing(events):  # a request not read to its end is aborted now
                async for event in events:
                    if call is None and not counted and event.token_ids:
                        self._count_prompt(len(request.prompt_token_ids), event.num_cached_tokens)
                        counted = True
                    yield event
        except ReservationRefused as exc:
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error=error_message(exc))
        except WorkerDied as exc:
            await self._report_dead(choice.decode_id)
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error=error_message(exc))
        except FeedLost as exc:  # the worker lives: not reported (that would replace it)
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error=error_message(exc))
        if call is not None and call.prefill_result is not None:
            result = call.prefill_result
            self._count_prompt(result.num_prompt_tokens, result.num_prompt_tokens - result.num_computed_tokens)
            help_text = "prompt KV blocks a decode worker needed: sent by the prefill worker, or already held"
            self.metrics.inc("kv_transfer_blocks_total", help_text, result.num_blocks_sent, kind="sent")
            self.metrics.inc("kv_transfer_blocks_total", help_text, call.reservation.num_cached_blocks, kind="held")
        if call is not None and isinstance(call.prefill_error, ray.exceptions.RayActorError):
            await self._report_dead(choice.prefill_id)

    def _count_prompt(self, num_prompt: int, num_cached: int) -> None:
        """Prompt tokens the prefilling worker found in its prefix cache (device or
        KV store) against those it computed: the hit rate cache-aware routing buys."""
        help_text = "prompt tokens by where the prefilling worker got their KV"
        self.metrics.inc("prompt_tokens_total", help_text, num_cached, source="cache")
        self.metrics.inc("prompt_tokens_total", help_text, num_prompt - num_cached, source="computed")


async def _until(events, deadline: float, request_id: str):
    """Pass events through until `deadline` (monotonic); then end with an error event.
    Closing `events` on the way out cancels the request on its workers."""
    async with contextlib.aclosing(events):
        while True:
            remaining = deadline - time.monotonic()
            try:
                event = await within(events.__anext__(), max(remaining, 0.001))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                yield TokenEvent(request_id, [], "", None, True, "error", time.time(), error="request timed out")
                return
            yield event
