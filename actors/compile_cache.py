"""What a process keeps of the patterns it compiled (actors/regex_dfa.py
`compile_regex`): the latest ones, within a count and a total weight (an
automaton's states), and one compile at a time for each pattern.

The ingress compiles a request's pattern in a thread to check it (cluster/app.py),
and a worker compiles it off its engine thread (`TokenIndexes.prepare`). A burst of
requests that share a new JSON schema each started the same compile at once, the
threads taking the GIL in turn: 8 of a pattern that takes about 0.5 s (a string of
at most 1000 characters) had it after 2.4-2.6 s, and the event loop, which needs
the GIL too, went up to 0.18 s without a turn (0.05 s compiling once). Now the
first compiles, and the others wait for its automaton (or its error): 0.5-0.7 s
(docs/benchmarks.md, session 58).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

Value = TypeVar("Value")


class MakersOwn(Exception):
    """An error of the thread making a value, not of its key (a limit of that
    thread's caller): a thread that waited for it makes the value itself."""


class CompileCache(Generic[Value]):
    """Values made from string keys: at most `max_entries` of them, and where
    given, their `weight`s at most `max_weight` in all (the least recently asked
    for dropped first; the latest kept whatever its weight), each made once at a
    time."""

    def __init__(self, max_entries: int, max_weight: int | None = None,
                 weight: Callable[[Value], int] | None = None) -> None:
        self.max_entries = max_entries
        self.max_weight = max_weight
        self.weight = weight
        self._values: OrderedDict[str, Value] = OrderedDict()
        self._making: dict[str, Future] = {}
        self._lock = threading.Lock()

    def get(self, key: str, make: Callable[[str], Value]) -> Value:
        """The value kept for `key`; else the one a thread already making it makes
        (its error raised here too, but for a `MakersOwn`), else `make(key)`, kept.
        Errors are not kept."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
                return value
            making = self._making.get(key)
            if making is None:
                making = self._making[key] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            try:
                return making.result()
            except MakersOwn:  # (out of `_making` before it was set: asked again, this thread makes it)
                return self.get(key, make)
        try:
            value = make(key)
        except BaseException as exc:
            with self._lock:  # (first: a waiter asking again found the failed one, and asked again, and again)
                self._making.pop(key, None)
            making.set_exception(exc)
            raise
        else:
            making.set_result(value)
            self._keep(key, value)
        finally:
            with self._lock:
                self._making.pop(key, None)
        return value

    def _keep(self, key: str, value: Value) -> None:
        with self._lock:
            self._values[key] = value
            while len(self._values) > 1 and (len(self._values) > self.max_entries or self._too_heavy()):
                self._values.popitem(last=False)

    def _too_heavy(self) -> bool:
        return self.max_weight is not None and sum(map(self.weight, self._values.values())) > self.max_weight

    def keys(self) -> list[str]:
        """The keys kept, the least recently asked for first."""
        with self._lock:
            return list(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
