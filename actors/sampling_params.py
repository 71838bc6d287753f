"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses: the message says what to change."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the token's and n best
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0  # 1.0: off; see kernels/penalties.py
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    has_penalties: bool = field(init=False, repr=False, compare=False, default=False)  # set from the three

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10] (1 disables it), "
                                      f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)!r}")
        # A plain field, read for every row of every step.
        object.__setattr__(self, "has_penalties", (self.repetition_penalty != 1 or self.frequency_penalty != 0
                                                   or self.presence_penalty != 0))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
