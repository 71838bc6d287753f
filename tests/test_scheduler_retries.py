"""The global scheduler's predictions and its retry of a request that failed
before its first token (cluster/service.py), on a scheduler whose cost models are
known and whose workers' calls are played by `DisaggregatedCall` stand-ins (the
calls themselves are tested against real workers in tests/test_pd_faults.py).
Each case failed before a review found it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

import cluster.pool_view as pool_view
import cluster.service as service
from actors.block_pool import block_hashes
from actors.deadlines import within
from actors.event_log import CacheEvents
from actors.messages import ChunkTiming, TokenEvent
from actors.sampling_params import SamplingParams
from cluster.admission import InFlight, WorkerModels
from cluster.cost_model import prefill_step_features
from cluster.pool_manager import Member
from cluster.router import PrefixIndex
from cluster.scaling_signals import OutcomeRecorder, PeerLoad
from cluster.token_feeds import FeedLost
from tests.scheduler_setup import idle_stats, make_scheduler


def test_a_prefix_the_decode_worker_holds_is_counted_in_blocks():
    """D's prefix hit was passed to the prediction in tokens where blocks were
    meant: one block held read as sixteen, and the transfer of the blocks D
    lacked was priced as an empty chunk (267 ms predicted for 558 ms here)."""
    scheduler = make_scheduler(ttft_ms=10_000)
    models = scheduler.view.models
    for blocks in (1, 4, 8, 16):  # the p0 -> d0 link: 2 ms a chunk and 20 ms a block
        models.transfers.observe("p0", "d0", [ChunkTiming(0, blocks, 0.0, 0.0, 0.0, 0.002 + 0.020 * blocks)])
    prompt = list(range(256))  # 16 blocks
    scheduler.view.prefix["d0"].insert(block_hashes(prompt, 16, scheduler.kv_seed)[:1])  # D holds the first
    held_one = models.predict("p0", "d0", len(prompt), 0, decode_cached_blocks=1)
    assert scheduler.plan(prompt).ttft_s == pytest.approx(held_one.ttft_s)
    assert held_one.ttft_s > models.predict("p0", "d0", len(prompt), 0, decode_cached_blocks=16).ttft_s + 0.25


def test_a_request_past_its_deadline_before_its_first_token_ends_timed_out():
    """The deadline's error event came after the attempt's record was gone, and
    the retry it started looked the record up: a KeyError, not 'request timed
    out' (and a retry after the deadline would have timed out at once)."""
    scheduler = make_scheduler(ttft_ms=10_000)
    limits = scheduler.settings.limits.model_copy(update={"request_timeout_s": 0.3})
    scheduler.settings = scheduler.settings.model_copy(update={"limits": limits})

    async def stuck(request, choice, inflight):  # a prefill that never ends
        await asyncio.Event().wait()
        yield None

    scheduler._events = stuck

    async def run():
        return [e async for e in scheduler.generate(list(range(100)), SamplingParams(max_new_tokens=4))]

    (event,) = asyncio.run(run())
    assert event.finished and event.error == "request timed out"


class _CallWhoseFeedIsLostOnce:
    """A P/D call whose first attempt has D reserve, then loses D's feed (D
    unreachable for now); later attempts serve one token."""

    attempts: list[tuple[str, str]] = []

    def __init__(self, prefill, decode, request, *args, on_reserved=None, on_prefilled=None, **kwargs):
        self.request, self.decode, self.on_reserved = request, decode, on_reserved
        self.prefill_result = self.prefill_error = self.reservation = None

    async def events(self):
        self.attempts.append((self.request.request_id, self.decode))
        if len(self.attempts) == 1:
            self.on_reserved()
            raise FeedLost(f"request {self.request.request_id}: the worker is unreachable for now")
        yield TokenEvent(self.request.request_id, [7], "x", None, True, "length", time.time())


def test_a_decode_worker_whose_feed_was_lost_is_left_out_of_the_retry(monkeypatch):
    """Its feed lost after D reserved, the retry left out the P (which had done
    nothing wrong) and kept the D: with one P, no worker could take the retry."""
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    for worker_id, member in scheduler.view.members.items():  # (the stand-in call is given the worker's name)
        scheduler.view.members[worker_id] = dataclasses.replace(member, handle=worker_id)
    scheduler.view.models.seed_from("d0", "d1")
    _CallWhoseFeedIsLostOnce.attempts = []
    monkeypatch.setattr(service, "DisaggregatedCall", _CallWhoseFeedIsLostOnce)

    async def run():
        return [e async for e in scheduler.generate(list(range(100)), SamplingParams(max_new_tokens=1))]

    events = asyncio.run(run())
    assert events[-1].finish_reason == "length"
    (_, first), (_, second) = _CallWhoseFeedIsLostOnce.attempts
    assert first != second  # the retry went to the other D, through the same P


