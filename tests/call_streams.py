"""What the tool-call formats' tests share (tests/test_hermes_calls.py,
test_llama_calls.py, test_mistral_calls.py): random answers made of a format's
pieces, cut at random places, and what a stream gives for the cut pieces."""

from __future__ import annotations

import random
from collections.abc import Iterator

from cluster.answer_parts import ParsedCalls


def random_answers(parts: list[str], seed: int, max_parts: int = 6, max_cuts: int = 5,
                   num_answers: int = 400) -> Iterator[tuple[str, list[str]]]:
    """(text, pieces): up to `max_parts` of `parts` put together, then cut in up to
    `max_cuts` places (the pieces together are the text)."""
    rng = random.Random(seed)
    for _ in range(num_answers):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, max_parts)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, max_cuts))))
        yield text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(stream, pieces: list[str]) -> ParsedCalls:
    """The text and calls a stream (`feed`, `finish`) gives for the pieces in turn."""
    return ParsedCalls.of([each for piece in pieces for each in stream.feed(piece)] + stream.finish())
