"""The pool manager's control of its workers (cluster/pool_manager.py,
cluster/pool_autoscaler.py), in this process, on a clock of its own, with
stand-in worker handles: what a worker answers (its first answer, its profile,
pings, stats) is set by each test. The same control against real workers on Ray
is tested in tests/test_start_failures.py, tests/test_pool_sizes.py and
tests/test_autoscale_cluster.py; these are the interleavings found by a review
that those cannot time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses

import pytest
import ray

import cluster.pool_autoscaler as pool_autoscaler
import cluster.pool_manager as pool_manager
from actors.worker_base import WorkerStartup, WorkerStats
from cluster.autoscaling import Shortfall

BASE = {"model": {"preset": "tiny", "arch": "qwen2"}, "engine": {"block_size": 16, "num_kv_blocks": 256},
        "response_store_mib": 0, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def _answer(value=None, error=None) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class _Ref:
    """An ObjectRef's two faces the pool manager uses: `future()` and await."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def future(self):
        return self._future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class _Method:
    def __init__(self, answer) -> None:
        self.remote = answer


class Worker:
    """A worker actor's handle, answering as the test says."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.ready, self.profiled = concurrent.futures.Future(), concurrent.futures.Future()
        self.killed = False
        self.ping_error: BaseException | None = None  # what pings raise from now on
        self.startup_times = _Method(lambda: _Ref(self.ready))
        self.profile = _Method(lambda: _Ref(self.profiled))
        self.ping = _Method(self._ping)
        self.stats = _Method(lambda: _Ref(_answer(self._stats())))
        self.check_accounting = self.stats

    def _ping(self):
        if self.killed:
            return _Ref(_answer(error=ray.exceptions.ActorDiedError()))
        return _Ref(_answer(error=self.ping_error) if self.ping_error else _answer(self.worker_id))

    def _stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, num_blocks=100, num_used_blocks=0, num_cached_blocks=0, num_running=0,
                           num_waiting=0, num_reserved=0, num_channels=0, last_step_s=0.0)

    def come_up(self) -> None:
        for future, value in ((self.ready, WorkerStartup(0.0, 0.0, 0.0)), (self.profiled, "profiled")):
            if not future.done():
                future.set_result(value)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def pools(monkeypatch):
    """`make(settings)`: a PoolManager whose workers are `Worker`s (in `workers`,
    by id) and whose autoscaler runs on a `Clock`; its loops are driven by hand."""
    workers: dict[str, Worker] = {}

    def start_worker(kind, worker_id, *args, **kwargs):
        workers[worker_id] = Worker(worker_id)
        return workers[worker_id]

    def kill(handle, **kwargs):
        handle.killed = True

    monkeypatch.setattr(pool_manager, "start_worker", start_worker)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 100.0, "GPU": 100.0})

    def make(settings: dict):
        clock = Clock()
        init = pool_autoscaler.PoolAutoscaler.__init__
        monkeypatch.setattr(pool_autoscaler.PoolAutoscaler, "__init__",
                            lambda self, manager, s, roles: init(self, manager, s, roles, clock=clock))
        manager = pool_manager.PoolManager({**BASE, **settings})
        monkeypatch.setattr(pool_autoscaler.PoolAutoscaler, "__init__", init)
        manager._ensure_health_loop = lambda: None
        return manager, clock

    return make, workers


def _events(manager) -> list[tuple[str, str | None]]:
    return [(e.kind, e.worker_id) for e in manager.scaler.events]


def test_a_worker_unreachable_for_a_moment_is_not_killed_by_the_health_loop(pools):
    """Ray's ActorUnavailableError (a RayActorError) from one ping: the health
    loop killed the serving worker with all its requests, and started another."""
    make, workers = pools
    manager, clock = make({})
    for worker in workers.values():
        worker.come_up()
    manager.scaler._check_readiness(clock())
    (decode,) = [w for w in workers.values() if w.worker_id.startswith("d")]
    decode.ping_error = ray.exceptions.ActorUnavailableError("unreachable for now", None)
    manager.health_interval_s = 0.01

    async def run():
        loop = asyncio.ensure_future(manager._health_loop())
        await asyncio.sleep(0.1)
        loop.cancel()

    asyncio.run(run())
    assert not decode.killed and decode.worker_id in manager.members
    decode.killed = True  # and one that is gone is replaced

    asyncio.run(run())
    assert decode.worker_id not in manager.members and ("replaced", decode.worker_id) in _events(manager)


def test_a_worker_drained_while_it_could_not_start_is_not_started_again(pools):
    """A worker stuck starting (no node for it), drained by hand: the drain
    started one in its place, and when the stuck one timed out the control loop
    counted a start failure and started another besides: one worker too many,
    so it drained a serving one."""
    make, workers = pools
    manager, clock = make({"prefill": {"replicas": 2}, "autoscaling": {"start_timeout_s": 30.0}})
    stuck = sorted(w for w in workers if w.startswith("p"))[1]

    async def run():
        for worker_id, worker in workers.items():
            if worker_id != stuck:
                worker.come_up()
        await manager.scaler.step()
        assert await manager.drain(stuck, "by hand")
        for _ in range(40):
            for worker_id, worker in list(workers.items()):
                if worker_id != stuck:
                    worker.come_up()
            clock.now += 2.0
            await manager.scaler.step()

    asyncio.run(run())
    events = _events(manager)
    assert ("start_failed", stuck) not in events and not [e for e in events if e[0] == "down"]
    assert len([w for kind, w in events if kind == "started" and w.startswith("p")]) == 3  # 2, and one for the drain


def test_a_worker_drained_while_its_stats_are_asked_for_is_not_a_start_failure_when_they_say_it_failed(
        pools, monkeypatch):
    """The stats poll took its list of members, a drain by hand began while it
    waited for their answers, and the drained worker's stats named a failed
    start-up profile: judged by the list's copy (not draining), it was a start
    failure besides the drain, one more in the role's run (its next restart
    waiting twice as long) and a restart queued."""
    make, workers = pools
    manager, clock = make({})
    for worker in workers.values():
        worker.come_up()
    manager.scaler._check_readiness(clock())
    drained = next(w for w in workers.values() if w.worker_id.startswith("d"))
    failed = dataclasses.replace(drained._stats(), profile_error="boom")
    drained._stats = lambda: failed
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0, "GPU": 0.0})  # no room: drains at once

    async def run():
        poll = asyncio.ensure_future(manager.scaler._poll_stats(clock()))
        await asyncio.sleep(0)  # (the poll waits for the answers)
        assert await manager.drain(drained.worker_id) == "draining"
        await poll

    asyncio.run(run())
    assert ("start_failed", drained.worker_id) not in _events(manager)
    assert manager.scaler.restarts.num_waiting("decode") == 0 and not manager.scaler.start_failures()


def test_a_redeploy_keeps_an_autoscaling_pools_cooldown(pools):
    """A redeploy that changed an autoscaling pool's settings rebuilt its policy
    from scratch: the scale-down cooldown under way was dropped, and the pool
    scaled down at its next step."""
    make, workers = pools
    settings = {"decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 3},
                "autoscaling": {"scale_down_cooldown_s": 60.0}}
    manager, clock = make(settings)

    async def run():
        await manager.scaler.step()  # the pool starting: it settles now
        for worker in workers.values():
            worker.come_up()
        clock.now += 10
        await manager.scaler.step()
        await manager.apply_pools({**BASE, **settings, "decode": {"replicas": 2, "min_replicas": 1,
                                                                   "max_replicas": 4}})
        clock.now += 2
        await manager.scaler.step()

    asyncio.run(run())
    assert not [e for e in _events(manager) if e[0] == "down"]


@pytest.mark.parametrize("change", [{"decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 4}},
                                    {"autoscaling": {"scale_down_cooldown_s": 60.0, "interval_s": 5.0}},
                                    {"slo": {"ttft_ms": 900}}])
def test_a_redeploy_keeps_the_sizes_an_autoscaling_pool_fell_short_at(pools, change):
    """A redeploy of the pool's sizes, or of any autoscaling or SLO setting,
    rebuilt its policy with no memory of the sizes that fell short: the pool came
    down to one again, fell short again and came back up, a model load each time."""
    make, _ = pools
    settings = {"decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 3},
                "autoscaling": {"scale_down_cooldown_s": 60.0}}
    manager, _ = make(settings)
    short_at_one = {1: Shortfall(at_s=5.0, rate=3.0)}
    manager.scaler.policies["decode"].shortfalls = dict(short_at_one)

    asyncio.run(manager.apply_pools({**BASE, **settings, **change}))
    assert manager.scaler.policies["decode"].shortfalls == short_at_one


def test_a_restarted_worker_that_ran_its_profile_ends_the_run_of_failures_though_it_died_before_a_step(pools):
    """Only a control step ended a run of start failures; a restarted worker that
    ran its profile and was lost before the next step left the run going: /health
    said 'failing' with the old error, and the next failure waited twice as long."""
    make, workers = pools
    manager, clock = make({"autoscaling": {"interval_s": 30.0, "restart_backoff_s": 2.0}})
    first_decode = next(w for w in workers if w.startswith("d"))

    async def run():
        for worker_id, worker in workers.items():
            if worker_id != first_decode:
                worker.come_up()
        workers[first_decode].ready.set_exception(ray.exceptions.ActorDiedError())  # died starting
        await manager.scaler.step()
        clock.now += 2.0
        await manager.scaler.step()  # its restart
        restarted = max((w for w in workers if w.startswith("d")), key=lambda w: int(w[1:]))
        workers[restarted].come_up()  # it ran its profile ...
        workers[restarted].killed = True
        await manager.report_dead(restarted, "node lost")  # ... and was lost before a step saw it

    asyncio.run(run())
    assert manager.scaler.start_failures() == {}


def test_a_decode_pool_whose_workers_have_handshakes_waiting_for_kv_is_not_scaled_down(pools):
    """The decode pool's load left out D's line: two full D's (their blocks mostly
    reserved for prompts in prefill) with a dozen handshakes each waiting for
    room read as 10% used, and one was drained."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 3}})
    for worker_id, worker in workers.items():
        worker.come_up()
        if worker_id.startswith("d"):
            full = dataclasses.replace(worker._stats(), num_used_blocks=98, num_reserved_blocks=88, num_reserved=8,
                                       num_waiting_handshakes=12, num_waiting_blocks=130)
            worker.stats = _Method(lambda full=full: _Ref(_answer(full)))
    asyncio.run(manager.scaler.step())
    assert not [e for e in _events(manager) if e[0] == "down"]


