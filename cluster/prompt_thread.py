"""A scheduler replica's prompt work (chat templates rendered, prompts tokenized
and fitted to the limits) for a large request body on a thread of its own, off the
event loop; a small body's on the loop.

The replica's event loop carries every stream it serves. Rendering a template and
tokenizing take time in proportion to the body, and a body may be up to
`limits.max_body_bytes` (2 MiB by default): 600k characters of mixed text took
0.7 s to tokenize, and `truncation: "auto"` renders and tokenizes a long
conversation about log2(turns) times. On the loop, 16 such requests at once held
an unrelated stream's next token, and a small request's answer, back 11 s, though
each ended in a 400 (`tandem bench large-bodies`; docs/benchmarks.md). On the
thread they no longer hold the loop: the tokenizer (Rust) lets go of the GIL while it encodes, and a
template's rendering (Python) yields it to the loop every switch interval (5 ms).

Two lanes, by the request's body size (`BODY_BYTES`, which the ingress guard sets
for each request, chunked bodies included): up to INLINE_BODY_BYTES the work is
done where it is asked for, on the loop (about 10 ms at most: the cost it always
had, and no thread hop for the common request); above, on the one prompt thread,
one body at a time in the order they came, so large bodies wait for each other but
never hold a small request's prompt, or a stream, behind them. Two threads at most
use the tokenizer at once, each to encode or decode (a shared borrow of the Rust
tokenizer; none of this code changes its truncation or padding, which would
borrow it mutably). A request whose client leaves while its prompt waits on the
thread is still prepared (the work is not interrupted), then dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

INLINE_BODY_BYTES = 16 * 1024  # about 10 ms of tokenizing at most (0.6 us a byte of CJK text, the costliest)
BODY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("tandem_body_bytes", default=0)


class PromptThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-prompt")

    async def run(self, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)`, for the request being served: on the prompt thread
        if its body is over INLINE_BODY_BYTES, else here; its result, or its
        exception."""
        if BODY_BYTES.get() <= INLINE_BODY_BYTES:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))


def prompt_work_is_large() -> None:
    """The request being served prepares a large prompt whatever its body's size
    (a Responses request continuing a stored conversation, which may be tens of
    MB): its prompt work goes on the prompt thread. A 49-byte body rendered and
    tokenized 0.5 MB of history on the event loop, 0.9 s every stream waited."""
    BODY_BYTES.set(max(BODY_BYTES.get(), INLINE_BODY_BYTES + 1))
