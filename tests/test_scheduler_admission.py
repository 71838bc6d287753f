"""The global scheduler's SLO admission and routing over a view of workers whose cost
models are known: queues, decode lines and room, other replicas' load, prefix hits
(no Ray)."""

from __future__ import annotations

import asyncio
import re
import time
import types

import pytest

from actors.messages import TokenEvent
from actors.sampling_params import SamplingParams
from cluster.admission import InFlight, SloRejected, WorkerModels
from cluster.cost_model import decode_features, prefill_features
from cluster.router import PrefixIndex
from cluster.scaling_signals import PeerLoad
from tests.scheduler_setup import fitted_models, idle_stats, make_scheduler


def test_a_queue_that_breaks_the_slo_rejects_and_a_relaxed_slo_admits():
    prompt = list(range(300))  # predicted prefill: 0.3 s on p0
    strict = make_scheduler(ttft_ms=1000)
    strict.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=2.0)
    with pytest.raises(SloRejected) as rejected:
        strict.plan(prompt)
    assert rejected.value.best.ttft_s == pytest.approx(2.3, abs=0.3)
    said = re.fullmatch(r"predicted TTFT (\d+) ms exceeds the SLO of 1000 ms", str(rejected.value))
    assert said and int(said.group(1)) == pytest.approx(2300, abs=300)  # (the queue's wait shrinks as time passes)

    relaxed = make_scheduler(ttft_ms=5000)
    relaxed.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=2.0)
    choice = relaxed.plan(prompt)
    assert (choice.prefill_id, choice.decode_id) == ("p0", "d0")


def test_a_full_decode_workers_line_counts_in_the_ttft_and_a_long_wait_rejects():
    """D has no headroom, 4 handshakes wait, and it granted 2 reservations a second:
    a request joining the line waits about 2.5 s (cluster/decode_lines.py)."""
    prompt = list(range(300))  # predicted prefill: 0.3 s on p0

    def full_d(ttft_ms: float):
        scheduler = make_scheduler(ttft_ms=ttft_ms)
        scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=1000, num_waiting_handshakes=4)
        scheduler.view.lines.observe("d0", num_granted=10, num_waiting=4, now_s=0.0)
        scheduler.view.lines.observe("d0", num_granted=14, num_waiting=4, now_s=2.0)
        return scheduler

    with pytest.raises(SloRejected, match=r"predicted TTFT \d+ ms \(of which 2500 ms waiting for a decode worker's "
                                          r"KV blocks\) exceeds the SLO of 2000 ms"):
        full_d(2000).plan(prompt)
    choice = full_d(5000).plan(prompt)
    assert choice.line_wait_s == pytest.approx(2.5) and choice.ttft_s == pytest.approx(2.8, abs=0.1)
    burst = full_d(5000)  # two of this replica's requests sent to d0 since the reading, still in the handshake
    for name in ("mine-1", "mine-2"):
        burst.view.models.inflight[name] = InFlight(name, "p0", "d0", 100, 10, predicted_ttft_s=0.1)
    assert burst.plan(prompt).line_wait_s == pytest.approx(3.5)
    roomy = make_scheduler(ttft_ms=2000)  # the same D with room and nobody waiting: no wait
    roomy.view.lines.observe("d0", num_granted=10, num_waiting=0, now_s=0.0)
    roomy.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=2.0)
    assert roomy.plan(prompt).line_wait_s == 0.0


def test_among_full_decode_workers_the_shortest_line_gets_the_request():
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    for d, waiting in (("d0", 4), ("d1", 1)):  # both full, granting 2 a second: 2.5 s and 1 s
        scheduler.view.stats[d] = idle_stats(d, num_used_blocks=1000, num_waiting_handshakes=waiting)
        scheduler.view.lines.observe(d, num_granted=10, num_waiting=waiting, now_s=0.0)
        scheduler.view.lines.observe(d, num_granted=14, num_waiting=waiting, now_s=2.0)
    choice = scheduler.plan(list(range(32)))
    assert (choice.decode_id, choice.line_wait_s) == ("d1", pytest.approx(1.0))


def test_a_burst_joins_the_line_only_past_the_room_it_found():
    """D had a line a moment ago (2 grants a second) and none now, and room for 3
    of this replica's 5 requests sent since the reading: the 2 it did not hold
    are ahead of a new request in the line, the 3 it held are not."""
    scheduler = make_scheduler(ttft_ms=5000)
    scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=1000 - 3 * 7)  # 7 blocks a request below
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=2, now_s=0.0)
    scheduler.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=2.0)
    for index in range(5):  # 100 prompt tokens and 10 out: 7 blocks each, none reserved yet
        scheduler.view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, 10, 0.1)
    assert scheduler.view.rooms.num_joined_line("d0") == 2
    assert scheduler.plan(list(range(300))).line_wait_s == pytest.approx((0 + 2 + 1) / 2)