def test_a_worker_waiting_for_a_node_does_not_hold_up_the_health_rounds(pools):
    """The health loop pinged starting workers too, and each round waited out
    `health_timeout_s` for one still waiting for a node: a serving worker's death
    was found that much later."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2}})
    waiting, serving = sorted(w for w in workers if w.startswith("d"))
    for worker_id, worker in workers.items():
        if worker_id != waiting:
            worker.come_up()
    workers[waiting].ping = _Method(lambda: _Ref(concurrent.futures.Future()))  # never answers
    manager.scaler._check_readiness(clock())
    manager.health_interval_s, manager.health_timeout_s = 0.01, 5.0
    workers[serving].killed = True

    async def run():
        loop = asyncio.ensure_future(manager._health_loop())
        await asyncio.sleep(0.5)
        loop.cancel()

    asyncio.run(run())
    assert ("replaced", serving) in _events(manager)


def test_a_health_round_that_fails_is_logged_and_the_next_goes_on(pools):
    """A round whose replacement raised ended the health loop, unsaid: no death
    was seen until some call to the manager started the loop again."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2}})
    for worker in workers.values():
        worker.come_up()
    manager.scaler._check_readiness(clock())
    manager.health_interval_s = 0.01
    first = sorted(w for w in workers if w.startswith("d"))[0]
    workers[first].killed = True
    report_dead, failed = manager.report_dead, []

    async def report_once_failing(worker_id, reason):
        if not failed:
            failed.append(worker_id)
            raise RuntimeError("a start that failed")
        await report_dead(worker_id, reason)

    manager.report_dead = report_once_failing

    async def run():
        loop = asyncio.ensure_future(manager._health_loop())
        await asyncio.sleep(0.3)
        loop.cancel()

    asyncio.run(run())
    assert failed == [first] and ("replaced", first) in _events(manager)


