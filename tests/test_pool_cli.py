"""`tandem pools`, `tandem drain` and `tandem teardown` against a running pool manager on a real Ray
cluster (the tests' own, through its GCS address), and their one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from actors.kv_store import KVStoreSettings
from actors.kv_store_client import STORE_NAMESPACE, open_kv_store
from benchmarks.scheduler_driver import run_with_pool
from cluster.cli_error import CliError
from cluster.pool_cli import _answer

SETTINGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "engine": {"block_size": 16, "num_kv_blocks": 64},
    "limits": {"max_prompt_tokens": 1023},  # the longest prompt and its first token fill the 64 blocks
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "autoscaling": {"drain_grace_s": 120},  # the drained worker stays draining through the test
    "pool_name": "test-pool-cli",
    "api_key": "sk-test-secret",
}


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent, env={**os.environ, "RAY_AUTH_MODE": "disabled"})


async def _scenario(pool, settings):
    await pool.list_members.remote()  # both up; a control step records them ready (at most interval_s later)
    while len([e for e in await pool.scaling_events.remote() if e.kind == "ready"]) < 2:
        await asyncio.sleep(0.1)
    where = ["--address", ray.get_runtime_context().gcs_address, "--pool-name", settings.pool_name]
    run = lambda *args: asyncio.to_thread(_tandem, *args)  # noqa: E731
    # (side by side where nothing orders them: each command connects to the cluster for seconds)
    listed, no_pool, only = await asyncio.gather(
        run("pools", *where, "--json"), run("pools", "--address", where[1], "--pool-name", "no-such-pool"),
        run("pools", "--address", where[1], "--json"))  # the only pool manager: no --pool-name needed
    drained = await run("drain", "p0", *where)
    again, unknown, text = await asyncio.gather(
        run("drain", "p0", *where), run("drain", "x9", *where), run("pools", *where, "--events", "3"))
    handles = [m.handle for m in await pool.list_members.remote()]
    store = open_kv_store(b"test-pool-cli", KVStoreSettings(host_bytes=1 << 20))  # a node's store, detached
    await store.handle.stats.remote()
    torn = await run("teardown", *where, "--kv-stores")
    stores_left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == STORE_NAMESPACE]
    gone = await run("pools", *where)
    workers_alive = []
    for handle in handles:
        try:
            await asyncio.wait_for(handle.ping.remote(), 30)
            workers_alive.append(handle)
        except ray.exceptions.RayActorError:
            pass
    return dict(listed=listed, drained=drained, again=again, unknown=unknown, text=text, no_pool=no_pool,
                only=only, torn=torn, gone=gone, workers_alive=workers_alive, stores_left=stores_left)


def test_pools_lists_the_workers_and_drain_takes_one_out(ray_local, tiny_qwen2_dir):
    r = run_with_pool(SETTINGS, _scenario)
    assert r["listed"].returncode == 0, r["listed"].stderr
    listed = json.loads(r["listed"].stdout)
    assert {(w["worker_id"], w["role"], w["state"]) for w in listed["workers"]} == {
        ("p0", "prefill", "ready"), ("d1", "decode", "ready")}
    assert listed["failing"] == {} and {e["kind"] for e in listed["events"]} >= {"started", "ready"}
    assert listed["settings"]["engine"]["num_kv_blocks"] == 64 and listed["settings"]["prefill"]["replicas"] == 1
    assert listed["settings"]["api_key"] == "<redacted>" and "sk-test-secret" not in r["listed"].stdout  # (in logs)
    # p0 is the only prefill worker: it serves until p2, started in its place, has started (make before break)
    assert r["drained"].returncode == 0 and r["drained"].stdout.startswith(
        "p0 (prefill) drains once another prefill worker has started, and serves until then")
    lines = r["text"].stdout.splitlines()
    assert lines[:2] == ["pool test-pool-cli: 3 workers, disaggregated, model preset tiny (qwen2), engine on cpu",
                         "  d1       decode     ready"]
    assert lines[2].split()[:2] == ["p0", "prefill"] and lines[2].split()[2] in ("ready", "draining")
    assert lines[3].split()[:2] == ["p2", "prefill"] and lines[3].split()[2] in ("starting", "ready")
    assert lines[4].startswith("scaling events, the latest 3 of ") and len(lines) == 8
    assert any(line.endswith(" prefill drain_waits p0: by hand (tandem drain); p2 starts in its place (the "
                             "pool's minimum is 1); it serves until another prefill worker has started")
               for line in lines[5:]), lines
    assert json.loads(r["only"].stdout)["pool_name"] == "test-pool-cli"
    for failed, message in ((r["again"], "tandem drain: p0 is draining already"),  # (or waiting to)
                            (r["unknown"], "tandem drain: no worker 'x9' in pool 'test-pool-cli'; its workers: "
                                           "d1, p0, p2"),
                            (r["no_pool"], "tandem pools: no pool manager 'no-such-pool' on this cluster (its pool "
                                           "managers: test-pool-cli)")):
        assert failed.returncode == 2 and "Traceback" not in failed.stderr
        assert failed.stderr.startswith(message), failed.stderr
    assert r["torn"].returncode == 0, r["torn"].stderr
    first, stores = r["torn"].stdout.splitlines()
    assert first == "pool test-pool-cli: its 3 workers and its pool manager stopped"
    assert stores.endswith(" KV store actors stopped (their disk and shared tiers stay on disk)")
    assert int(stores.split()[0]) >= 1 and r["stores_left"] == []
    assert r["gone"].returncode == 2 and r["gone"].stderr.startswith(
        "tandem pools: no pool manager 'test-pool-cli' on this cluster"), r["gone"].stderr
    assert r["workers_alive"] == []


def test_an_address_that_is_not_a_gcs_is_one_line_at_once():
    """The dashboard's or Serve's HTTP port took the connection, and Ray retried
    it for minutes, printing warnings and no error."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer = _tandem("pools", "--address", f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert answer.returncode == 2 and "Traceback" not in answer.stderr
    assert "it answers, but not as Ray's GCS does" in answer.stderr.splitlines()[0], answer.stderr
    typo = _tandem("pools", "--address", "a..b:6379")  # (a UnicodeError from the IDNA codec, in a traceback)
    assert typo.returncode == 2 and "Traceback" not in typo.stderr and "'a..b' port 6379 is no address" in typo.stderr