def test_before_a_line_was_read_a_full_ds_wait_is_when_its_requests_finish():
    """D is full and no reading has shown a line on it. This replica's three
    requests there (8 blocks each, no growth kept) have 10, 20 and 30 tokens to
    go, at 10 ms a step: 10 blocks come free with the second, at 0.2 s; 40, past
    the 24 they hold, at their pace: 0.3 s * 40 / 24."""
    scheduler = make_scheduler(ttft_ms=10_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = idle_stats("d0", num_used_blocks=1000)
    now = time.monotonic()
    view.lines.observe("d0", num_granted=10, num_waiting=0, now_s=now - 2.0)
    view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=now - 1.0)
    for index, left in enumerate((30, 10, 20)):
        view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 127, left, 0.1,
                                                         admitted_s=now - 5, reserved_s=now - 4, first_token_s=now - 3)
    assert view.rooms.release_wait_s("d0", needed_blocks=10, step_s=0.01) == pytest.approx(0.2)
    assert view.rooms.release_wait_s("d0", needed_blocks=40, step_s=0.01) == pytest.approx(0.5)
    choice = scheduler.plan(list(range(300)))  # 19 blocks: when the third finishes, at D's step time now
    step_s = view.models.tbt_at("d0", 0.0, 0)
    assert step_s > 0 and choice.line_wait_s == pytest.approx(30 * step_s)


def test_a_request_waiting_in_a_decode_workers_line_is_not_its_prefill_workers_work_yet():
    now = time.monotonic()
    models = fitted_models(now)
    waiting = InFlight("waiting", "p0", "d0", 100, 10, predicted_ttft_s=5.5, admitted_s=now, line_wait_s=5.0,
                       own_s=0.5)
    models.inflight["waiting"] = waiting
    assert models.queued_prefill_s("p0") == 0.0  # P is free while it waits (it was predicted to)
    waiting.reserved_s = now + 1.0  # through the line early: P's from then, 0.5 s of its work
    assert models.queued_prefill_s("p0") == pytest.approx(1.5, abs=0.05)


def test_a_decode_worker_too_busy_for_the_tbt_slo_rejects():
    scheduler = make_scheduler(ttft_ms=10_000, tbt_ms=50)
    for index in range(10):  # ten long decodes on d0: batch 11 -> ~0.11 s per step
        scheduler.view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 10, 1000, 0.0, first_token_s=time.monotonic())
    with pytest.raises(SloRejected, match="predicted TBT"):
        scheduler.plan(list(range(32)))


def test_other_replicas_load_counts_in_the_predictions_and_the_routing():
    """Another scheduler replica's prefills queue on p0 and its decodes batch on d0:
    a prediction adds them to this replica's own, and the tie-break counts them."""
    alone = make_scheduler(ttft_ms=10_000, tbt_ms=1000, decodes=("d0", "d1"))
    shared = make_scheduler(ttft_ms=10_000, tbt_ms=1000, decodes=("d0", "d1"))
    for scheduler in (alone, shared):
        for batch in (1, 4, 16):  # d1 as fast as d0
            scheduler.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.01 * batch)
    shared.view.models.peers = PeerLoad(backlog_tokens={"p0": 2000}, decoding={"d0": 9}, decoding_kv_tokens={"d0": 900},
                                   inflight={"p0": 3, "d0": 12})
    prompt = list(range(300))
    assert alone.view.models.queued_prefill_s("p0") == 0.0
    assert shared.view.models.queued_prefill_s("p0") == pytest.approx(2.0, abs=0.1)  # 2000 tokens at 1 ms a token
    assert shared.view.models.decode_load("d0") == (9, 900)
    assert shared.view.models.tbt_at("d0", 0.0, 300) == pytest.approx(0.1, abs=0.01)  # batch 10
    assert alone.view.models.tbt_at("d0", 0.0, 300) == pytest.approx(0.01, abs=0.01)
    assert alone.plan(prompt).decode_id == "d0"  # idle equals: the first
    assert shared.plan(prompt).decode_id == "d1"  # d0 is busy with the other replica's requests
    assert shared.plan(prompt).ttft_s == pytest.approx(alone.plan(prompt).ttft_s + 2.0, abs=0.1)
    with pytest.raises(SloRejected, match="predicted TTFT"):
        strict = make_scheduler(ttft_ms=1000)
        strict.view.models.peers = shared.view.models.peers
        strict.plan(prompt)