def test_a_fixed_pool_shrunk_stops_what_has_not_started_before_draining_a_serving_worker(pools):
    """Decode at 2, d2 waiting for a node, redeployed at 1: the one serving
    worker was drained (only ready workers were candidates) and, with no room
    beside it, at once: no decode worker took requests until d2 was placed.
    Now the waiting one goes; so does a restart still waiting, before either."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2}})
    serving = "d1"

    async def run():
        for worker_id, worker in workers.items():
            if worker_id in ("p0", serving):
                worker.come_up()
        clock.now += 2
        await manager.scaler.step()
        await manager.apply_pools({**BASE, "decode": {"replicas": 1}})
        clock.now += 2
        await manager.scaler.step()

    asyncio.run(run())
    decode = {w: m for w, m in manager.members.items() if m.role == "decode"}
    assert list(decode) == [serving] and not decode[serving].draining
    assert workers["d2"].killed and ("down", "d2") in _events(manager)


def test_a_worker_that_dies_in_a_pool_above_its_new_size_is_not_replaced(pools):
    """Decode at 3, redeployed at 1, and a serving worker dead before the control
    loop's next step: it was replaced all the same, a worker started only to be
    stopped. Now it is not; one below the maximum still is."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 3}})

    async def run():
        for worker in workers.values():
            worker.come_up()
        clock.now += 2
        await manager.scaler.step()
        await manager.apply_pools({**BASE, "decode": {"replicas": 1}})
        gone = await manager.report_dead("d1")
        clock.now += 2
        await manager.scaler.step()
        started = sorted(workers)
        await manager.apply_pools({**BASE, "decode": {"replicas": 2}})
        return gone, started, await manager.report_dead("d3")  # (d2 drains, to size 1)

    gone, started, replacement = asyncio.run(run())
    assert gone is None and ("died", "d1") in _events(manager) and started == ["d1", "d2", "d3", "p0"]
    assert replacement is not None and ("replaced", "d3") in _events(manager)