class _CallWhoseLenderEnds:
    """A P/D call whose attempts play `script` in turn: "lender ended" (D ended it,
    the request that lent it KV blocks having ended before writing them), "feed
    lost" (after D reserved), or "served" (one token)."""

    script: list[str] = []
    attempts: list[tuple[str, str, str]] = []  # (what it played, its P, its D)

    def __init__(self, prefill, decode, request, *args, on_reserved=None, on_prefilled=None, **kwargs):
        self.request, self.prefill, self.decode, self.on_reserved = request, prefill, decode, on_reserved
        self.prefill_result = self.prefill_error = self.reservation = None

    async def events(self):
        played = self.script[len(self.attempts)]
        self.attempts.append((played, self.prefill, self.decode))
        self.on_reserved()
        request_id = self.request.request_id
        if played == "feed lost":
            raise FeedLost(f"request {request_id}: the worker is unreachable for now")
        if played == "lender ended":
            yield TokenEvent(request_id, [], "", None, True, "error", time.time(),
                             error="request r0, whose KV blocks it shared, ended before they came",
                             borrowed_kv_lost=True)
            return
        yield TokenEvent(request_id, [7], "x", None, True, "length", time.time())


def _play(monkeypatch, scheduler, script: list[str]) -> list:
    for worker_id, member in scheduler.view.members.items():  # (the stand-in call is given the worker's name)
        scheduler.view.members[worker_id] = dataclasses.replace(member, handle=worker_id)
    _CallWhoseLenderEnds.script, _CallWhoseLenderEnds.attempts = script, []
    monkeypatch.setattr(service, "DisaggregatedCall", _CallWhoseLenderEnds)

    async def run():
        return [e async for e in scheduler.generate(list(range(100)), SamplingParams(max_new_tokens=1))]

    return asyncio.run(run())


def test_a_request_whose_lender_ended_is_tried_again_on_its_pair(monkeypatch):
    """A burst sharing a new system prompt borrows the first one's blocks on D; the
    first's client left before they came, so D ended the rest. Their retry left
    out their P, which had done nothing wrong: with one P every one of them was
    answered 503. No worker is left out, and such a try is not the one retry."""
    scheduler = make_scheduler(ttft_ms=10_000)
    events = _play(monkeypatch, scheduler, ["lender ended"] * service.BORROWED_KV_RETRIES + ["served"])
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert {(p, d) for _, p, d in _CallWhoseLenderEnds.attempts} == {("p0", "d0")}
    assert f'tandem_retries_total{{reason="lender_ended"}} {service.BORROWED_KV_RETRIES}' in scheduler.metrics.render()


def test_after_its_lender_ended_a_request_still_has_its_retry_after_a_failure(monkeypatch):
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    events = _play(monkeypatch, scheduler, ["lender ended", "feed lost", "served"])
    assert events[-1].finish_reason == "length"
    metrics = scheduler.metrics.render()
    assert 'tandem_retries_total{reason="lender_ended"} 1' in metrics and 'retries_total{reason="failed"} 1' in metrics
    (_, _, lost_on), (_, _, served_on) = _CallWhoseLenderEnds.attempts[1:]
    assert served_on != lost_on  # (the D whose feed was lost is left out)


def test_a_request_whose_lenders_keep_ending_is_not_tried_for_ever(monkeypatch):
    events = _play(monkeypatch, make_scheduler(ttft_ms=10_000, decodes=("d0", "d1")),
                   ["lender ended"] * (service.BORROWED_KV_RETRIES + 1) + ["served"])
    assert events[-1].error.endswith("ended before they came")
    assert len(_CallWhoseLenderEnds.attempts) == service.BORROWED_KV_RETRIES + 1


class _CallWhosePrefillDiesOnce:
    """A P/D call whose first attempt's P dies before the first token."""

    num_calls = 0

    def __init__(self, prefill, decode, request, *args, on_reserved=None, on_prefilled=None, **kwargs):
        self.prefill, self.request, self.on_reserved = prefill, request, on_reserved
        self.prefill_result = self.prefill_error = self.reservation = None

    async def events(self):
        type(self).num_calls += 1
        self.on_reserved()
        if self.num_calls == 1:
            self.prefill_error = ray.exceptions.ActorDiedError()
            yield TokenEvent(self.request.request_id, [], "", None, True, "error", time.time(),
                             error="prefill failed: the actor died")
            return
        yield TokenEvent(self.request.request_id, [7], "x", None, True, "length", time.time())


