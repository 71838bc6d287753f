"""Runs an `Engine` on a thread of its own, so a worker actor's event loop stays free.

The engine is single-threaded: every mutation goes through `call(fn)`, which queues
`fn(engine)` to run between steps and returns a `concurrent.futures.Future` (await it
with `asyncio.wrap_future`). After each step, `on_step(exported, outputs)` runs on the
loop thread; `on_tick(engine)` runs on every turn (housekeeping such as expiring
reservations). A failure inside the step, or in either hook, fails every
in-flight request through `on_error` rather than killing the thread silently.

The thread waits for a call (up to `idle_wait_s`) when the engine has nothing to
do, and when its last step found nothing it could run (`Engine.stalled`: a
request waiting for blocks that transfers or reservations hold, which a call
frees). Asking again at once spun the thread at a whole core, some 250000 empty
steps a second, against the event loop and the transfer threads for the GIL.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from actors.engine import Engine


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable,
        on_tick: Callable[[Engine], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_tick = on_tick
        self._on_error = on_error
        self._idle_wait_s = idle_wait_s
        self._calls: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._calls.put(None)
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[Engine], object]) -> Future:
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    def _drain_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        self.engine.runner.use_compute_stream()
        while not self._stopped.is_set():
            self._drain_calls(block=self.engine.stalled or not self.engine.has_unfinished())
            try:  # (the hooks too: a hook that raised ended the thread, every request waiting for ever)
                if self._on_tick is not None:
                    self._on_tick(self.engine)
                if not self.engine.has_unfinished():
                    continue
                exported, outputs = self.engine.run_step()
                self._on_step(exported, outputs)
            except Exception as exc:  # a bug or OOM: fail loudly, keep serving
                if self._on_error is None:
                    raise
                self._on_error(exc)