def test_a_fixed_pool_shrunk_drops_a_waiting_restart_first(pools):
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2}, "autoscaling": {"restart_backoff_s": 60.0,
                                                                        "restart_backoff_max_s": 120.0}})

    async def run():
        for worker_id, worker in list(workers.items()):
            if worker_id == "d2":
                worker.ready.set_exception(ray.exceptions.ActorDiedError())
            else:
                worker.come_up()
        clock.now += 2
        await manager.scaler.step()
        assert manager.scaler.restarts.num_waiting("decode") == 1
        await manager.apply_pools({**BASE, "decode": {"replicas": 1}})
        clock.now += 2
        await manager.scaler.step()

    asyncio.run(run())
    assert manager.scaler.restarts.num_waiting("decode") == 0
    assert [(w, m.draining) for w, m in manager.members.items() if m.role == "decode"] == [("d1", False)]


def test_a_scale_up_no_node_takes_is_not_started_again_and_the_pool_scales_down_later(pools):
    """An autoscaling pool's new worker given up after start_timeout_s was
    restarted after the backoff, given up again, for good: its policy held
    ("in progress") all the while, and an idle pool never scaled down."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 3},
                           "autoscaling": {"start_timeout_s": 60.0, "scale_down_cooldown_s": 60.0}})
    first = set(workers)

    async def run():
        for worker_id in first:
            workers[worker_id].come_up()
        clock.now += 2
        await manager.scaler.step()
        manager._start("decode")  # (as a scale-up would: no node will take it)
        for _ in range(200):  # 400 s, idle
            clock.now += 2
            await manager.scaler.step()

    asyncio.run(run())
    events = _events(manager)
    assert [kind for kind, _ in events].count("start_failed") == 1 and ("restart", None) not in events
    assert any(kind == "down" for kind, _ in events), "the idle pool scaled down"
    failure = manager.scaler.start_failures()["decode"]
    assert failure.failures_in_a_row == 1 and failure.next_start_in_s is None


@pytest.mark.parametrize("by_hand", [False, True])
def test_a_scale_up_while_a_scaled_down_worker_drains_takes_that_worker_back(pools, by_hand):
    """Prefill 2 (min 1, max 3), idle: one is scaled down and drains; a backlog
    comes before it has: the scale-up waited out the drain, then started a new
    worker. Now the draining one serves again at once, and none starts. Not one
    drained by hand as well (`tandem drain` of the worker the policy drains
    already, "draining already"): it was taken back, undoing the operator's drain."""
    make, workers = pools
    manager, clock = make({"prefill": {"replicas": 2, "min_replicas": 1, "max_replicas": 3},
                           "autoscaling": {"scale_down_cooldown_s": 10.0, "drain_grace_s": 60.0}})
    backlog = [0]
    manager.scaler.signals.backlog_tokens = lambda serving, now: backlog[0]

    async def run():
        for worker in workers.values():
            worker.come_up()
        for _ in range(20):  # idle: one prefill worker scaled down
            clock.now += 1
            await manager.scaler.step()
        (drained,) = [worker for kind, worker in _events(manager) if kind == "down"]
        if by_hand:
            await manager.drain(drained, "by hand (tandem drain)")
        backlog[0] = 10**6
        clock.now += 1
        await manager.scaler.step()
        return drained

    drained = asyncio.run(run())
    assert (("taken_back", drained) in _events(manager)) is not by_hand
    assert manager.members[drained].draining is by_hand and sorted(workers) == ["d2", "p0", "p1"]  # none started


