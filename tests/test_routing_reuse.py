"""Routing against what the workers will actually reuse and hold (no Ray): a
prefix counted as cached where the worker computes it all the same (its prefix
cache off, the prompt's logprobs asked), a pinned D taken full while another had
room, and past the TBT SLO a slower D picked on a tie-breaker. Each routed or
admitted a request on a prediction the pair could not keep."""

from __future__ import annotations

import time

import pytest

from actors.block_pool import block_hashes
from cluster.admission import InFlight, SloRejected
from cluster.cost_model import decode_features
from cluster.pool_manager import Member
from cluster.router import PrefixIndex
from tests.scheduler_setup import idle_stats, make_scheduler


def _add_idle_prefill(scheduler, worker_id: str = "p1") -> None:
    view = scheduler.view
    view.members[worker_id] = Member(worker_id, "prefill", handle=None)
    view.stats[worker_id] = idle_stats(worker_id)
    view.prefix[worker_id] = PrefixIndex(1000)
    view.profiled.add(worker_id)


def test_with_the_prefix_cache_off_a_prompt_in_flight_is_not_read_as_cached():
    """The same 257-token prompt went to p0 and d0 a moment ago: workers whose
    prefix cache is off reuse none of it, so the next is predicted to compute it
    all, and goes to the idle p1."""
    scheduler = make_scheduler(ttft_ms=1000, enable_prefix_cache=False)
    prompt = list(range(257))
    usable = scheduler._usable(block_hashes(prompt, 16, b""), len(prompt))
    scheduler.view.models.inflight["a"] = InFlight("a", "p0", "d0", len(prompt), 64, 0.3, own_s=0.3,
                                                   prefix_hashes=tuple(usable), admitted_s=time.monotonic() - 0.15)
    assert scheduler.view.cached_tokens("p0", usable) == 0
    assert scheduler.view.rooms.held_prefix_blocks("d0", usable) == 0
    _add_idle_prefill(scheduler)
    choice = scheduler.plan(prompt, max_new_tokens=64)
    assert choice.uncached_tokens == len(prompt) and choice.prefill_id == "p1"


def test_a_prompt_whose_logprobs_are_asked_is_predicted_to_compute_it_all():
    """p0 holds the whole 513-token prompt but is busy for 0.3 s; p1 is idle and
    cold. P computes every position for the prompt's logprobs: p1 is faster."""
    scheduler = make_scheduler(ttft_ms=2000)
    prompt = list(range(513))
    scheduler.view.prefix["p0"].insert(block_hashes(prompt, 16, b""))
    scheduler.view.models.inflight["x"] = InFlight("x", "p0", "d0", 300, 8, 0.3, own_s=0.3)
    _add_idle_prefill(scheduler)
    reused = scheduler.plan(prompt, max_new_tokens=8)
    assert (reused.prefill_id, reused.uncached_tokens) == ("p0", 1)
    computed = scheduler.plan(prompt, max_new_tokens=8, computes_prompt=True)
    assert (computed.prefill_id, computed.uncached_tokens) == ("p1", len(prompt))


def test_a_later_choice_pinned_to_a_full_d_goes_to_one_with_room():
    """An n=2 call's first choice took d0; d0 has no room left for the second,
    whose wait nothing predicts yet (the first still in its handshake), and d1 is
    idle. Pinned to (p0, d0), the second was taken there as if it waited for
    nothing: it waited in d0's line until a request ended."""
    scheduler = make_scheduler(ttft_ms=1000, decodes=("d0", "d1"))
    view = scheduler.view
    for worker_id in ("d0", "d1"):
        view.stats[worker_id] = idle_stats(worker_id, num_blocks=40, num_used_blocks=10)
        view.lines.observe(worker_id, 0, 0, time.monotonic() - 0.5)
    view.num_routed["d1"] = 5  # (so the first goes to d0)
    prompt, max_new = list(range(100)), 256  # a choice needs 23 blocks
    first = scheduler.plan(prompt, max_new_tokens=max_new)
    assert first.decode_id == "d0"
    usable = scheduler._usable(block_hashes(prompt, 16, b""), len(prompt))
    view.models.inflight["first"] = InFlight("first", "p0", "d0", len(prompt), max_new, first.ttft_s,
                                             own_s=first.own_s, prefix_hashes=tuple(usable), decode_held_blocks=0)
    second = scheduler.plan(prompt, max_new_tokens=max_new, pair=(first.prefill_id, first.decode_id))
    assert second.decode_id == "d1" and second.line_wait_s == 0.0


@pytest.mark.parametrize("early_rejection", [False, True])
def test_past_the_tbt_slo_the_fastest_d_is_picked_or_named(early_rejection):
    """d0 decodes at 10 ms a token, d1 at 6 ms, the SLO 5 ms; d1 was routed to
    once more so far. d0 won on that tie-breaker: served, or named in the 429."""
    scheduler = make_scheduler(ttft_ms=1000, tbt_ms=5, decodes=("d0", "d1"))
    slo = scheduler.settings.slo.model_copy(update={"early_rejection": early_rejection})
    scheduler.settings = scheduler.settings.model_copy(update={"slo": slo})
    for batch in (1, 4, 16):
        scheduler.view.models.decode_model("d1").observe(decode_features(batch, 0), 0.006 * batch)
    scheduler.view.num_routed.update(d0=3, d1=4)
    if early_rejection:
        with pytest.raises(SloRejected) as rejected:
            scheduler.plan(list(range(64)), max_new_tokens=8)
        assert rejected.value.best.decode_id == "d1"
    else:
        assert scheduler.plan(list(range(64)), max_new_tokens=8).decode_id == "d1"
