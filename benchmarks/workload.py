"""Seeded serving workloads: when each request arrives and how long it is.

A `Workload` is a list of `BenchRequest`s sorted by arrival time (seconds from the
start of the run). Prompts are token ids drawn from `[3, vocab_size)` (ids 0..2 are
the presets' special tokens) and requests are sent greedy with EOS ignored, so a
request's prompt length and output length are exactly what the workload says.
Everything is drawn from `random.Random(seed)`: the same arguments give the same
workload, token for token.

Arrival processes (`arrivals_*`, each returns sorted times in seconds):
- Poisson at `rate` req/s: independent exponential gaps of mean 1 / rate.
- bursts: `burst_size` requests at the same instant, one burst every `period_s`.
- steps: Poisson at each `(rate, duration_s)` level in turn (a load step).

Length distributions (`sample(rng) -> (prompt_tokens, output_tokens)`):
- `Fixed(p, o)`; `Uniform((p_lo, p_hi), (o_lo, o_hi))`, bounds inclusive;
- `ChatMix`: long-tailed, log-normal prompt and output lengths around the given
  medians, clipped to [min, max] (most requests short, a few long);
- `LongPrompts`: prompts uniform in 1k..8k tokens by default, outputs uniform.

Multi-turn conversations with shared prefixes (`multi_turn`): every conversation
starts with the same system prompt; turn k's prompt is the system prompt, then each
earlier turn's user message and a stand-in reply, then turn k's user message, so
turn k's prompt is a strict prefix-extension of turn k-1's. Conversations start as
a Poisson process; turn k of a conversation arrives `think_s` after turn k-1
arrived (open loop: prompts do not depend on the replies actually generated).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

FIRST_TOKEN_ID = 3  # ids 0..2 are special tokens in the built-in presets


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float
    prompt_ids: list[int]
    max_new_tokens: int
    conversation: int | None = None  # multi-turn workloads: which conversation

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def duration_s(self) -> float:
        """The arrival window: the last arrival's time (0 for one request)."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def describe(self) -> dict:
        prompts = [r.num_prompt_tokens for r in self.requests]
        outputs = [r.max_new_tokens for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "duration_s": self.duration_s,
            "prompt_tokens": {"min": min(prompts), "mean": sum(prompts) / len(prompts), "max": max(prompts)},
            "output_tokens": {"min": min(outputs), "mean": sum(outputs) / len(outputs), "max": max(outputs)},
        }


# ---- arrival processes ---------------------------------------------------------
def arrivals_poisson(rate: float, num_requests: int, rng: random.Random) -> list[float]:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def arrivals_bursts(num_requests: int, burst_size: int, period_s: float) -> list[float]:
    if burst_size < 1 or period_s <= 0:
        raise ValueError("bursts need burst_size >= 1 and period_s > 0")
    return [(i // burst_size) * period_s for i in range(num_requests)]


def arrivals_steps(levels: Sequence[tuple[float, float]], rng: random.Random) -> list[float]:
    """Poisson at each (rate req/s, duration s) level in turn."""
    times, start = [], 0.0
    for rate, duration_s in levels:
        now = start + rng.expovariate(rate)
        while now < start + duration_s:
            times.append(now)
            now += rng.expovariate(rate)
        start += duration_s
    return times


# ---- length distributions -------------------------------------------------------
@dataclass(frozen=True)
class Fixed:
    prompt_tokens: int
    output_tokens: int

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.prompt_tokens, self.output_tokens


@dataclass(frozen=True)
class Uniform:
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(*self.prompt_range), rng.randint(*self.output_range)


@dataclass(frozen=True)
class ChatMix:
    prompt_median: int = 256
    output_median: int = 128
    sigma: float = 0.9  # log-normal shape: larger means a longer tail
    prompt_range: tuple[int, int] = (16, 4096)
    output_range: tuple[int, int] = (4, 1024)

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return (_clipped_lognormal(rng, self.prompt_median, self.sigma, self.prompt_range),
                _clipped_lognormal(rng, self.output_median, self.sigma, self.output_range))


@dataclass(frozen=True)
class LongPrompts:
    prompt_range: tuple[int, int] = (1024, 8192)
    output_range: tuple[int, int] = (64, 256)

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(*self.prompt_range), rng.randint(*self.output_range)


def _clipped_lognormal(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    value = round(rng.lognormvariate(math.log(median), sigma))
    return min(max(value, bounds[0]), bounds[1])


# ---- workloads --------------------------------------------------------------------
def random_tokens(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(num_tokens)]


def build(name: str, arrivals: Sequence[float], lengths, vocab_size: int, seed: int) -> Workload:
    """One request per arrival time, lengths from `lengths.sample`, fresh random
    prompts (independent prompts: no shared prefixes)."""
    rng = random.Random(seed)
    requests = []
    for index, arrival_s in enumerate(sorted(arrivals)):
        prompt_tokens, output_tokens = lengths.sample(rng)
        requests.append(BenchRequest(index, arrival_s, random_tokens(rng, prompt_tokens, vocab_size), output_tokens))
    return Workload(name, requests)


def poisson(name: str, rate: float, num_requests: int, lengths, vocab_size: int, seed: int) -> Workload:
    """The common case: Poisson arrivals at `rate` req/s."""
    arrivals = arrivals_poisson(rate, num_requests, random.Random(seed))
    return build(name, arrivals, lengths, vocab_size, seed + 1)


def multi_turn(
    name: str,
    num_conversations: int,
    turns: int,
    rate: float,
    vocab_size: int,
    seed: int,
    system_tokens: int = 256,
    user_tokens: tuple[int, int] = (32, 96),
    reply_tokens: tuple[int, int] = (32, 96),
    think_s: float = 1.0,
) -> Workload:
    """Conversations sharing one system prompt; each turn extends the previous
    turn's prompt. `rate` is the conversation start rate; `max_new_tokens` of a
    turn is the length of the stand-in reply that the next turn's prompt carries."""
    rng = random.Random(seed)
    system = random_tokens(rng, system_tokens, vocab_size)
    starts = arrivals_poisson(rate, num_conversations, rng)
    pending = []
    for conversation, start_s in enumerate(starts):
        history = list(system)
        for turn in range(turns):
            prompt = history + random_tokens(rng, rng.randint(*user_tokens), vocab_size)
            reply = random_tokens(rng, rng.randint(*reply_tokens), vocab_size)
            pending.append((start_s + turn * think_s, conversation, prompt, len(reply)))
            history = prompt + reply
    pending.sort(key=lambda item: (item[0], item[1]))
    requests = [BenchRequest(i, arrival_s, prompt, num_out, conversation)
                for i, (arrival_s, conversation, prompt, num_out) in enumerate(pending)]
    return Workload(name, requests)