def test_other_replicas_backlog_counts_once_in_a_burst_of_this_ones():
    """Each prediction held the other replicas' backlog on P, and the queue ended
    at the latest request's prediction and added it again: with 2 s of theirs, four
    300-token prompts (0.3 s each) were predicted 2.3, 4.6, 6.9 and 9.2 s, for
    about 3.2 s at the last, and refused past a 5 s SLO."""
    scheduler = make_scheduler(ttft_ms=5000)
    models = scheduler.view.models
    models.peers = PeerLoad(backlog_tokens={"p0": 2000}, backlog_prompts={"p0": 1})
    predicted = []
    for index in range(4):
        choice = scheduler.plan(list(range(1000 * index, 1000 * index + 300)))
        predicted.append(choice.ttft_s)
        request = InFlight(f"r{index}", choice.prefill_id, choice.decode_id, 300, 10, choice.ttft_s,
                           ttft_bias_s=choice.ttft_bias_s, ahead_id=choice.ahead_id, own_s=choice.own_s,
                           peers_s=choice.peers_s)
        request.reserved()
        models.inflight[request.request_id] = request
    assert predicted == pytest.approx([2.3, 2.6, 2.9, 3.2], abs=0.1)


def test_the_decode_step_that_ends_ds_requests_counts_their_kv():
    """Which of D's requests are done by the time a new one joins was reckoned
    from a step without their KV: 32 requests of 6,000 tokens with 40 to go, at
    47 ms a step on a D bound by its KV, read as done in 0.33 s, and a request
    joining at 0.5 s was predicted 5 ms a step."""
    now = time.monotonic()
    models = WorkerModels(16, clock=lambda: now)
    for batch in (1, 8, 32):
        for kv_tokens in (0, 50_000, 200_000):
            models.decode_model("d0").observe(decode_features(batch, kv_tokens),
                                              0.005 + 0.0001 * batch + 0.0002 * kv_tokens / 1e3)
    for index in range(32):
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 6000, 100, 0.1, admitted_s=now - 10,
                                                reserved_s=now - 10, first_token_s=now - 9, num_generated=60)
    full_step_s = models.decode_model("d0").predict(decode_features(33, 32 * 6060 + 100))
    assert full_step_s == pytest.approx(0.047, abs=0.002)
    assert models.tbt_at("d0", 0.5, 100) == pytest.approx(full_step_s, rel=0.01)  # all 32 still running then


def test_a_worker_found_dead_before_its_profile_ran_leaves_nothing_behind():
    """Out of `stats` and never `profiled`, it was not among the workers a refresh
    forgets: its prefix index, its cursor and its gauges stayed for good (a worker
    crashing as it starts, again and again, piled them up)."""
    from cluster.pool_manager import Member

    scheduler = make_scheduler(ttft_ms=1000)
    view = scheduler.view
    view.members["p1"] = Member("p1", "prefill", handle=None)
    view.stats["p1"] = idle_stats("p1")
    view.prefix["p1"] = PrefixIndex(1000)
    view.cache_cursors["p1"] = ("log", 3)
    view.metrics.set("kv_blocks_used", "KV blocks in use per worker", 5, worker="p1", role="prefill")
    view.pool = pool = _NotingPool()
    asyncio.run(view.report_dead("p1", None))
    assert pool.told == ["p1"] and "p1" not in view.members and "p1" not in view.stats
    assert "p1" not in view.prefix and "p1" not in view.cache_cursors and 'worker="p1"' not in view.metrics.render()


def test_a_request_past_its_deadline_ends_with_an_error_and_is_closed():
    import asyncio

    from cluster.service import _until

    closed = []

    async def slow():
        try:
            while True:
                await asyncio.sleep(0.05)
                yield "tick"
        finally:
            closed.append(True)

    async def run():
        return [e async for e in _until(slow(), time.monotonic() + 0.3, "r1")]

    events = asyncio.run(run())
    assert events[:-1] == ["tick"] * (len(events) - 1) and len(events) >= 3
    assert events[-1].error == "request timed out" and events[-1].finished
    assert closed == [True]


