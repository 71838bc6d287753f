"""One request object, end to end, with explicit counters, and the `RequestOutput`
the engine reports for it after each step.

`all_token_ids` is the prompt followed by the generated tokens. The engine computes
KV for `all_token_ids[:num_computed_tokens]`; a step schedules the next
`num_tokens - num_computed_tokens` (or a chunk of them). When a step reaches the end
of `all_token_ids` the request samples its next token. Preemption by recompute resets
`num_computed_tokens` to 0 and frees the block table; the tokens stay.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

from actors.bad_words import BadWords
from actors.detokenizer import IncrementalDetokenizer, text_between
from actors.draft_acceptance import DraftAcceptance
from actors.logit_rules import LogitRules
from actors.prompt_lookup import PromptLookup
from actors.sampling_params import SamplingParams
from actors.stop_strings import StopStrings
from actors.structured_output import OutputConstraint
from kernels.penalties import TokenCounts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens or the model's context reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"


# `is_finished` is read a few times a request a step: through a module global it
# costs half what it does through the enum class (0.12 us against 0.26, a one-off
# probe).
_FINISHED = RequestStatus.FINISHED


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # among the vocabulary, 1 the best (a prompt token's; vLLM's prompt_logprobs)


@dataclass(frozen=True)
class SampledToken:
    """A token sampled elsewhere and handed over: a prefill worker's first token."""

    token_id: int
    logprob: TokenLogprob | None


@dataclass(eq=False)  # (by identity: the batch's lists are searched for one, and ~40 fields compared a match)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # of its draws (`kernels.sampling.uniform_draws`): params.seed, or one the engine picked
    detokenizer: IncrementalDetokenizer | None = None
    arrival_s: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks so far
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (on D, P's: ChunkMeta.num_cached_tokens)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_matched: int | str | None = None  # what ended it for "stop": a stop token's id (EOS too), a stop string
    output_text: str = ""
    stop_strings: StopStrings | None = None  # its params' stop strings, searched as its text grows
    stop_token_ids: frozenset[int] = frozenset()  # its params' stop tokens, and EOS unless ignore_eos
    bad_words: BadWords | None = None  # its params' bad_words as token sequences, if any
    constraint: OutputConstraint | None = None  # its params' regex, as its output's place in it
    # Its pattern's fixed text written without a step (jump-forward): a pattern, no
    # logprobs (those tokens have none), EngineConfig.jump_forward.
    jumps_forward: bool = False
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    exports_kv: bool = False  # a prefill worker's request: its KV leaves this worker
    token_counts: TokenCounts | None = None  # its penalties' view of its tokens (kernels/penalties.py), if any
    # With params.prompt_logprobs: entry p is prompt token p's logprob given the
    # tokens before it (None for p = 0, and until computed).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Blocks imported from the KV store for this prompt, held (one reference each)
    # until the scheduler admits the request and takes its own references.
    pinned_block_ids: list[int] = field(default_factory=list)
    # While waiting for prompt blocks a running request is computing
    # (`Scheduler._waits_for_prefix`): the last of them, and how many blocks of its
    # prompt were cached then.
    awaited_block_hash: bytes | None = None
    num_blocks_cached_then: int = 0
    # Speculative decoding (EngineConfig.num_speculative_tokens): tokens proposed to
    # follow its last one (`lookup`'s), verified in its next decode step. Never part of
    # `output_token_ids` unless a step's samples confirm them.
    draft_token_ids: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    num_failed_drafts: int = 0  # its draft steps in a row that confirmed no draft
    draft_pause_steps: int = 0  # proposals it skips before drafting again (actors/speculation.py)
    draft_acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)  # how its drafts stand, of late

    @functools.cached_property
    def logit_rules(self) -> LogitRules:
        """Its params' rules for its logits as arrays, made at its first draw that has any."""
        return LogitRules.of(self.params, self.stop_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def has_all_prompt_logprobs(self) -> bool:
        """Every prompt token's logprob is in (the first has none)."""
        return self.prompt_logprobs is not None and all(lp is not None for lp in self.prompt_logprobs[1:])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet (1 for a request in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Computing the prompt (or recomputing after preemption), not decoding."""
        return not self.output_token_ids or self.num_pending_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def reads_output(self) -> bool:
        """Whether what its draw may take depends on the tokens before it, not only
        on their counts: a pattern, a bad word of several tokens. A step launched
        ahead samples such a row once the host has read those tokens."""
        return self.constraint is not None or (self.bad_words is not None and self.bad_words.reads_output)

    def output(self) -> RequestOutput:
        """The request as of now, for the engine's callers (see `RequestOutput`)."""
        detokenizer = self.detokenizer
        final_text = self.output_text if self.is_finished else None
        if final_text is not None:
            num_chars = len(final_text)
        elif self.stop_strings is not None:
            # Hold back what could still become the start of a stop string.
            num_chars = max(0, detokenizer.num_chars - self.stop_strings.held_chars)
        else:
            num_chars = detokenizer.num_chars
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            num_tokens=len(self.output_token_ids),
            num_chars=num_chars,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            arrival_s=self.arrival_s,
            first_token_s=self.first_token_s,
            _token_ids=self.output_token_ids,
            _logprobs=self.logprobs if self.params.logprobs is not None else None,
            _token_times_s=self.token_times_s,
            _text_pieces=detokenizer.pieces,
            _piece_ends=detokenizer.piece_ends,
            _final_text=final_text,
            prompt_logprobs=self.prompt_logprobs,
            stop_matched=self.stop_matched,
        )


@dataclass(slots=True)
class RequestOutput:
    """A request as of one step: its first `num_tokens` output tokens (with their
    logprobs and arrival times) and the first `num_chars` characters of its text.
    The lists are not copied when the output is made: it holds the request's own
    lists (the text as the detokenizer's pieces), which only ever grow, and cuts
    them when read. So an output costs the same at any length (copying them every
    step made a request's outputs cost O(n^2) in its length), and reading one from
    another thread is safe. `new_token_ids(start)`, `new_logprobs(start)` and
    `new_text(start)` read a tail without copying the rest. A finished request's
    text is its final one (a stop string may have cut it). A plain record, not
    frozen: one is made for every request every step, and a frozen dataclass's
    constructor costs about four times as much (3.2 us against 0.74, a one-off
    probe)."""

    request_id: str
    prompt_token_ids: list[int]
    num_tokens: int
    num_chars: int
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    arrival_s: float
    first_token_s: float | None
    _token_ids: list[int] = field(repr=False)
    _logprobs: list[TokenLogprob] | None = field(repr=False)
    _token_times_s: list[float] = field(repr=False)
    _text_pieces: list[str] = field(repr=False)
    _piece_ends: list[int] = field(repr=False)
    _final_text: str | None = field(repr=False)  # once finished
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)  # if asked for
    stop_matched: int | str | None = None  # (`Request.stop_matched`)

    @property
    def text(self) -> str:
        return self.new_text(0)

    def new_text(self, start: int) -> str:
        if self._final_text is not None:
            return self._final_text[start:]
        return text_between(self._text_pieces, self._piece_ends, start, self.num_chars)

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids[: self.num_tokens]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return None if self._logprobs is None else self._logprobs[: self.num_tokens]

    @property
    def token_times_s(self) -> list[float]:
        return self._token_times_s[: self.num_tokens]

    def new_token_ids(self, start: int) -> list[int]:
        return self._token_ids[start : self.num_tokens]

    def new_logprobs(self, start: int) -> list[TokenLogprob] | None:
        return None if self._logprobs is None else self._logprobs[start : self.num_tokens]
