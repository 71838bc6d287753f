"""Plain-data messages that cross the actor boundary (P <-> D <-> scheduler).

Small frozen dataclasses (one named tuple, `TokenEvent`, for speed): no tensors
except the KV payload of the object-store channel, no handles except where a
field says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from actors.request import TokenLogprob
from actors.sampling_params import SamplingParams


class ReservationRefused(RuntimeError):
    """The decode worker cannot hold this request's KV now: try another one."""


class RequestAborted(RuntimeError):
    """The client aborted the request (`/abort_request`) while a call for it was
    under way (D's handshake, P's prefill): it ends with finish_reason "abort",
    not as a failure to retry."""


class ProfileRunning(RuntimeError):
    """A worker asked to start a trace of its steps (/start_profile) runs one."""


class TransferFailed(RuntimeError):
    """A P/D transfer could not complete (peer died, timed out, or was cancelled)."""


class WorkerDied(RuntimeError):
    """A worker serving the request died; what it held is gone."""


def error_message(exc: BaseException) -> str:
    """What an error says, for a client: an actor method's exception arrives as a
    RayTaskError that is also the worker's exception class, and its text is the
    worker's traceback; the message is its cause's."""
    return str(getattr(exc, "cause", None) or exc)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The client's name for it (SGLang's `rid`, an OpenAI response's id), which
    # `/abort_request` finds it by on the workers; "" if it has none.
    client_rid: str = ""
    arrived_s: float = 0.0  # wall time the scheduler took it: an abort asked since ends it (actors/abort_marks.py)


@dataclass(frozen=True)
class ReservationInfo:
    """D's answer to the handshake: where the prompt's KV goes."""

    request_id: str
    decode_worker_id: str
    block_ids: list[int]
    num_cached_blocks: int  # leading blocks D already holds: P skips them
    # Of those, the ones another reservation's transfer is still bringing (actors/arriving_blocks.py)
    num_borrowed_blocks: int = 0


@dataclass(frozen=True)
class ChunkMeta:
    """One transfer: `len(dst_block_ids)` whole blocks into D's reserved blocks.
    The last chunk carries the first token and the state D continues from."""

    request_id: str
    chunk_index: int
    dst_block_ids: list[int]
    is_last: bool
    first_token_id: int | None = None
    first_logprob: TokenLogprob | None = None
    seed: int | None = None  # of the request's draws: D samples on from the same one
    prompt_logprobs: list[TokenLogprob | None] | None = None  # computed by P, if the request asks
    # Prompt tokens P did not compute (its prefix cache, the KV store): the request's usage `cached_tokens`.
    # Not D's count of blocks it was not sent: those P may have computed all the same (another P's
    # prefix, or a request's it borrowed them from), and P's prefix may be new to D.
    num_cached_tokens: int = 0
    sent_s: float = 0.0  # wall clock (time.time) when P started the send


@dataclass
class ChunkTiming:
    chunk_index: int
    num_blocks: int
    compute_done_s: float  # P finished the chunk's compute
    send_start_s: float
    arrived_s: float  # bytes in D's blocks (D's clock)
    acknowledged_s: float  # P heard they arrived (P's clock): the pair's channel is free for the next chunk


@dataclass(frozen=True)
class PrefillStep:
    """One engine step that computed prompt tokens only (no request decoding in
    it), as a worker timed it: what the scheduler refits the worker's prefill
    model on (cluster/admission.py). `seq` orders a worker's steps (its step
    count then); each chunk is (prompt tokens computed, tokens before them)."""

    seq: int
    chunks: tuple[tuple[int, int], ...]
    seconds: float


@dataclass
class PrefillResult:
    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt tokens P computed (not served by its cache)
    num_blocks_sent: int
    num_bytes_sent: int
    prefill_start_s: float
    first_token_s: float
    chunks: list[ChunkTiming] = field(default_factory=list)


class TokenEvent(NamedTuple):
    """What a decode (or colocated) worker streams per step of a request.

    A named tuple, not a frozen dataclass, because one is made per request per
    step on the engine thread (0.8 us against 2.5) and a worker's feed ships them
    as plain tuples (`tuple(event)`, rebuilt by position: a row from a worker of
    an earlier version, a field short, takes the defaults): Ray's pickler calls
    back into Python for every object it does not know, so a list of 64
    dataclasses took 230 us to pickle and a list of 64 tuples 20 us (one-off
    probes), on the worker's event-loop thread, which shares the GIL with its
    engine. New fields go last, with defaults."""

    request_id: str
    token_ids: list[int]  # new tokens in this event
    text: str  # new text in this event
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    time_s: float  # wall clock
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first event, if asked for
    # An error that was another request's: the KV blocks this one borrowed from it never came
    # (actors/arriving_blocks.py). Its pair is sound: the scheduler tries it again there, the try not counted.
    borrowed_kv_lost: bool = False
    stop_matched: int | str | None = None  # on a request's last event: what ended it for "stop" (`Request`)