def test_decode_choice_within_the_slo_is_the_least_busy_not_the_fastest_profile():
    """A new decode worker whose start-up profile came out slower still takes
    requests while the busy one is within the SLO; past the SLO, speed decides."""
    scheduler = make_scheduler(ttft_ms=10_000, tbt_ms=200, decodes=("d0", "d1"))
    for batch in (1, 4, 16):  # d1 profiled twice as slow as d0
        scheduler.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.02 * batch)
    for index in range(3):  # three decodes on d0
        scheduler.view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 10, 1000, 0.0, first_token_s=time.monotonic())
    assert scheduler.plan(list(range(32))).decode_id == "d1"
    strict = make_scheduler(ttft_ms=10_000, tbt_ms=30, decodes=("d0", "d1"))  # d1 alone: ~0.04 s per step
    for batch in (1, 4, 16):
        strict.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.04 * batch)
    assert strict.plan(list(range(32))).decode_id == "d0"


def test_a_scaled_up_worker_starts_from_a_peers_models_and_takes_the_next_request():
    """No start-up profile for a second worker of a role (its handle here cannot
    even be called): it copies p0's models, and with p0 queued it gets the request."""
    import asyncio

    from cluster.pool_manager import Member

    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=3.0)
    scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
    scheduler.view.stats["p1"] = idle_stats("p1")
    scheduler.view.prefix["p1"] = PrefixIndex(1000)
    asyncio.run(scheduler.view._profile_new(list(scheduler.view.members.values())))
    assert "p1" in scheduler.view.profiled
    assert scheduler.view.models.prefill_s("p1", 300, 0) == pytest.approx(scheduler.view.models.prefill_s("p0", 300, 0))
    assert scheduler.plan(list(range(300))).prefill_id == "p1"


def test_a_later_choice_goes_to_its_first_choices_pair_unless_that_misses_the_slo():
    """`pair` (a prompt's later choices, cluster/completions.py) is taken though
    the other P is idle and predicted faster; not where it misses the SLO and the
    other P does not, nor where it may take no request."""
    from cluster.pool_manager import Member

    def two_prefills(queued_s: float):
        scheduler = make_scheduler(ttft_ms=2000)
        scheduler.view.members["p1"] = Member("p1", "prefill", handle=None)
        scheduler.view.stats["p1"] = idle_stats("p1")
        scheduler.view.prefix["p1"] = PrefixIndex(1000)
        scheduler.view.profiled.add("p1")
        scheduler.view.models.inflight["queued"] = InFlight("queued", "p0", "d0", 900, 10, predicted_ttft_s=queued_s)
        return scheduler

    prompt = list(range(300))  # predicted prefill: 0.3 s on either P
    scheduler = two_prefills(queued_s=1.0)
    assert scheduler.plan(prompt).prefill_id == "p1"
    pinned = scheduler.plan(prompt, pair=("p0", "d0"))
    assert pinned.prefill_id == "p0" and pinned.ttft_s == pytest.approx(1.3, abs=0.3)
    assert scheduler.plan(prompt, exclude={"p0"}, pair=("p0", "d0")).prefill_id == "p1"
    assert two_prefills(queued_s=3.0).plan(prompt, pair=("p0", "d0")).prefill_id == "p1"  # p0: 3.3 s, past the SLO


def test_a_replaced_pool_manager_starts_the_scheduler_from_nothing():
    """The new pool's workers reuse ids (p0, d0) but are new processes: no cost
    model, prefix index or stats of the old ones may carry over."""
    from cluster.pool_manager import Member

    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler.view.ready = scheduler.view.pools_applied = True
    new_pool = _NotingPool()
    scheduler.view.replace_pool(new_pool)
    assert scheduler.view.pool is new_pool and not scheduler.view.ready
    assert not scheduler.view.pools_applied  # (this deployment's pools, given to the new one at the next refresh)
    assert not (scheduler.view.members or scheduler.view.stats or scheduler.view.prefix or scheduler.view.profiled)
    models = scheduler.view.models
    assert not models.prefill_model("p0").is_fitted and not models.decode_model("d0").is_fitted
    asyncio.run(scheduler.view.report_dead("d0", "the old d0"))  # a request on the old d0 failing now
    new_d0 = scheduler.view.members["d0"] = Member("d0", "decode", handle="the new d0")  # (listed by a refresh)
    asyncio.run(scheduler.view.report_dead("d0", "the old d0"))  # (one failing only now)
    assert new_pool.told == [] and scheduler.view.members["d0"] is new_d0  # (the new pool's d0 lives)
    asyncio.run(scheduler.view.report_dead("d0", "the new d0"))
    assert new_pool.told == ["d0"] and "d0" not in scheduler.view.members