def test_a_pool_manager_that_does_not_answer_or_is_gone_is_one_line(ray_local):
    """A busy or restarting one hung the command for good (no timeout), one that
    died meanwhile ended it in a traceback."""
    @ray_local.remote(num_cpus=0)
    class Slow:
        def workers(self):
            time.sleep(30)

    slow = Slow.remote()
    with pytest.raises(CliError, match="pool manager 'p' did not answer within 0.5 s"):
        _answer("p", slow.workers.remote(), timeout_s=0.5)
    ray_local.kill(slow)
    with pytest.raises(CliError, match="pool manager 'p' is gone"):
        _answer("p", slow.workers.remote())

    @ray_local.remote(num_cpus=0)
    class Failing:
        def drain(self):
            raise ValueError("no such worker (as a test)")

    with pytest.raises(CliError, match="pool manager 'p' failed the command: ValueError: no such worker"):
        _answer("p", Failing.remote().drain.remote())


def test_auto_finding_a_head_that_is_gone_is_one_line(monkeypatch):
    """Found by a review: `--address auto` (the default) resolved to a crashed
    head's address, and Ray's RuntimeError ("Failed to connect to GCS") came out
    as a traceback."""
    import argparse

    import ray

    from cluster import pool_cli
    from cluster.cli_error import CliError

    def gone(**kwargs):
        raise RuntimeError("Failed to connect to GCS. Please check `gcs_server.out` for more details.")

    monkeypatch.setattr(ray, "init", gone)
    with pytest.raises(CliError, match="no Ray cluster at 'auto' \\(Failed to connect to GCS"):
        pool_cli._pool_manager(argparse.Namespace(address="auto", pool_name=None))
