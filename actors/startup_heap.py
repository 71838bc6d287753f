"""Keep CPython's cycle collector off a serving process's startup heap.

The collector stops the world, and a full (generation 2) pass walks every object it
tracks. A worker with its engine loaded tracks about 274k objects (Ray, torch,
transformers, the model's modules, the tokenizer), and a full pass over them took
101 ms here: every running request's next token waits for it. Full passes are not
rare in serving: CPython runs one once the objects promoted since the last reach a
quarter of the long-lived ones, and a decode engine keeps request state alive
(logprobs, token lists) long enough to be promoted. `tandem bench gc`
(benchmarks/gc_pauses.py, docs/benchmarks.md) decodes logprobs requests, replaced
as they end, in a process with that heap: five full passes in 3000 steps, up to
126 ms each.

Nothing built at start-up becomes garbage while the process serves, so
`freeze_startup_heap` moves it to the collector's permanent generation, which
passes skip: the same run's full passes then walk only the live request state
(15 ms at most, 55 ms in all against 598). vLLM freezes its engine-core, worker and
API-server heaps after start-up for the same reason. Reference counting still frees
every frozen object that stops being used; only a cycle among them would be kept.
A process that builds engines again and again (the offline `LLM` in a test run)
should not freeze: each engine's cycles would stay.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exclude every object alive now from
    future collections. Call once, when the process is ready to serve."""
    gc.collect()
    gc.freeze()