def test_a_worker_of_a_replaced_pool_that_fails_a_question_to_every_worker_is_not_reported():
    """`/abort_request`, `/flush_cache` and profiling ask every worker at once;
    an old worker's call failing after a refresh listed the new pool's worker of
    its id reported that one dead (a review's probe)."""
    import ray

    from cluster.pool_manager import Member

    view = make_scheduler(ttft_ms=10_000).view
    old = view.members["d0"] = Member("d0", "decode", handle="the old d0")
    new_pool = _NotingPool()

    async def ask(handle):  # (while the old d0's call is out: a new pool, and a refresh lists its d0)
        view.replace_pool(new_pool)
        view.members["d0"] = Member("d0", "decode", handle="the new d0")
        return ray.exceptions.RayActorError()

    asyncio.run(view._ask_each([old], ask))
    assert new_pool.told == [] and view.members["d0"].handle == "the new d0"


class _NotingPool:
    """A pool manager whose `report_dead` notes the workers reported to it (the
    view's own part is the thing under test)."""

    def __init__(self) -> None:
        self.told: list[str] = []
        self.report_dead = types.SimpleNamespace(remote=self._note)

    async def _note(self, worker_id: str) -> None:
        self.told.append(worker_id)


def test_idle_decode_workers_take_turns_so_a_new_one_serves_the_next_request():
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    scheduler.view.num_routed["d0"] = 5  # d0 has served before; both idle now
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_a_decode_worker_whose_line_asks_for_its_free_blocks_has_no_headroom():
    """Handshakes waiting for a D's blocks (actors/reservation_queue.py) will take
    what it frees: another D with room gets the request."""
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # equals: the first
    scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=900, num_waiting_handshakes=2,
                                             num_waiting_blocks=100)
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_handshakes_passing_through_an_idle_decode_workers_line_predict_no_wait():
    """A burst's handshakes are in D's line for a call onto its engine thread each,
    and D has room for all of them and for the next: no wait is predicted,
    however few reservations D granted lately (CI once saw 4.7 s predicted on an
    idle cluster, and a 429, from such a reading)."""
    scheduler = make_scheduler(ttft_ms=1000)
    scheduler.view.stats["d0"] = idle_stats("d0", num_waiting_handshakes=3, num_waiting_blocks=6)
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=3, now_s=time.monotonic() - 5.0)
    scheduler.view.lines.observe("d0", num_granted=11, num_waiting=3, now_s=time.monotonic())
    choice = scheduler.plan(list(range(32)))
    assert choice.line_wait_s == 0.0 and choice.ttft_s < 1.0


def test_requests_sent_to_a_decode_worker_since_its_stats_were_read_use_its_room():
    """d0 had 20 free blocks at the last reading, d1 10; this replica has sent d0
    two prompts of 150 tokens since (10 blocks each), d1 two of 10 (1 each): d0
    has no room left, and the next request goes to d1."""
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.seed_from("d0", "d1")
    scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=980)
    scheduler.view.stats["d1"] = idle_stats("d1", num_used_blocks=990)
    for d in ("d0", "d1"):
        scheduler.view.lines.observe(d, num_granted=0, num_waiting=0, now_s=time.monotonic())
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # none in flight on either: the most headroom
    inflight = scheduler.view.models.inflight
    for name in ("sent-1", "sent-2"):
        inflight[name] = InFlight(name, "p0", "d0", 150, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    inflight["d1-1"] = InFlight("d1-1", "p0", "d1", 10, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    inflight["d1-2"] = InFlight("d1-2", "p0", "d1", 10, 10, predicted_ttft_s=0.2, first_token_s=1.0)
    assert scheduler.plan(list(range(32))).decode_id == "d1"


def test_a_decode_worker_whose_batch_is_full_has_no_headroom_whatever_blocks_are_free():
    """A D holding `max_num_seqs` requests grants the next reservation only as one
    ends (`Engine.batch_full`). d0 had places for 2 more at the last reading and
    free blocks for all; this replica has sent it 2 since: the next request goes
    to d1, and with d0 alone it is predicted to wait for d0's first request to end."""
    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    view = scheduler.view
    view.models.seed_from("d0", "d1")
    view.stats["d0"] = idle_stats("d0", num_free_seqs=2)
    view.stats["d1"] = idle_stats("d1", num_used_blocks=900, num_free_seqs=50)
    now = time.monotonic()
    for d in ("d0", "d1"):
        view.lines.observe(d, num_granted=0, num_waiting=0, now_s=now - 1.0)
    assert scheduler.plan(list(range(32))).decode_id == "d0"  # the most headroom
    for index, left in enumerate((30, 10)):
        view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, left, 0.1, admitted_s=now,
                                                         reserved_s=now, first_token_s=now)
    assert view.rooms.headroom("d0") == 0 and view.rooms.headroom("d1") == 100
    assert scheduler.plan(list(range(32))).decode_id == "d1"
    assert view.rooms.release_wait_s("d0", needed_blocks=1, step_s=0.01) == pytest.approx(0.1)  # the 10 tokens to go

    alone = make_scheduler(ttft_ms=10_000, decode_reserve_tokens=0)
    alone.view.stats["d0"] = idle_stats("d0", num_free_seqs=2, num_waiting_handshakes=1)  # one place left
    alone.view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now - 1.0)
    assert alone.view.rooms.headroom("d0") > 0
    for index in range(3):  # sent since the reading, the last two past D's places, in its line
        alone.view.models.inflight[f"mine-{index}"] = InFlight(f"mine-{index}", "p0", "d0", 100, 10, 0.1,
                                                               admitted_s=now)
    assert alone.view.rooms.headroom("d0") == 0 and alone.view.rooms.num_joined_line("d0") == 2


