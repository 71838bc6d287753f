"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses: the message says what to change."""


# A temperature below this samples greedily, the limit it tends to (vLLM draws the
# same line): logits over a tiny one overflow float32 (30 over 1e-38 is inf, and
# inf - inf in the softmax NaN), and 5e-50 is 0 in float32.
GREEDY_BELOW = 1e-5
# Bounds that keep float32 logits finite: a temperature past float32's range is inf
# there, and a banned token's -inf over it NaN; a repetition penalty under 1e-45 is 0
# there, and a banned token's -inf times it NaN. Both are far past any useful value
# (a temperature of 10000 already samples every allowed token about evenly).
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 0.01
MAX_BAD_WORDS = 100  # each is matched against every row's output at every draw


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    # max_new_tokens is a default, the client asked for none: the cluster holds it to
    # the room the prompt leaves (cluster/prompt_limits.py `fitted_output`), where an
    # asked-for one past that room is refused
    max_new_tokens_is_default: bool = False
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off; else a token needs min_p x the best token's probability (kernels/sampling.py)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the token's and n best
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0  # 1.0: off; see kernels/penalties.py
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's, as pairs
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these can be sampled (vLLM's); (): any token
    min_new_tokens: int = 0  # no EOS, stop token or stop string before this many tokens (vLLM's min_tokens)
    bad_words: tuple[str, ...] = ()  # words the output must not contain (vLLM's; actors/bad_words.py)
    include_stop_str_in_output: bool = False  # a stop string (or stop token's text) ends the text, not cut off
    prompt_logprobs: int | None = None  # None: none; n >= 0: each prompt token's logprob and its n best
    regex: str | None = None  # the output must match it whole (actors/structured_output.py)
    # Set from the fields above; plain fields, read for every row of every step.
    has_penalties: bool = field(init=False, repr=False, compare=False, default=False)
    processes_logits: bool = field(init=False, repr=False, compare=False, default=False)
    # Greedy, and its logits used for nothing else (an argmax alone: actors/model_runner.py).
    argmax_only: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError("bad_words must be words, not empty or blank strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"{len(self.bad_words)} bad_words; at most {MAX_BAD_WORDS}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be a 64-bit integer, in [-2**63, 2**63), got {self.seed!r}")
        if self.seed is not None:  # (vLLM's range; -1, which clients send, was refused: the draws take [0, 2**63))
            object.__setattr__(self, "seed", self.seed % 2**63)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10:
            raise InvalidRequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10] (1 disables it), "
                                      f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            raise InvalidRequestError("logit_bias names a token twice")
        object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids})))
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise InvalidRequestError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                                      f"({self.max_new_tokens})")
        if self.regex is not None:
            self._check_regex()
        has_penalties = self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
        object.__setattr__(self, "has_penalties", has_penalties)
        object.__setattr__(self, "processes_logits", has_penalties or bool(self.logit_bias) or self.min_new_tokens > 0
                           or bool(self.allowed_token_ids) or bool(self.bad_words) or self.regex is not None)
        object.__setattr__(self, "argmax_only", self.temperature == 0 and self.logprobs is None
                           and not self.processes_logits)

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These params drawing from `seed` (checked as a seed is), the rest not
        checked again: a request's choices and the scheduler's drawn seed each
        checked a copy whole, and 64 copies of one 150k-entry logit_bias took
        3.7 s of the ingress's event loop (a review's probe)."""
        if seed is not None and not -(2**63) <= seed < 2**63:
            raise InvalidRequestError(f"seed must be a 64-bit integer, in [-2**63, 2**63), got {seed!r}")
        return self._copied(seed=None if seed is None else seed % 2**63)

    def with_max_new_tokens(self, max_new_tokens: int) -> SamplingParams:
        """As `with_seed`, for the output's length (a default held to the room the
        prompt leaves: cluster/prompt_limits.py)."""
        if not isinstance(max_new_tokens, int) or not max(1, self.min_new_tokens) <= max_new_tokens:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= max(1, min_new_tokens "
                                      f"{self.min_new_tokens}), got {max_new_tokens!r}")
        return self._copied(max_new_tokens=max_new_tokens)

    def _copied(self, **fields) -> SamplingParams:
        changed = copy.copy(self)
        for name, value in fields.items():
            object.__setattr__(changed, name, value)
        return changed

    def _check_regex(self) -> None:
        from actors.regex_dfa import compile_regex  # (it imports this module)

        if not isinstance(self.regex, str):
            raise InvalidRequestError(f"regex must be a string, got {type(self.regex).__name__}")
        compile_regex(self.regex)  # cached: RegexError (an InvalidRequestError) unless it can constrain
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} cannot be combined with a regex, choice or JSON schema: "
                                          "it could ban every token the pattern allows")

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The tokens that end a request with these params: its stop tokens, and the
        model's end tokens unless `ignore_eos`."""
        return frozenset(self.stop_token_ids).union(() if self.ignore_eos else eos_token_ids)

    def check_token_ids(self, vocab_size: int, eos_token_ids: tuple[int, ...],
                        always_banned: frozenset[int] | None = None) -> None:
        """The ids these params name against a model's vocabulary and end tokens, and
        the tokens their bad_words ban at every draw."""
        named = (("logit_bias", [t for t, _ in self.logit_bias]), ("allowed_token_ids", self.allowed_token_ids),
                 ("stop_token_ids", self.stop_token_ids))
        for name, ids in named:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} token id {bad} is outside the vocabulary [0, {vocab_size})")
        allowed = set(self.allowed_token_ids)
        banned_first = (always_banned or frozenset()) | (self.stop_ids(eos_token_ids) if self.min_new_tokens else set())
        if allowed and allowed <= banned_first:
            raise InvalidRequestError("allowed_token_ids are all banned from the first draw (one-token bad_words, "
                                      "stop tokens under min_new_tokens): no token could be sampled")
        if self.regex is not None and (self.min_new_tokens or not self.stop_ids(eos_token_ids)):
            from actors.regex_dfa import START, compile_regex  # (it imports this module)

            if compile_regex(self.regex).terminal[START]:  # (its first draw's mask was empty: any token came)
                raise InvalidRequestError("the output pattern matches only empty text, and no token may end it "
                                          "(ignore_eos without stop_token_ids, or min_new_tokens): nothing could "
                                          "be sampled")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
