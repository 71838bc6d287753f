"""Unit tests of the workload generator: determinism, exact lengths, arrival
processes and shared prefixes (no timings)."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks import workload as wl

VOCAB = 2048


def test_same_seed_same_workload_and_different_seed_differs():
    a = wl.poisson("w", 2.0, 50, wl.Uniform((16, 64), (4, 8)), VOCAB, seed=7)
    b = wl.poisson("w", 2.0, 50, wl.Uniform((16, 64), (4, 8)), VOCAB, seed=7)
    c = wl.poisson("w", 2.0, 50, wl.Uniform((16, 64), (4, 8)), VOCAB, seed=8)
    assert a == b
    assert a.requests[0].prompt_ids != c.requests[0].prompt_ids


def test_lengths_are_exact_and_tokens_avoid_special_ids():
    work = wl.build("w", [0.0] * 40, wl.Uniform((10, 20), (3, 5)), VOCAB, seed=1)
    for request in work.requests:
        assert 10 <= request.num_prompt_tokens <= 20 and 3 <= request.max_new_tokens <= 5
        assert all(wl.FIRST_TOKEN_ID <= t < VOCAB for t in request.prompt_ids)
    fixed = wl.build("f", [0.0, 1.0], wl.Fixed(33, 7), VOCAB, seed=1)
    assert [(r.num_prompt_tokens, r.max_new_tokens) for r in fixed.requests] == [(33, 7), (33, 7)]


def test_poisson_arrivals_have_the_requested_mean_rate():
    times = wl.arrivals_poisson(4.0, 20_000, random.Random(0))
    assert times == sorted(times) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd == mean
    with pytest.raises(ValueError):
        wl.arrivals_poisson(0.0, 3, random.Random(0))


def test_bursts_and_steps():
    assert wl.arrivals_bursts(7, 3, 2.0) == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]
    times = wl.arrivals_steps([(10.0, 100.0), (40.0, 100.0)], random.Random(0))
    first = [t for t in times if t < 100.0]
    second = [t for t in times if t >= 100.0]
    assert len(first) == pytest.approx(1000, rel=0.1) and len(second) == pytest.approx(4000, rel=0.1)
    assert max(times) < 200.0 and times == sorted(times)


def test_chat_mix_is_long_tailed_and_clipped():
    mix = wl.ChatMix(prompt_median=128, output_median=64, prompt_range=(16, 2048), output_range=(4, 512))
    rng = random.Random(0)
    samples = [mix.sample(rng) for _ in range(5000)]
    prompts = sorted(p for p, _ in samples)
    assert min(prompts) >= 16 and max(prompts) <= 2048
    assert statistics.median(prompts) == pytest.approx(128, rel=0.1)
    assert statistics.fmean(prompts) > 1.2 * statistics.median(prompts)  # a long right tail
    assert all(4 <= o <= 512 for _, o in samples)


def test_long_prompts_default_range():
    rng = random.Random(0)
    samples = [wl.LongPrompts().sample(rng) for _ in range(500)]
    assert all(1024 <= p <= 8192 for p, _ in samples)
    assert max(p for p, _ in samples) > 7000 and min(p for p, _ in samples) < 1500


def test_multi_turn_prompts_extend_the_previous_turn_and_share_the_system_prompt():
    work = wl.multi_turn("mt", num_conversations=4, turns=3, rate=1.0, vocab_size=VOCAB, seed=3,
                         system_tokens=64, think_s=5.0)
    assert len(work.requests) == 12
    assert [r.arrival_s for r in work.requests] == sorted(r.arrival_s for r in work.requests)
    system = work.requests[0].prompt_ids[:64]
    by_conversation: dict[int, list] = {}
    for request in work.requests:
        assert request.prompt_ids[:64] == system
        by_conversation.setdefault(request.conversation, []).append(request)
    for turns in by_conversation.values():
        assert len(turns) == 3
        for earlier, later in zip(turns, turns[1:]):
            assert later.arrival_s == pytest.approx(earlier.arrival_s + 5.0)
            assert later.prompt_ids[: earlier.num_prompt_tokens] == earlier.prompt_ids
            # the next prompt carries a stand-in reply as long as this turn's output
            assert later.num_prompt_tokens > earlier.num_prompt_tokens + earlier.max_new_tokens


def test_describe_reports_counts_and_ranges():
    work = wl.build("w", [0.0, 2.0, 1.0], wl.Fixed(10, 4), VOCAB, seed=0)
    info = work.describe()
    assert info["num_requests"] == 3 and info["duration_s"] == 2.0
    assert info["prompt_tokens"] == {"min": 10, "mean": 10.0, "max": 10}
