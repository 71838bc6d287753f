"""The global scheduler's core, free of HTTP: validate and tokenize, admit or reject
early, pair P with D, run the request, retry once before the first token.

One instance per Serve replica (`scheduler_replicas`). What it knows of the
workers (members, stats, prefix indexes, cost models, readiness) is its
`PoolView` (cluster/pool_view.py), refreshed by the deployment each second; load
figures also count this scheduler's own bookkeeping of what it admitted
(`WorkerModels.inflight`) and the other replicas' (`WorkerModels.peers`).
Draining members get no new requests.
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
from ray import serve

from actors.block_pool import block_hashes, num_usable_blocks
from actors.deadlines import within
from actors.decode_room import reservation_tokens
from actors.messages import GenerateRequest, ReservationRefused, TokenEvent, WorkerDied, error_message
from actors.sampling_params import SamplingParams
from cluster.actor_errors import actor_died
from cluster.admission import InFlight, Prediction, SloRejected
from cluster.api_models import ApiError
from cluster.client_call import current_call
from cluster.config import AppSettings
from cluster.metrics import Metrics
from cluster.metrics_export import RayExport
from cluster.pd_request import DisaggregatedCall
from cluster.pool_view import PoolView
from cluster.prompt_limits import fitted_output, prompt_ids_within_limits
from cluster.router import make_policy
from cluster.scaling_signals import OutcomeRecorder, RequestTimer
from cluster.token_feeds import FeedLost, TokenFeeds, colocated_events

log = logging.getLogger("tandem.scheduler")

# A request's token gaps reach D's decode model as their mean over this many: the
# model's load features (batch, KV tokens) change little between, and one
# observation a token and request cost the scheduler O(batch) work each. A
# request's last gaps are observed at its end however few they are: requests of
# fewer than 8 tokens taught D's model nothing, which kept its start-up profile.
GAPS_PER_OBSERVATION = 8

# Tries a request may have after a D ended it because the request that lent it KV
# blocks ended before writing them (`TokenEvent.borrowed_kv_lost`: a burst sharing a
# new system prompt borrows the first one's blocks, actors/arriving_blocks.py). No
# worker failed, so such a try is not the one retry after a failure and leaves no
# worker out: that retry left out a sound P, and with one P (manifests/local.yaml)
# a client cancelling the first of a burst answered the rest 503. Bounded all the
# same (then the error is the answer): each try could borrow again from a request
# that ends too.
BORROWED_KV_RETRIES = 3

Pair = tuple[str | None, str]  # (P, D) a request goes to; (None, the worker) where colocated


def _waiting(prediction: Prediction, line_wait_s: float) -> Prediction:
    """`prediction` with the wait in D's line for KV blocks added to its TTFT."""
    if not line_wait_s:
        return prediction
    return dataclasses.replace(prediction, ttft_s=prediction.ttft_s + line_wait_s, line_wait_s=line_wait_s)


def _replica_name() -> str:
    """Serve's name for this replica (`serve status` and the replica's logs say it),
    else (outside Serve) a new one: what the pool manager's reports and the
    exported metrics know the replica by."""
    with contextlib.suppress(Exception):  # (RayServeException outside a replica)
        return serve.get_replica_context().replica_tag
    return uuid.uuid4().hex[:12]