def test_scale_ups_that_no_node_takes_are_tried_again_after_the_restart_backoff_not_each_cooldown(pools):
    """An autoscaling pool short of workers whose scale-ups no node takes: each
    failure in a row holds the next scale-up for as long as a restart would wait
    (2, 4, 8 s), not for the up cooldown (1 s) alone."""
    make, workers = pools
    manager, clock = make({"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 4},
                           "autoscaling": {"start_timeout_s": 10.0, "scale_up_cooldown_s": 1.0,
                                           "restart_backoff_s": 2.0, "restart_backoff_max_s": 60.0}})
    first = list(workers)
    manager.scaler.signals.backlog_tokens = lambda serving, now: 10**9  # (a prefill backlog no pool of 4 clears)

    ups = []  # the clock's time of each scale-up

    async def run():
        for worker_id in first:
            workers[worker_id].come_up()
        for _ in range(60):  # 60 s; the new workers never come up
            clock.now += 1
            seen = len(manager.scaler.events)
            await manager.scaler.step()
            ups.extend(clock.now for e in list(manager.scaler.events)[seen:] if e.role == "prefill" and e.kind == "up")

    asyncio.run(run())
    gaps = [later - earlier for earlier, later in zip(ups, ups[1:])]
    assert gaps[:2] == [11 + 2, 11 + 4], ups  # given up 11 s after each start, then the backoff's 2 s, 4 s