def test_draining_workers_get_no_new_requests():
    from dataclasses import replace

    scheduler = make_scheduler(ttft_ms=10_000, decodes=("d0", "d1"))
    scheduler.view.models.decode_model("d1").observe(decode_features(1, 0), 0.01)
    scheduler.view.models.decode_model("d1").observe(decode_features(16, 0), 0.16)
    scheduler.view.members["d0"] = replace(scheduler.view.members["d0"], draining=True)
    assert {scheduler.plan(list(range(i, i + 40))).decode_id for i in range(10)} == {"d1"}


def test_a_decode_workers_room_counts_what_its_requests_and_the_new_one_will_grow_to():
    """D keeps room for each request's next tokens (actors/decode_room.py): 50
    blocks free at the last reading, 24 of them kept for this replica's two
    requests decoding there (300 tokens each at their end, 110 now), leave room
    for a request of 132 tokens at its end (9 blocks) but not of 532 (34): that one
    waits in D's line."""
    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler.view.stats["d0"] = idle_stats("d0", num_used_blocks=950)
    scheduler.view.lines.observe("d0", num_granted=10, num_waiting=1, now_s=time.monotonic() - 2.0)  # a line,
    scheduler.view.lines.observe("d0", num_granted=14, num_waiting=0, now_s=time.monotonic() - 1.0)  # gone since
    for name in ("a", "b"):
        scheduler.view.models.inflight[name] = InFlight(name, "p0", "d0", 100, 200, predicted_ttft_s=0.1,
                                                   admitted_s=time.monotonic() - 5.0, first_token_s=time.monotonic(),
                                                   num_generated=10)
    assert scheduler.view.rooms.headroom("d0") == 50 - 2 * 12
    assert scheduler.plan(list(range(32)), max_new_tokens=100).line_wait_s == 0.0
    waiting = scheduler.plan(list(range(32)), max_new_tokens=500)
    assert waiting.line_wait_s == pytest.approx(0.25, rel=1e-3)  # 1 / the 4 grants a second with a line


def _fixed_cost_models(now: float) -> WorkerModels:
    """p0's prefill: 10 ms a step whatever its size, and 0.1 ms a token; the clock stands at `now`."""
    models = WorkerModels(block_size=16, max_num_batched_tokens=1024, clock=lambda: now)
    for new in (16, 64, 256, 512):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.010 + 0.0001 * new)
    for batch in (1, 4, 16):
        models.decode_model("d0").observe(decode_features(batch, 0), 0.01 * batch)
    return models


def test_prompts_that_share_the_queues_steps_add_their_tokens_alone():
    """A burst of 16 prompts of 24 tokens fits in one 1024-token step: the first
    pays the step's 10 ms, the others 2.4 ms each (charged a step each, the last
    was predicted at 16 x 12.4 ms)."""
    now = time.monotonic()
    models = _fixed_cost_models(now)
    for index in range(16):
        prediction = models.predict("p0", "d0", num_prompt_tokens=24, cached_tokens=0)
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 24, 10, prediction.ttft_s, admitted_s=now)
    assert prediction.ttft_s == pytest.approx(0.0124 + 15 * 0.0024, abs=0.005)


def test_a_prompt_past_the_queues_steps_pays_a_step_of_its_own():
    now = time.monotonic()
    models = _fixed_cost_models(now)
    models.inflight["long"] = InFlight("long", "p0", "d0", 1000, 10, predicted_ttft_s=0.11, admitted_s=now)
    assert models.own_prefill_s("p0", 20, 0) == pytest.approx(0.0020)  # 1000 + 20 tokens: in the queue's one step
    assert models.own_prefill_s("p0", 100, 0) == pytest.approx(0.0200)  # 1100: a second step
    models.inflight.clear()
    assert models.own_prefill_s("p0", 20, 0) == pytest.approx(0.0120)  # alone: its own step


