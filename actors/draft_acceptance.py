"""How likely a request's drafts are to stand, from its latest verified ones:
the gain of each draft in `Drafter.trim`'s goodput rule (actors/speculation.py).

Two rates, not one: `first`, the chance its first draft stands, and `next`, the
chance a later one stands given the one before did. Prompt lookup's drafts stand
or fall together: inside a span the text copies (a loop, a quoted passage, code
under edit) the whole draft stands, outside it the first token fails. One rate
alpha with gains alpha^j (the geometric model of Leviathan et al. and SmartSpec)
reads a request half in such spans as alpha about 0.6 and undervalues its third
and fourth drafts, which stand about as often as its second (`tandem bench
speculative`, "Dear Sir or Madam," alone: trimmed by one rate to two or three
drafts a step, it took 84 and 85 steps for 128 tokens in two runs, 79 verifying
all four). Draft j (from 1) then stands with probability `first * next ** (j -
1)`, which falls with j, so a request's drafts are worth taking in order.

A step that verified k drafts of which c stood tells: the first stood or not
(if k > 0), and of the later drafts whose predecessor stood, min(c, k - 1),
max(c - 1, 0) stood. Counts fade (each verified step's weight `DECAY` times the
one before) so the rates follow the text, and start at one of two for each rate
(1/2 before any evidence, never 0 or 1).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.9


@dataclass
class DraftAcceptance:
    first_stood: float = 0.0
    first_verified: float = 0.0
    next_stood: float = 0.0
    next_verified: float = 0.0

    def record(self, num_drafts: int, num_stood: int) -> None:
        """A step verified `num_drafts` drafts, of which the first `num_stood` stood."""
        if not num_drafts:
            return
        self.first_stood = self.first_stood * DECAY + (num_stood > 0)
        self.first_verified = self.first_verified * DECAY + 1
        self.next_stood = self.next_stood * DECAY + max(num_stood - 1, 0)
        self.next_verified = self.next_verified * DECAY + min(num_stood, num_drafts - 1)

    @property
    def first(self) -> float:
        return (self.first_stood + 1.0) / (self.first_verified + 2.0)

    @property
    def next(self) -> float:
        return (self.next_stood + 1.0) / (self.next_verified + 2.0)

    def gain(self, j: int) -> float:
        """The chance draft j (from 1) stands: the tokens it adds, expected."""
        return self.first * self.next ** (j - 1)
