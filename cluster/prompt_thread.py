"""A scheduler replica's prompt work (chat templates rendered, prompts tokenized
and fitted to the limits) on a thread of its own, off the event loop.

The replica's event loop carries every stream it serves. Rendering a template and
tokenizing take time in proportion to the body, and a body may be up to
`limits.max_body_bytes` (2 MiB by default): 1 MB of CJK text took a second to
tokenize, and `truncation: "auto"` renders and tokenizes a long conversation about
log2(turns) times. On the loop, 16 such requests at once held an unrelated stream's
next token back 6.3 s, past any TBT SLO, even though each ended in a 400. On this
thread they hold back only each other: the tokenizer (Rust) lets go of the GIL
while it encodes, and a template's rendering (Python) yields it to the loop every
switch interval (5 ms).

One thread, so prompts are prepared one at a time in the order they came, as on the
loop before, and the tokenizer is never used from two threads at once. A request
whose client leaves while its prompt waits here is still prepared (the work is not
interrupted), then dropped.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


class PromptThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-prompt")

    async def run(self, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)` on the prompt thread; its result, or its exception."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