def test_a_request_in_flight_knows_the_prefix_its_p_had_cached():
    """What the prefill pool's backlog leaves out (cluster/scaling_signals.py): the
    cached prompt tokens admission predicted on the P it chose."""
    from actors.block_pool import block_hashes

    prompt = list(range(320))
    scheduler = make_scheduler(ttft_ms=10_000)
    scheduler.view.prefix["p0"].insert(block_hashes(prompt, 16, b"")[:16])  # 256 tokens
    seen = []

    async def first_token(request, choice, inflight):
        seen.append(inflight.num_cached_tokens)
        yield TokenEvent(request.request_id, [7], "x", None, True, "length", time.time())

    scheduler._events = first_token

    async def run():
        async for _ in scheduler.generate(prompt, SamplingParams(max_new_tokens=1), "r"):
            pass

    asyncio.run(run())
    assert seen == [256]


def test_a_ds_room_is_asked_only_for_the_blocks_its_prefix_cache_does_not_hold():
    """Found by a review: D held a shared 1024-token prefix and had 10 free blocks;
    its reservation needed 2 new ones, but the scheduler asked room for all 66,
    predicted a wait in D's line and answered 429. A burst of requests sharing
    the prefix was charged it once a request until D's next reading."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    hashes = block_hashes(prompt, 16, b"")
    scheduler = make_scheduler(ttft_ms=1000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = idle_stats("d0", num_used_blocks=990)
    for worker_id in ("p0", "d0"):
        view.prefix[worker_id].insert(hashes[:64])
    now = time.monotonic()
    view.lines.observe("d0", num_granted=10, num_waiting=1, now_s=now - 2.0)  # a line a moment ago, gone
    view.lines.observe("d0", num_granted=11, num_waiting=0, now_s=now - 0.1)
    choice = scheduler.plan(prompt, max_new_tokens=16)
    assert choice.decode_id == "d0" and choice.line_wait_s == 0.0
    # Found by the second read: a cached block no request holds saves no room (D counts it free, and
    # reusing it takes it from there): the blocks D's reading found idle are not taken as held
    view.stats["d0"] = idle_stats("d0", num_used_blocks=935, num_cached_blocks=64)
    assert view.rooms.held_prefix_blocks("d0", hashes[:65]) == 0
    view.stats["d0"] = idle_stats("d0", num_used_blocks=990, num_cached_blocks=10)
    assert view.rooms.held_prefix_blocks("d0", hashes[:65]) == 64 - 10
    # Sent since the reading, each charged the blocks D did not hold for running requests (and its growth)
    for index in range(5):
        view.models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 1040, 16, predicted_ttft_s=0.1,
                                                     decode_held_blocks=64)
    assert view.rooms.headroom("d0") == 10 - 5 * 2


def _admit_a_burst_sharing_the_prompt(scheduler, prompt: list[int], usable: list[bytes]) -> None:
    """16 requests of the 1040-token prompt, as the scheduler admits them, each
    charged on d0 (its 100 free blocks) the whole prompt's 66 blocks, less those
    held there: the first all of them, each later one 2."""
    view = scheduler.view
    for index in range(16):
        choice = scheduler.plan(prompt, max_new_tokens=16)
        assert choice.decode_id == "d0" and choice.line_wait_s == 0.0, index
        view.models.inflight[f"r{index}"] = InFlight(
            f"r{index}", "p0", "d0", 1040, 16, predicted_ttft_s=choice.ttft_s, prefix_hashes=tuple(usable),
            decode_held_blocks=view.rooms.held_prefix_blocks("d0", usable))
    assert [r.decode_held_blocks for r in view.models.inflight.values()] == [0] + [64] * 15
    assert view.rooms.headroom("d0") == 100 - 66 - 15 * 2


def test_a_burst_sharing_a_prompt_d_holds_idle_is_charged_it_once():
    """D's reading found a 1024-token system prompt cached and idle (no request held
    it): a request's reservation revives those blocks, taking them from D's free
    room, so the first of a burst is charged the whole prompt. The rest share what
    it holds, but were each charged it too until D's next reading: a burst of 16
    asked for 16 x 66 blocks of a D with 100 free, predicted a wait in D's line,
    and answered 429s."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    hashes = block_hashes(prompt, 16, b"")
    scheduler = make_scheduler(ttft_ms=60_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = idle_stats("d0", num_used_blocks=900, num_cached_blocks=64)
    for worker_id in ("p0", "d0"):
        view.prefix[worker_id].insert(hashes[:64])
    now = time.monotonic()
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=now - 0.5)
    usable = hashes[:64]
    assert view.rooms.held_prefix_blocks("d0", usable) == 0  # idle: the first request revives them
    view.models.inflight["elsewhere"] = InFlight("elsewhere", "p0", "d1", 1040, 16, predicted_ttft_s=0.1,
                                                 prefix_hashes=tuple(usable))
    assert view.rooms.held_prefix_blocks("d0", usable) == 0  # (on another D)
    view.models.inflight["other"] = InFlight("other", "p0", "d0", 1040, 16, predicted_ttft_s=0.1,
                                             prefix_hashes=tuple(usable[:10]) + (b"x",))
    assert view.rooms.held_prefix_blocks("d0", usable) == 10  # its first 10 blocks are the prompt's
    view.models.inflight.clear()
    _admit_a_burst_sharing_the_prompt(scheduler, prompt, usable)
    # D's next reading: the burst's blocks in use, its idle ones (any prompt's, 80) more than the prompt's 64:
    # a request in flight there still holds the prompt's, which the next one shares
    view.stats["d0"] = idle_stats("d0", num_used_blocks=900 + 66 + 15 * 2, num_cached_blocks=80)
    view.lines.observe("d0", num_granted=16, num_waiting=0, now_s=time.monotonic())
    assert view.rooms.held_prefix_blocks("d0", usable) == 64


