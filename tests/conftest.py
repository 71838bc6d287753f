"""Shared fixtures: the built-in tiny checkpoints and their Hugging Face twins; and
`wait_idle`, for tests of worker actors."""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", params=["qwen2", "qwen3", "qwen3_moe", "llama", "mistral"])
def tiny_model_dir(request):
    """The tiny preset of each architecture, built once per machine."""
    from actors.model_builder import ensure_checkpoint

    return ensure_checkpoint("tiny", request.param)


@pytest.fixture(scope="session")
def tiny_qwen2_dir():
    from actors.model_builder import ensure_checkpoint

    return ensure_checkpoint("tiny", "qwen2")


_HF_CACHE: dict = {}


def hf_model(model_dir):
    """transformers' own model for a checkpoint, float32, cached per folder."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, EOS disabled (compare with ignore_eos).
    Passes the attention mask explicitly: without it, generate masks every prompt
    position that holds the pad id."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each output position for the chosen token."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (logical CPUs; no dashboard)."""
    import ray

    if not ray.is_initialized():
        # "local": a cluster of this process's own, never one `ray start` recorded in /tmp/ray
        ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_local):
    """Ray Serve's HTTP proxy on a free loopback port, for the whole session."""
    import socket

    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def wait_healthy(base_url: str, timeout_s: float = 180.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} never became healthy")


def deploy_app(name: str, args: dict, port: int) -> str:
    """Deploy the Tandem app under /<name>; returns its base URL once healthy."""
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}/{name}"
    wait_healthy(base)
    return base


def served_app(name: str, args: dict, port: int):
    """A module-scoped app fixture's body (`yield from served_app(...)`): the app
    deployed under /<name>, its base URL, then the app and its pool gone."""
    yield deploy_app(name, args, port)
    undeploy_app(name, args["pool_name"])


def undeploy_app(name: str, pool_name: str) -> None:
    import ray
    from ray import serve

    serve.delete(name)
    try:
        pool = ray.get_actor(pool_name, namespace="tandem")
        ray.get(pool.shutdown.remote())
        ray.kill(pool)
    except ValueError:
        pass


def wait_idle(actor, within_s: float = 10.0):
    """A worker actor's block accounting back to full, nothing reserved, running or
    waiting, within a bounded time; returns its stats."""
    import ray

    deadline = time.monotonic() + within_s
    while True:
        stats = ray.get(actor.check_accounting.remote())
        if stats.num_used_blocks == 0 and stats.num_reserved == 0 and stats.num_running == 0 \
                and stats.num_waiting == 0 and stats.num_waiting_handshakes == 0:
            return stats
        assert time.monotonic() < deadline, f"still holding: {stats}"
        time.sleep(0.1)


# Their own Ray clusters, started in a subprocess (tests/autoscale_check.py, tests/multinode_check.py).
RAY_CLUSTER_FILES = {"test_autoscale_cluster.py", "test_multinode.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist
    loadgroup --no-loadscope-reorder`): the tests on a Ray cluster in one group,
    one after another on one worker, on the session's cluster (they keep both
    cores busy), and first; each other file a group of its own, on the other
    worker meanwhile. Those run in one process (the tiny models, the parsers):
    one after another, they left a core idle for about 300 s of the suite's 1480.

    Runs before xdist's own hook (tryfirst), which writes each test's group into
    its id. pytest 9.2's structured ids drop what it writes (pytest-xdist#1386,
    so pyproject.toml keeps pytest below 9.2): with no groups, xdist sent the
    tests out a few at a time, the Ray ones to both workers; each worker started
    a cluster of its own and deployed a module's app again (docs/benchmarks.md,
    session 66)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group("ray" if _on_ray(item) else item.path.name))
    items.sort(key=lambda item: not _on_ray(item))


def _on_ray(item) -> bool:
    return "ray_local" in item.fixturenames or item.path.name in RAY_CLUSTER_FILES


def pytest_runtest_setup(item):
    """A test not on Ray runs at the lowest CPU priority under xdist (nice 19,
    below Ray's workers at 15): on the cores the Ray tests leave idle, not in
    their way. At nice 0 it slowed them (the autoscaling check 107 s against 90),
    and two of their time bounds ran out (a handshake's 10 s, a client's 5 s).
    A process cannot lower its niceness again, so the Ray group is scheduled
    first (`pytest_collection_modifyitems`): the worker given it runs it before
    any other file, never niced while it runs Ray tests."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _on_ray(item):
        os.nice(max(19 - os.nice(0), 0))
