"""A worker's start-up report: when its process began, and how the time since the
request reads when Ray placed the actor in a worker process it had started ahead."""

import subprocess
import sys
import time

from actors.worker_base import WorkerStartup, _process_started


def test_a_process_start_time_falls_between_the_spawn_and_its_first_line():
    before = time.time()
    child = subprocess.run(
        [sys.executable, "-c", "from actors.worker_base import _process_started; print(_process_started(0.0))"],
        capture_output=True, text=True, check=True,
    )
    after = time.time()
    started = float(child.stdout)
    assert before - 0.05 <= started <= after  # /proc's clock ticks: 10 ms


def test_this_process_started_before_now():
    assert 0 < time.time() - _process_started(0.0) < 24 * 3600


def test_the_report_reads_a_prestarted_process_as_such():
    startup = WorkerStartup(process_started=100.0, init_started=102.0, ready=103.0)
    assert startup.describe(requested=99.5) == (
        "process up 0.5 s after the request (node, scheduling), boot and imports 2.0 s, engine 1.0 s")
    assert startup.describe(requested=100.5) == (
        "a Ray worker process up since 0.5 s before the request, boot and imports 1.5 s, engine 1.0 s")


def test_an_engine_starts_without_importing_torch_dynamo_or_sympy(tiny_qwen2_dir):
    """The model is built on the meta device: `Embedding`'s normal_ init and the
    RoPE table's arange went there through torch._refs, which imports
    torch._dynamo, about a second of each worker's start on 2 CPUs (docs/benchmarks.md,
    "Session 56"); `to_empty` then went through them too, and imported sympy
    (0.4 s; "Session 57")."""
    code = ("import sys; from actors.config import EngineConfig; from actors.engine import Engine; "
            f"Engine({str(tiny_qwen2_dir)!r}, EngineConfig(num_kv_blocks=64)); "
            "print([name for name in ('torch._dynamo', 'sympy') if name in sys.modules])")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.splitlines()[-1] == "[]"