class GlobalScheduler:
    def __init__(self, settings: AppSettings, tokenizer, pool, max_model_len: int, kv_seed: bytes,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        # The token ids a request may name: those the model's vocabulary and the tokenizer share
        self.vocab_size = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
        self.eos_token_ids = eos_token_ids  # the model's end tokens: a request's params are checked against them
        self.max_model_len = max_model_len
        self.block_size = settings.engine.block_size
        self.kv_seed = kv_seed  # the workers' hash-chain namespace, so hashes match theirs
        self.policy = make_policy(settings.routing)
        self.replica = _replica_name()  # in its request ids, its reports and its exported metrics
        self.outcomes = OutcomeRecorder(self.replica, settings.slo.ttft_ms / 1e3, settings.autoscaling.window_s)
        # Counters and histograms through Ray too, where every replica's are scraped
        # (cluster/metrics_export.py); not outside Ray (unit tests, tools).
        self.metrics = Metrics(RayExport(self.replica) if ray.is_initialized() else None)
        self.view = PoolView(settings, pool, kv_seed, self.metrics, self.outcomes,  # members, stats, cost models
                             max_model_len)
        self._ids = itertools.count()
        self.feeds = TokenFeeds()  # this replica's subscription to each worker's token events

    # ---- validation -----------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams, *, add_special_tokens: bool = True,
                keep_last: int | None = None) -> list[int]:
        """A request's prompt ids, checked against the limits (cluster/prompt_limits.py)."""
        return prompt_ids_within_limits(self.tokenizer, self.settings.limits, self.max_model_len, prompt, params,
                                        add_special_tokens=add_special_tokens, keep_last=keep_last,
                                        eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size)

    # ---- admission and pairing ----------------------------------------------------------
    def plan(self, prompt_ids: list[int], exclude: set[str] = frozenset(), max_new_tokens: int = 1,
             pair: Pair | None = None, computes_prompt: bool = False) -> Prediction:
        """The pair to use, or SloRejected / ApiError(503)."""
        return self._plan(prompt_ids, block_hashes(prompt_ids, self.block_size, self.kv_seed), exclude,
                          max_new_tokens, pair, computes_prompt)

    def _plan(self, prompt_ids: list[int], hashes: list[bytes], exclude: set[str], max_new_tokens: int,
              pair: Pair | None = None, computes_prompt: bool = False) -> Prediction:
        """`plan` with the prompt's block hashes already computed (once per request).
        `pair`: the (P, D) to take where they may take requests and have room or a
        known wait for it, unless they miss the SLO where another pair would not. A
        prompt's later choices go where its first went: there they wait for its
        blocks, so P computes the prompt once and D holds it once (borrowed,
        actors/arriving_blocks.py). Planned freely, each went to whichever P its
        predicted TTFT named, an idle one computing the whole prompt again for a
        few milliseconds less than waiting took. `computes_prompt`: P computes
        every prompt token, its cache aside (the prompt's logprobs are asked:
        `Scheduler.cached_prefix`); D's reservation still reuses D's."""
        if pair is not None:
            try:
                return self._plan_on(prompt_ids, hashes, exclude, max_new_tokens, pair, computes_prompt)
            except (SloRejected, ApiError):  # (ApiError: the pair has no room, nor a known wait for it)
                pass
        return self._plan_on(prompt_ids, hashes, exclude, max_new_tokens, computes_prompt=computes_prompt)

    def _routable(self, role: str, exclude: set[str], pinned: str | None) -> list[str]:
        """The workers of `role` a request may go to: `pinned` alone where it is one."""
        workers = self.view.routable(role, exclude)
        return [pinned] if pinned in workers else workers

    def _plan_on(self, prompt_ids: list[int], hashes: list[bytes], exclude: set[str], max_new_tokens: int,
                 pair: Pair | None = None, computes_prompt: bool = False) -> Prediction:
        view, models = self.view, self.view.models
        pinned_p, pinned_d = pair or (None, None)
        usable_hashes = self._usable(hashes, len(prompt_ids))
        p_hashes = [] if computes_prompt else usable_hashes  # (what P, or a colocated worker, may reuse)
        # What D's reservation must find room for, as D counts it (actors/decode_room.py)
        reserve = self.settings.engine.decode_reserve_tokens
        needed_blocks = -(-reservation_tokens(len(prompt_ids), max_new_tokens, reserve, self.max_model_len)
                          // self.block_size)
        # The other scheduler replicas' requests, then ours, counted as they count theirs: on P while
        # in prefill (ours were counted on P for their whole life), on D and colocated workers throughout
        inflight = dict(models.peers.inflight)
        for request in models.inflight.values():
            for worker_id in {request.prefill_id if request.in_prefill else None, request.decode_id} - {None}:
                inflight[worker_id] = inflight.get(worker_id, 0) + 1
        if self.settings.mode == "colocated":
            candidates = [
                models.predict(None, c, len(prompt_ids), view.cached_tokens(c, p_hashes))
                for c in self._routable("colocated", exclude, pinned_d)
            ]
        else:
            # Every D's, the pinned one's included: whether any has room decides whether a full one may be taken
            headroom = {d: view.rooms.headroom(d)  # once: it sums inflight
                        for d in view.routable("decode", exclude)}
            # Less the prompt's blocks D holds for running requests, which its reservation shares (a D serving
            # a shared system prompt read as full for the whole prompt: 429s, or routed to a D without it)
            needed = {d: needed_blocks - view.rooms.held_prefix_blocks(d, usable_hashes) for d in headroom}
            any_room = any(headroom[d] >= needed[d] for d in headroom)
            line_wait = {d: self._line_wait_s(d, headroom[d], needed[d])  # once: P aside
                         for d in self._routable("decode", exclude, pinned_d)}
            # A full D whose wait nothing predicts (no line read yet, none of this replica's requests
            # there) only where no D has room: read as none, it beat a D with room (a pinned one too:
            # the later choices of an n=4 call waited in a full D's line while another had room).
            decodes = [d for d, wait in line_wait.items() if wait is not None or not any_room]
            line_wait = {d: wait or 0.0 for d, wait in line_wait.items()}
            ttft_slo_s, tbt_slo_s = self.settings.slo.ttft_ms / 1e3, self.settings.slo.tbt_ms / 1e3
            d_cached = {d: view.cached_tokens(d, usable_hashes) // self.block_size for d in decodes}
            candidates = []
            for p in self._routable("prefill", exclude, pinned_p):
                cached = view.cached_tokens(p, p_hashes)
                per_d = [_waiting(models.predict(p, d, len(prompt_ids), cached, d_cached[d]), line_wait[d])
                         for d in decodes]
                # D: within both SLOs (the transfer from this P counted: a D whose link to it
                # was slow, picked for its lighter load, was a 429 where another D met the TTFT
                # SLO), within the TBT SLO, the shortest wait for KV blocks (none where there is
                # room), one with room before one without (whose wait may be unknown: read as
                # none), the least busy (so a new decode worker takes requests even if its
                # start-up profile came out slower), then the one whose cache holds most of the
                # prompt (P sends it only the rest: a conversation's next turn went to whichever
                # idle D was next in turn, and its whole history moved again), then the most KV
                # headroom, then the one routed to least so far (idle equals take turns, and a
                # scaled-up worker serves from the next request). Past the TBT SLO, the fastest
                # first (a slower one won on a tie-breaker, and was served, or quoted in the 429).
                # Every D is a candidate: one without room but within the TBT SLO was left out
                # where another had room, and that one's TBT past the SLO was a 429 (or a miss)
                # for a request the first could serve.
                if per_d:
                    candidates.append(min(per_d, key=lambda c: (
                        not c.meets(ttft_slo_s, tbt_slo_s), c.tbt_s if c.tbt_s > tbt_slo_s else 0.0, c.line_wait_s,
                        headroom[c.decode_id] < needed[c.decode_id], inflight.get(c.decode_id, 0),
                        -d_cached[c.decode_id], -headroom[c.decode_id], view.num_routed.get(c.decode_id, 0), c.tbt_s)))
        if not candidates:
            raise ApiError(503, "no workers are ready; retry shortly", kind="service_unavailable",
                           headers={"Retry-After": "5"})
        queued = {w: models.queued_prefill_s(w) for w in view.members}
        choice = self.policy.choose(candidates, queued, inflight)
        slo = self.settings.slo
        if slo.early_rejection and not choice.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3):
            best = min(candidates, key=lambda c: (not c.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3), c.ttft_s))
            if not best.meets(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3):
                raise SloRejected(best, slo.ttft_ms / 1e3, slo.tbt_ms / 1e3)
            choice = best
        return choice

    def _usable(self, hashes: list[bytes], num_prompt_tokens: int) -> list[bytes]:
        """The prompt's block hashes a worker's cache may serve: not the last
        token's block (its logits are computed)."""
        return hashes[:num_usable_blocks(num_prompt_tokens, self.block_size)]

    def _line_wait_s(self, decode_id: str, headroom: int, needed_blocks: int) -> float | None:
        """The predicted wait for D's KV blocks: none where D's `headroom` (its
        line's blocks counted) holds the `needed_blocks`; else from the
        reservations D granted since a reading showed its line
        (cluster/decode_lines.py), and before any reading did, from when this
        replica's requests on D will free blocks (at D's predicted step time
        now, `DecodeRooms.release_wait_s`); None where neither says."""
        if headroom >= needed_blocks:
            return 0.0
        lines = self.view.lines
        wait = lines.wait_s(decode_id, has_room=False, joined=self.view.rooms.num_joined_line(decode_id))
        if wait is None:
            step_s = self.view.models.tbt_at(decode_id, 0.0, 0)  # D's step now (the line's requests not in it)
            wait = self.view.rooms.release_wait_s(decode_id, needed_blocks, step_s)
        return None if wait is None else min(wait, lines.max_wait_s)

    # ---- running a request --------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       client_rid: str = "", routed: asyncio.Future | None = None,
                       pair: Pair | None = None):
        """TokenEvents of one request, first token to last. Raises SloRejected or
        ApiError before anything is spent; retries once on another pair if the
        first pair fails before the first token, without the worker that failed
        (the D that had no room, else the P; a dead D is out of the pool); and on
        any pair if the request that lent it KV blocks ended before writing them
        (up to BORROWED_KV_RETRIES times).
        `client_rid`: the name `/abort_request` finds it by on the workers.
        `routed`: given the Prediction it is routed by, its prefix then counted as
        in prefill there (its waiter runs after this generator's first await, by
        which time `_run` has registered it). `pair`: the (P, D) it goes to where
        they may take it and meet the SLO (a prompt's later choices go where its
        first went: `_plan`)."""
        # Workers know a request by an id this replica makes: a caller's id (a client's
        # rid) may repeat one in flight, and a worker refusing the second as a
        # duplicate ended the first's stream with it. Errors name it as the caller did.
        call = current_call()  # when it arrived (an abort asked since ends it), whether it was withdrawn
        said = f"request {request_id}" if request_id else "the request"
        request_id = f"{request_id or 'tandem'}-{self.replica}-{next(self._ids)}"
        if params.seed is None:  # drawn here: every worker's engine draws from one sequence (EngineConfig.seed)
            params = params.with_seed(secrets.randbits(63))
        params = fitted_output(self.settings.limits, self.max_model_len, len(prompt_ids), params)  # (a default)
        started = time.monotonic()
        timer = self.outcomes.timer(started)
        exclude: set[str] = set()
        failure = ""  # why the latest attempt failed, if one did
        retry_reason = None  # why the next attempt is a retry (counted once it is planned)
        num_failed = num_lent_lost = 0  # attempts ended before the first token: by a worker, by a lender
        outcome, finished = "error", False  # finished: its outcome is known (closing it after changes nothing)
        admitted = False  # routed to a pair: its end-to-end latency is one a client waited a served answer for
        hashes = block_hashes(prompt_ids, self.block_size, self.kv_seed)
        try:
            for attempt in itertools.count():
                try:
                    pinned = pair if not attempt else None  # (a retry: planned anew)
                    choice = self._plan(prompt_ids, hashes, exclude, params.max_new_tokens, pinned,
                                        params.prompt_logprobs is not None)
                except SloRejected as exc:
                    outcome = "rejected"
                    self.metrics.inc("rejections_total", "requests rejected early by SLO admission")
                    slo = self.settings.slo
                    ttft_slo_s = slo.ttft_ms / 1e3
                    line_missed = exc.best.ttft_s > ttft_slo_s >= exc.best.ttft_s - exc.best.line_wait_s
                    self.outcomes.rejected(exc.best.ttft_s > ttft_slo_s and not line_missed,
                                           exc.best.tbt_s > slo.tbt_ms / 1e3, line_missed)
                    raise
                except ApiError:
                    if not exclude:
                        raise
                    raise ApiError(503, f"{said} failed ({failure}), and no other worker can take it; "
                                   "retry shortly", kind="service_unavailable", headers={"Retry-After": "1"}) from None
                if retry_reason is not None:  # (tried again only now: one no worker could take was not)
                    self.metrics.inc("retries_total", "requests tried again before their first token, by why",
                                     reason=retry_reason)
                self.outcomes.routed((choice.prefill_id, choice.decode_id))
                admitted = True
                if routed is not None and not routed.done():
                    routed.set_result(choice)
                self.view.num_routed[choice.decode_id] = self.view.num_routed.get(choice.decode_id, 0) + 1
                got_token = False
                attempt_id = f"{request_id}-{attempt}"
                request = GenerateRequest(attempt_id, prompt_ids, params, client_rid, call.arrived_s)
                run = self._run(request, choice, hashes, started, timer)
                deadline = started + self.settings.limits.request_timeout_s
                async with contextlib.aclosing(_until(run, deadline, request_id)) as events:
                    async for event in events:
                        # (not past its deadline: a timed-out request ends, `_until`'s error event as its last)
                        if event.error and not got_token and time.monotonic() < deadline and (
                                num_lent_lost < BORROWED_KV_RETRIES if event.borrowed_kv_lost else not num_failed):
                            if event.borrowed_kv_lost:  # another request's failure: this pair may take it again
                                num_lent_lost += 1
                            else:
                                num_failed += 1
                                if choice.decode_id in self.view.members:  # else D died (reported): P may serve again
                                    exclude.add(self._failed_worker(choice, self.view.models.inflight[attempt_id]))
                            retry_reason = "lender_ended" if event.borrowed_kv_lost else "failed"
                            log.warning("request %s failed before its first token (%s); trying again", request_id,
                                        event.error)
                            failure = event.error
                            break
                        got_token = got_token or bool(event.token_ids)
                        timer.tokens(len(event.token_ids), time.monotonic())
                        if event.finished:
                            outcome = "error" if event.error else "aborted" if event.finish_reason == "abort" else "ok"
                            finished = True
                            call.ended(outcome)  # (now: its reader may close the others before this one closes)
                            if outcome == "ok" and timer.tbt_s is not None:  # D's TBT bias learns it
                                self.view.models.observe_tbt(choice, timer.tbt_s)
                        yield event
                    else:
                        return
        except (WorkerDied, FeedLost, ReservationRefused) as exc:
            raise ApiError(503, f"{said} failed: {exc}", kind="service_unavailable") from None
        except (asyncio.CancelledError, GeneratorExit):  # closed: its client left, or another of its call's requests
            if not finished:
                outcome = "withdrawn" if call.withdrawn else "cancelled"
            raise
        finally:
            call.ended(outcome)  # (a refusal or failure raised: before its caller closes the others)
            timer.end(outcome, time.monotonic())
            self.metrics.inc("requests_total", "requests by outcome", outcome=outcome)
            if admitted:  # (a rejection's or a 503's instant answer put the p50 near 0 under overload)
                self.metrics.observe("e2e_seconds", "end-to-end latency of requests admitted",
                                     time.monotonic() - started)

    @staticmethod
    def _failed_worker(choice: Prediction, inflight: InFlight) -> str:
        """Whom an attempt that failed before its first token failed on: the
        worker its error named (`InFlight.failed_id`: D, whose feed was lost);
        else its D if D had not reserved its blocks yet (no room within the
        handshake's wait), else its P (or colocated worker)."""
        if inflight.failed_id is not None:
            return inflight.failed_id
        if choice.prefill_id is not None and inflight.reserved_s is None:
            return choice.decode_id
        return choice.prefill_id or choice.decode_id

    async def _run(self, request: GenerateRequest, choice: Prediction, hashes: list[bytes], started: float,
                   timer: RequestTimer | None = None):
        num_prompt_tokens = len(request.prompt_token_ids)
        usable = self._usable(hashes, num_prompt_tokens)
        inflight = InFlight(request.request_id, choice.prefill_id, choice.decode_id, num_prompt_tokens,
                            request.params.max_new_tokens, choice.ttft_s, line_wait_s=choice.line_wait_s,
                            ttft_bias_s=choice.ttft_bias_s, ahead_id=choice.ahead_id, own_s=choice.own_s,
                            peers_s=choice.peers_s,
                            decode_held_blocks=self.view.rooms.held_prefix_blocks(choice.decode_id, usable),
                            prefix_hashes=tuple(usable), num_cached_tokens=num_prompt_tokens - choice.uncached_tokens)
        models = self.view.models
        models.inflight[request.request_id] = inflight
        if timer is not None:  # (its time in D's line is the decode pool's, cluster/scaling_signals.py)
            timer.attempt_started(inflight)
        for worker_id in (choice.prefill_id, choice.decode_id):
            if worker_id in self.view.prefix and self.settings.engine.enable_prefix_cache:  # (off: never held)
                self.view.prefix[worker_id].route(hashes)
        last_s = None
        gaps_from_s, num_gaps = None, 0  # the decode model learns a mean gap every GAPS_PER_OBSERVATION
        try:
            async for event in self._events(request, choice, inflight):
                now = time.monotonic()
                if event.token_ids:
                    if inflight.first_token_s is None:
                        models.first_token_came(inflight, now)
                        inflight.first_token_s = gaps_from_s = now
                        self.metrics.observe("ttft_seconds", "time to first token", now - started)
                        models.observe_ttft(choice, now - inflight.admitted_s)
                    elif last_s is not None:
                        gap = (now - last_s) / len(event.token_ids)  # (an event of k tokens: k gaps of it)
                        self.metrics.observe("tbt_seconds", "time between tokens", gap, count=len(event.token_ids))
                        num_gaps += len(event.token_ids)
                        if num_gaps >= GAPS_PER_OBSERVATION or (event.finished and num_gaps):  # short ones teach too
                            models.observe_token_gap(choice.decode_id, (now - gaps_from_s) / num_gaps)
                            gaps_from_s, num_gaps = now, 0
                    inflight.num_generated += len(event.token_ids)
                    last_s = now
                yield event
        finally:
            models.inflight.pop(request.request_id, None)
            now = time.monotonic()
            models.gone_before_its_first_token(inflight, now)
            if timer is not None:
                timer.attempt_ended(now)

    async def _events(self, request: GenerateRequest, choice: Prediction, inflight: InFlight):
        call = None
        decode = self.view.members[choice.decode_id].handle
        if choice.prefill_id is None:
            events = colocated_events(self.feeds, decode, request)
        else:
            prefill = self.view.members[choice.prefill_id].handle
            call = DisaggregatedCall(
                prefill, decode, request, self.settings.channel, self.settings.timeouts.handshake_s, self.feeds,
                on_reserved=inflight.reserved,
                on_prefilled=lambda result: self.view.models.transfers.observe(choice.prefill_id, choice.decode_id,
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
            await self.view.report_dead(choice.decode_id, decode)
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error=error_message(exc))
        except FeedLost as exc:  # the worker lives: not reported (that would replace it), but not tried again
            inflight.failed_id = choice.decode_id
            yield TokenEvent(request.request_id, [], "", None, True, "error", time.time(), error=error_message(exc))
        finally:  # (also when its reader stops at an error event, to retry elsewhere)
            if call is not None:
                await self._after_call(call, choice)

    async def _after_call(self, call: DisaggregatedCall, choice: Prediction) -> None:
        """What a P/D call's end tells: its prompt and transfer counts, and a P
        found dead (reported at once, not at the next refresh: other requests
        would be routed to it meanwhile)."""
        if call.prefill_result is not None:
            result = call.prefill_result
            self._count_prompt(result.num_prompt_tokens, result.num_prompt_tokens - result.num_computed_tokens)
            help_text = ("prompt KV blocks a decode worker needed: sent by the prefill worker, already held, "
                         "or borrowed from another request's transfer")
            reservation = call.reservation
            self.metrics.inc("kv_transfer_blocks_total", help_text, result.num_blocks_sent, kind="sent")
            self.metrics.inc("kv_transfer_blocks_total", help_text,
                             reservation.num_cached_blocks - reservation.num_borrowed_blocks, kind="held")
            self.metrics.inc("kv_transfer_blocks_total", help_text, reservation.num_borrowed_blocks, kind="borrowed")
        if actor_died(call.prefill_error):
            await self.view.report_dead(choice.prefill_id, call.prefill)

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