def test_a_prefill_worker_that_died_on_the_first_attempt_is_reported_at_once(monkeypatch):
    """The retry closed the first attempt at its error event, before the lines
    after it that report a dead P: other requests were routed to it until the
    next refresh found it."""
    scheduler = make_scheduler(ttft_ms=10_000)
    view = scheduler.view
    view.members["p1"] = Member("p1", "prefill", None)
    view.stats["p1"], view.prefix["p1"] = view.stats["p0"], PrefixIndex(1000)
    view.profiled.add("p1")
    view.models.seed_from("p0", "p1")
    reported = []

    async def report_dead(worker_id, handle=None):  # (the pool manager's part of it is tested with the pools)
        reported.append(worker_id)
        view.members.pop(worker_id, None)

    monkeypatch.setattr(view, "report_dead", report_dead)
    _CallWhosePrefillDiesOnce.num_calls = 0
    monkeypatch.setattr(service, "DisaggregatedCall", _CallWhosePrefillDiesOnce)

    async def run():
        return [e async for e in scheduler.generate(list(range(100)), SamplingParams(max_new_tokens=1))]

    events = asyncio.run(run())
    assert events[-1].finish_reason == "length"
    assert len(reported) == 1 and reported[0] not in view.members


def _remote(fn):
    """An actor method's stand-in: `.remote(...)` gives an awaitable."""
    return type("Method", (), {"remote": staticmethod(fn)})()


async def _no_events(worker_id, cursor):
    return CacheEvents(cursor, False, [])


def _stand_in_pool(listed, read_stats, read_events, read_profile=None):
    """A pool manager's stand-in: `listed()` its members, (worker id, role); each
    one's `stats`, `cache_events` (and `profile`) answered by `read_stats(worker_id)`,
    `read_events(worker_id, cursor)` (and `read_profile(worker_id)`: coroutines)."""
    class Handle:
        def __init__(self, worker_id: str) -> None:
            self.stats = _remote(lambda: read_stats(worker_id))
            self.cache_events = _remote(lambda cursor: read_events(worker_id, cursor))
            if read_profile is not None:
                self.profile = _remote(lambda: read_profile(worker_id))

    async def answer(value):
        return value

    class Pool:
        list_members = _remote(lambda: answer([Member(w, role, Handle(w)) for w, role in listed()]))
        report = _remote(lambda report: answer(None))
        start_failures = _remote(lambda: answer({}))

    return Pool()


