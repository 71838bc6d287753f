"""What a scheduler replica knows of one HTTP call besides its body, for every
request the call makes (OpenAI's `n` choices, a batch's prompts, /generate's
list): when the replica took it, and whether its requests still running were
withdrawn because one of them was refused or failed.

The ingress guard opens one for each call (`open_call`), before its body is
read; the service reads it when a request starts (`current_call`), and a
request that is refused or fails says so on it (`ClientCall.ended`) before its
caller hears of it, so the others, closed for it, count as withdrawn. It lives
in a context variable because the requests run in tasks the call's handler
starts, which copy its context; the record itself is shared, so the mark
reaches requests already started.

Why `withdrawn` is its own outcome: a call's requests are closed together when
one of them ends it (an SLO refusal of choice 3 closes choices 0-2, a worker's
error in one prompt of a batch closes the rest). Counted as `cancelled`, they
read as clients hanging up: one refused `n=8` call made seven."""

from __future__ import annotations

import contextvars
import dataclasses
import time


@dataclasses.dataclass
class ClientCall:
    arrived_s: float  # wall time: an /abort_request asked since ends its requests (actors/abort_marks.py)
    withdrawn: bool = False  # one of its requests was refused or failed: the others closed since are withdrawn

    def ended(self, outcome: str) -> None:
        """One of the call's requests ended with `outcome` (the scheduler's metric's)."""
        self.withdrawn = self.withdrawn or outcome in ("error", "rejected")


_CALL: contextvars.ContextVar[ClientCall | None] = contextvars.ContextVar("tandem_client_call", default=None)


def open_call() -> ClientCall:
    """A new call, current in this context and the tasks started from it."""
    call = ClientCall(time.time())
    _CALL.set(call)
    return call


def current_call() -> ClientCall:
    """The call this context serves; one opened now where none was (the
    replica's own requests, such as its health probe)."""
    return _CALL.get() or open_call()