def test_a_burst_sharing_a_new_prompt_is_charged_it_once():
    """A system prompt no worker holds yet: D's reservations lend the blocks still
    on their way (actors/arriving_blocks.py), so the first of a burst is charged
    the whole prompt and the rest what follows it. Each was charged the whole
    prompt, D's index holding none of it: 16 x 66 blocks of a D with 100 free, a
    wait in D's line predicted for all but the first."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    usable = block_hashes(prompt, 16, b"")[:64]
    scheduler = make_scheduler(ttft_ms=60_000, decode_reserve_tokens=0)
    view = scheduler.view
    view.stats["d0"] = idle_stats("d0", num_used_blocks=900)
    view.lines.observe("d0", num_granted=0, num_waiting=0, now_s=time.monotonic() - 0.5)
    _admit_a_burst_sharing_the_prompt(scheduler, prompt, usable)


def test_a_prompt_another_request_computes_on_p_is_charged_only_the_rest():
    """The blocks a request in prefill on P shares with the prompt are computed once:
    P's cache has them by this one's turn, or it waits for them
    (`Scheduler._waits_for_prefix`). A burst sharing a new system prompt was charged
    it once a request on P, its queue read as 16 prompts' work."""
    from actors.block_pool import block_hashes

    prompt = list(range(1040))
    usable = block_hashes(prompt, 16, b"")[:64]
    scheduler = make_scheduler(ttft_ms=60_000)
    view = scheduler.view
    first = scheduler.plan(prompt, max_new_tokens=16)
    assert first.uncached_tokens == 1040
    view.models.inflight["r0"] = InFlight("r0", "p0", "d0", 1040, 16, predicted_ttft_s=first.ttft_s,
                                          prefix_hashes=tuple(usable))
    assert scheduler.plan(prompt, max_new_tokens=16).uncached_tokens == 1040 - 64 * 16
    view.models.inflight["r0"].first_token_s = time.monotonic()  # past P: its cache, as P's index shows it, tells
    assert scheduler.plan(prompt, max_new_tokens=16).uncached_tokens == 1040


def test_among_equally_busy_decode_workers_the_one_holding_the_prompt_is_chosen():
    """A conversation's next turn: d1's cache holds its history, d0 is next in
    turn (routed to less). d0 took it, and the whole history moved again; d1 is
    sent only the rest. Busier than d0, d1 is not chosen (load comes first)."""
    from actors.block_pool import block_hashes

    prompt = list(range(200))
    scheduler = make_scheduler(ttft_ms=5000, decodes=("d0", "d1"))
    view = scheduler.view
    view.prefix["d1"].insert(block_hashes(prompt, 16, b"")[:12])
    view.num_routed.update(d0=3, d1=4)
    choice = scheduler.plan(prompt)
    assert choice.decode_id == "d1" and choice.prefill_id == "p0"
    view.models.inflight["running"] = InFlight("running", "p0", "d1", 100, 500, predicted_ttft_s=0.0,
                                               first_token_s=time.monotonic())
    assert scheduler.plan(prompt).decode_id == "d0"