def test_a_request_admitted_while_a_reading_of_d_was_on_its_way_is_not_in_it():
    """D's stats were stamped when their answer came back, so a request admitted
    while the call was on its way (its reservation not in D's figures) counted as
    in them: its prompt's blocks were free in `headroom` (100 here, with 4)."""
    scheduler = make_scheduler(ttft_ms=10_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.pools_applied = True
    used = {"d0": 900}  # of D's 1000 blocks

    async def read(worker_id):
        figures = idle_stats(worker_id, num_used_blocks=used.get(worker_id, 0))  # as it arrives
        await asyncio.sleep(0.3)  # the answer's way back
        return figures

    view.pool = _stand_in_pool(lambda: [("p0", "prefill"), ("d0", "decode")], read, _no_events)

    async def run():
        await view.refresh()
        refreshing = asyncio.ensure_future(view.refresh())
        await asyncio.sleep(0.05)  # D has taken its figures
        view.models.inflight["burst"] = InFlight("burst", "p0", "d0", 96 * 16 - 1, 1, 0.5)  # admitted, reserved
        used["d0"] = 996
        await refreshing
        return view.rooms.headroom("d0")

    assert asyncio.run(run()) <= 4


def test_another_replicas_backlog_is_priced_as_its_prompts_not_as_one():
    """The other replicas' backlog on a P was priced as one prompt of all its
    tokens: the attention term, which grows with a prompt's length squared, put
    16 queued 1000-token prompts at 1.24x what they take (3.5x with a heavier
    attention share)."""
    models = WorkerModels(block_size=16)
    for chunks in (((256, 0),), ((256, 256),), ((256, 512),), ((256, 768),), ((128, 0),), ((64, 2048),),
                   ((256, 4096),)):
        features = prefill_step_features(chunks)
        models.prefill_model("p0").observe(features, 0.005 + 0.0001 * features[0] + 4e-6 * features[1])
    one = models.prefill_s("p0", 1000, 0)
    models.peers = PeerLoad(backlog_tokens={"p0": 16_000}, backlog_prompts={"p0": 16})
    assert models.queued_prefill_s("p0") == pytest.approx(16 * one, rel=0.01)
    report = OutcomeRecorder("r1").report([InFlight(f"r{i}", None, "p0", 1000, 4, 0.5) for i in range(3)])
    assert report.backlog_tokens == {"p0": 3000} and report.backlog_prompts == {"p0": 3}


def test_a_worker_forgotten_while_its_cache_events_come_fails_no_refresh():
    """Two refreshes at once (the loop's and a request's while the view was not
    ready; the app now runs one at a time) and one forgot a worker whose events
    the other was reading: a KeyError, the view not ready, 503s until the next."""
    scheduler = make_scheduler(ttft_ms=10_000)
    view = scheduler.view
    view.pools_applied = True
    listed = {"p0", "d0"}

    async def read(worker_id):
        return idle_stats(worker_id)

    async def events(worker_id, cursor):
        if worker_id == "p0" and "p0" in listed:
            listed.discard("p0")  # p0 leaves while its events come,
            await view.refresh()  # and another refresh forgets it
        return await _no_events(worker_id, cursor)

    roles = {"p0": "prefill", "d0": "decode"}
    view.pool = _stand_in_pool(lambda: [(w, roles[w]) for w in sorted(listed)], read, events)
    asyncio.run(view.refresh())  # (p0 and d0 listed and read: indexed from here on)
    listed.add("p0")
    asyncio.run(view.refresh())
    assert "p0" not in view.prefix and "d0" in view.prefix


def test_a_worker_a_request_found_dead_during_a_refresh_is_not_routable_after_it():
    """d1 answered the refresh's stats call, then a request found it dead (and
    `report_dead` forgot it) before the answer was read: stored, and seeded from
    d0's profile, it was routable until the next refresh."""
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0",))
    view = scheduler.view
    view.pools_applied = True
    dead = []

    async def read(worker_id):
        if worker_id == "d1" and view.members.get("d1") is not None and "d1" in view.profiled:
            await view.report_dead("d1", view.members["d1"].handle)  # (a request's call failed meanwhile)
        return idle_stats(worker_id)

    view.pool = _stand_in_pool(lambda: [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")], read, _no_events)
    view.pool.report_dead = _remote(lambda worker_id: _answered(dead, worker_id))
    asyncio.run(view.refresh())
    assert view.routable("decode") == ["d0", "d1"]  # (d1 seeded from d0's profile)
    asyncio.run(view.refresh())
    assert dead == ["d1"] and view.routable("decode") == ["d0"] and "d1" not in view.stats


def test_a_worker_that_does_not_answer_holds_no_refresh_nor_its_report(monkeypatch):
    """One worker's stats (and cache events) never came back (its node cut off,
    not yet declared dead): the refresh waited for good, and this replica sent
    the pool manager no report, which forgot it after 30 s and let a drain kill
    a worker under its requests. The others' figures and the report go on."""
    view = _view_waiting_at_most(monkeypatch, 0.2)
    reports = []

    async def read(worker_id):
        if worker_id == "d1":
            await asyncio.sleep(3600)
        return idle_stats(worker_id)

    async def events(worker_id, cursor):
        if worker_id == "d1":
            await asyncio.sleep(3600)
        return await _no_events(worker_id, cursor)

    view.pool = _stand_in_pool(lambda: [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")], read, events)
    view.pool.report = _remote(lambda report: _answered(reports, report))
    started = time.monotonic()
    asyncio.run(within(view.refresh(), 10))
    assert time.monotonic() - started < 5 and len(reports) == 1
    assert set(view.stats) == {"p0", "d0"}


def test_cold_workers_profiles_are_asked_for_at_once_one_a_role(monkeypatch):
    """Eight cold prefill workers (no profiled peer) still profiling: each was
    asked in turn, up to WORKER_ANSWER_S each, and one refresh took eight times
    that (40 s: past the 30 s the pool manager waits for a replica's report).
    One a role is asked, the roles at once; the others are seeded from it later."""
    view = _view_waiting_at_most(monkeypatch, 0.3)
    asked = []

    async def read(worker_id):
        return idle_stats(worker_id)

    async def never(worker_id):
        asked.append(worker_id)
        await asyncio.sleep(3600)

    listed = [(f"p{i}", "prefill") for i in range(8)] + [("d0", "decode")]
    view.pool = _stand_in_pool(lambda: listed, read, _no_events, never)
    view.profiled.clear()  # (cold: none profiled)
    started = time.monotonic()
    asyncio.run(within(view.refresh(), 10))
    assert time.monotonic() - started < 1.5 and sorted(asked) == ["d0", "p0"]


def _view_waiting_at_most(monkeypatch, seconds: float):
    """A scheduler's view whose refresh waits `seconds` for each worker's answer."""
    monkeypatch.setattr(pool_view, "WORKER_ANSWER_S", seconds)
    view = make_scheduler(ttft_ms=10_000).view
    view.pools_applied = True
    return view


async def _answered(reports: list, report):
    reports.append(report)


def test_a_flush_that_could_not_reach_a_worker_says_so():
    """`/flush_cache` with a worker unreachable for now (Ray's ActorUnavailableError)
    answered "Cache flushed." without it: a cold benchmark run then read that
    worker's prefixes as cached. The others are flushed; the answer is a 503
    naming it."""
    view = make_scheduler(ttft_ms=10_000).view
    flushed = []

    async def flush(worker_id):
        if worker_id == "d0":
            raise ray.exceptions.ActorUnavailableError("unreachable for now", None)
        flushed.append(worker_id)
        return True

    def member(worker_id, role):
        handle = type("Handle", (), {"reset_prefix_cache": _remote(lambda: flush(worker_id))})()
        return Member(worker_id, role, handle)

    view.members = {w: member(w, role) for w, role in [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]}
    view.profiled = set(view.members)
    with pytest.raises(service.ApiError, match="workers d0 could not be reached: their prefix caches were not "
                                               r"flushed \(2 others were\)") as refused:
        asyncio.run(view.flush_prefix_caches())
    assert refused.value.status == 503 and sorted(flushed) == ["d1", "p0"] and "d0" in view.members
    del view.members["d0"]
    assert asyncio.run(view.flush_prefix_caches()) == ["d1", "p0"]


def test_the_worker_endpoints_reach_the_workers_up_while_a_pool_is_not_ready():
    """`/abort_request` and `/flush_cache` (cluster/worker_endpoints.py) waited for
    ready pools: while one was replaced they were 503s, and the requests running
    on the other pool's workers could not be aborted. They act on the workers
    the view has."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from cluster.worker_endpoints import router

    view = make_scheduler(ttft_ms=10_000).view
    asked = []

    def member(worker_id, role):
        async def abort_named(client_rid, asked_s):
            asked.append((worker_id, client_rid))
            return {f"{client_rid}-on-{worker_id}"}

        async def reset():
            return True

        handle = type("Handle", (), {"abort_named": _remote(abort_named), "reset_prefix_cache": _remote(reset)})()
        return Member(worker_id, role, handle)

    view.members = {"d0": member("d0", "decode"), "d1": member("d1", "decode")}  # (its prefill pool down)
    view.profiled, view.ready = {"d0"}, False  # (d1 still loading its model: asked nothing, it holds nothing)
    app = FastAPI()
    app.include_router(router)

    async def refreshed_view():
        return view

    app.state.refreshed_view = refreshed_view
    client = TestClient(app)
    aborted = client.post("/abort_request", json={"rid": "mine"})
    assert aborted.status_code == 200 and aborted.json() == {"aborted": 1} and asked == [("d0", "mine")]
    assert client.post("/flush_cache").json()["workers"] == ["d0"]


def test_a_role_whose_only_worker_drains_is_not_ready():
    """/health said 200 "ready" while the only decode worker drained (by hand,
    no room for another beside it): every request got a 503 for want of a
    routable worker. A draining worker makes no role ready."""
    view = make_scheduler(ttft_ms=10_000).view
    view.pool = _stand_in_pool(lambda: [("p0", "prefill"), ("d0", "decode")],
                               lambda worker_id: _answer(idle_stats(worker_id)), _no_events)
    asyncio.run(view.refresh())
    assert view.ready and view.health()[0] == 200
    listed = view.pool.list_members.remote

    async def with_d0_draining():
        return [dataclasses.replace(m, draining=m.worker_id == "d0") for m in await listed()]

    view.pool.list_members = _remote(with_d0_draining)
    asyncio.run(view.refresh())
    assert not view.ready and view.health()[0] == 503 and view.routable("decode") == []


async def _answer(value):
    return value
