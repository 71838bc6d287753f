"""A torch profiler trace of a worker's engine steps, asked for over HTTP
(`POST /start_profile`, `/stop_profile`: SGLang's and vLLM's endpoints).

The profiler starts and stops on the engine thread, between steps, so the trace
holds whole steps: every operator the steps ran on that thread, and on a GPU every
kernel and copy of the device. Each step is marked (`profiler.step()`), so a viewer
(Perfetto, chrome://tracing) shows where one ends. With `num_steps` the trace ends
by itself after that many steps; `/stop_profile` ends it sooner. The trace is
written where the manifest says (`profile_dir`, on the worker's node), as
`<worker id>-<time>.trace.json.gz`: a client never names a path on the server
(vLLM likewise takes the folder from the server's configuration only).

A step profiled costs more than one not (the profiler records each operator): a
trace tells where the time of a step goes, not how fast steps are.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile


class StepProfile:
    def __init__(self, folder: str, worker_id: str, num_steps: int | None = None, record_shapes: bool = False,
                 with_stack: bool = False) -> None:
        # (to the millisecond: two traces of a worker in one second had one name, the second written over the first)
        now = time.time()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{int(now * 1000) % 1000:03d}"
        self.path = Path(folder) / f"{worker_id}-{stamp}.trace.json.gz"
        self.num_steps = num_steps  # None: until stopped
        self.steps_seen = 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # A schedule that records throughout: with one, the profiler marks each step
        # (a `ProfilerStep#n` range); without, it marks none.
        self._profiler = profile(activities=activities, schedule=lambda step: ProfilerAction.RECORD,
                                 record_shapes=record_shapes, with_stack=with_stack)

    def start(self) -> None:
        """On the engine thread. Makes the folder, so a bad one fails here, not
        after the steps were profiled."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.start()

    def step(self) -> bool:
        """After each engine step; whether the steps asked for are done."""
        self._profiler.step()
        self.steps_seen += 1
        return self.num_steps is not None and self.steps_seen >= self.num_steps

    def stop(self) -> str:
        """Ends the profile and writes its trace; returns the trace's path."""
        self._profiler.stop()
        self._profiler.export_chrome_trace(str(self.path))
        return str(self.path)