def test_workers_of_one_start_that_fail_together_are_one_failure_in_a_row(pools):
    """Four decode workers lost together (their node went) waited 2, 4, 8 and 16 s
    for their restarts, and /health said four failures in a row after one round."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 4}})

    async def run():
        for worker_id, worker in list(workers.items()):
            if worker_id.startswith("p"):
                worker.come_up()
            else:
                worker.ready.set_exception(ray.exceptions.ActorDiedError())
        clock.now += 2
        await manager.scaler.step()

    asyncio.run(run())
    failures = [e.reason for e in manager.scaler.events if e.kind == "start_failed"]
    assert len(failures) == 4 and all(reason.endswith("next start in 2 s") for reason in failures)
    assert manager.scaler.start_failures()["decode"].failures_in_a_row == 1


def test_a_pool_whose_start_fails_does_not_keep_the_other_pool_from_scaling(pools, monkeypatch):
    """A worker start that raised in the prefill pool's part of a step (Ray
    refusing its actor options) ended the step there: the decode pool, decided
    after it, was never scaled, its KV full, for as long as the start kept failing."""
    make, workers = pools
    manager, clock = make({"decode": {"replicas": 1, "min_replicas": 1, "max_replicas": 3}})
    for worker in workers.values():
        worker.come_up()
    asyncio.run(manager.scaler.step())
    start = pool_manager.start_worker

    def refused(kind, worker_id, *args, **kwargs):
        if kind == "prefill":
            raise ValueError("Ray refuses this placement (as a test)")
        return start(kind, worker_id, *args, **kwargs)

    monkeypatch.setattr(pool_manager, "start_worker", refused)
    asyncio.run(manager.apply_pools({**BASE, "prefill": {"replicas": 2},
                                     "decode": {"replicas": 1, "min_replicas": 1, "max_replicas": 3}}))
    full = dataclasses.replace(workers["d1"]._stats(), num_used_blocks=95, num_running=5)
    workers["d1"].stats = _Method(lambda: _Ref(_answer(full)))
    clock.now += 30
    asyncio.run(manager.scaler.step())
    assert [e.kind for e in manager.scaler.events if e.role == "decode"][-2:] == ["up", "started"]


def test_a_new_worker_unreachable_for_a_moment_at_its_first_answer_is_asked_again(pools):
    """Its first answer (and its profile's) failed as unreachable, not dead: kept
    failed, the worker was never ready, its pool held "in progress" for
    start_timeout_s (600 s), then it was killed as a start failure."""
    make, workers = pools
    manager, clock = make({"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 3}})
    unreachable = ray.exceptions.ActorUnavailableError("its node cut off for a moment (as a test)", b"\0" * 16)
    worker = workers["p0"]
    answers = {"startup_times": [_answer(error=unreachable)], "profile": [_answer(error=unreachable)]}
    for name, future in (("startup_times", worker.ready), ("profile", worker.profiled)):
        setattr(worker, name, _Method(lambda name=name, future=future: _Ref(
            answers[name].pop() if answers[name] else future)))
    manager.scaler.on_started(manager.members["p0"])  # (its track, asked through the methods above)
    for other in workers.values():
        other.come_up()
    clock.now += 2
    asyncio.run(manager.scaler.step())
    clock.now += 2
    asyncio.run(manager.scaler.step())
    assert manager.scaler.is_ready("p0") and manager.scaler.has_started("p0")
    assert "start_failed" not in [kind for kind, _ in _events(manager)]


def test_a_fixed_pool_shrunk_drains_a_worker_that_answered_during_the_step(pools):
    """Prefill redeployed at 2 then back at 1; the new worker's first answer came
    while the step waited for another's stats: the schedulers listed it (and
    route to it at once) but the step, reading it as not ready, stopped it under
    whatever it was sent."""
    make, workers = pools
    manager, clock = make({})

    async def run():
        for worker in list(workers.values()):
            worker.come_up()
        await manager.scaler.step()
        await manager.apply_pools({**BASE, "prefill": {"replicas": 2}})
        clock.now += 2
        await manager.scaler.step()  # p2 starts
        await manager.apply_pools(BASE)
        slow = concurrent.futures.Future()
        stats = workers["p0"]._stats()
        workers["p0"].stats = _Method(lambda: _Ref(slow))

        async def meanwhile():
            await asyncio.sleep(0.05)
            workers["p2"].come_up()
            listed = [m.worker_id for m in await manager.list_members()]
            slow.set_result(stats)
            return listed

        clock.now += 2
        return (await asyncio.gather(manager.scaler.step(), meanwhile()))[1]

    listed = asyncio.run(run())
    assert "p2" in listed and not workers["p2"].killed
    assert sum(m.draining for m in manager.members.values() if m.role == "prefill") == 1


def test_a_worker_whose_start_up_profile_never_answers_is_given_up(pools):
    """Found by a review: `start_timeout_s` bounded a worker's first answer only;
    one whose profile then hung counted as serving (the pool full at its size),
    was never routed to (its profile never came) and never started again."""
    make, workers = pools
    manager, clock = make({"autoscaling": {"start_timeout_s": 60.0}})
    (decode,) = [w for w in workers.values() if w.worker_id.startswith("d")]

    async def run():
        for worker in workers.values():
            worker.ready.set_result(WorkerStartup(0.0, 0.0, 0.0))
        workers["p0"].profiled.set_result("profiled")  # (d1's profile never answers)
        for _ in range(40):  # 80 s
            clock.now += 2
            await manager.scaler.step()

    asyncio.run(run())
    events = _events(manager)
    assert ("start_failed", decode.worker_id) in events and decode.killed
    assert ("start_failed", "p0") not in events


def test_a_scale_up_the_restart_backoff_holds_does_not_start_the_cooldown_again(pools):
    """Found by a review of the session's own change: each scale-up decided while
    the backoff held it (not carried out) settled the pool, and the one that came
    after the backoff's 20 s waited a 10 s cooldown more."""
    make, workers = pools
    manager, clock = make({"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 4},
                           "autoscaling": {"start_timeout_s": 10.0, "scale_up_cooldown_s": 10.0,
                                           "restart_backoff_s": 20.0, "restart_backoff_max_s": 60.0}})
    first = list(workers)
    manager.scaler.signals.backlog_tokens = lambda serving, now: 10**9
    ups = []

    async def run():
        for worker_id in first:
            workers[worker_id].come_up()
        for _ in range(60):
            clock.now += 1
            seen = len(manager.scaler.events)
            await manager.scaler.step()
            ups.extend(clock.now for e in list(manager.scaler.events)[seen:] if e.role == "prefill" and e.kind == "up")

    asyncio.run(run())
    assert ups[1] - ups[0] == 11 + 20, ups  # given up 11 s after its start, then the backoff's 20 s alone
