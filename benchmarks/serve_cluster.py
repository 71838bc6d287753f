"""A local Ray + Serve cluster holding several Tandem apps side by side, for the
serving benchmarks.

    with ServeCluster() as cluster:
        urls = cluster.deploy({"disagg": args_a, "colocated": args_b})  # all healthy
        ...                                                             # drive them by HTTP
    # apps deleted, their detached pool managers shut down, Serve and Ray stopped

Each app gets its own route prefix (`/<name>`) and its own pool manager (a detached
actor named `<pool_prefix>-<name>` in namespace "tandem"), so the systems under test
live in one cluster and are driven one at a time, in turn (A/B/A/B). Apps are
deployed one after another (`serve.run` returns once the scheduler replica is up)
and then awaited together on /health, so the workers' model loading and start-up
profiles overlap.
"""

from __future__ import annotations

import socket
import time

POOL_NAMESPACE = "tandem"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeCluster:
    def __init__(self, num_cpus: int = 8, pool_prefix: str = "bench-pool", health_timeout_s: float = 600.0) -> None:
        self.num_cpus = num_cpus
        self.pool_prefix = pool_prefix
        self.health_timeout_s = health_timeout_s
        self.port: int | None = None
        self.apps: dict[str, str] = {}  # name -> pool manager's actor name

    def __enter__(self) -> ServeCluster:
        import ray
        from ray import serve

        if ray.is_initialized():
            raise RuntimeError("Ray is already initialized in this process")
        ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            for name in list(self.apps):
                try:
                    self.undeploy(name)
                except Exception as error:  # keep tearing down the rest
                    print(f"undeploying {name} failed: {type(error).__name__}: {error}", flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def deploy(self, systems: dict[str, dict]) -> dict[str, str]:
        """Deploy every app (name -> settings for `build_app`), wait until all
        answer /health with 200; returns name -> base URL."""
        from ray import serve

        from cluster.app import build_app

        for name, args in systems.items():
            args = {**args, "pool_name": f"{self.pool_prefix}-{name}"}
            serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
            self.apps[name] = args["pool_name"]
        for name in systems:
            wait_healthy(self.url(name), self.health_timeout_s)
        return {name: self.url(name) for name in systems}

    def undeploy(self, name: str) -> None:
        import ray
        from ray import serve

        pool_name = self.apps.pop(name)
        serve.delete(name)
        try:
            pool = ray.get_actor(pool_name, namespace=POOL_NAMESPACE)
        except ValueError:
            return
        ray.get(pool.shutdown.remote())
        ray.kill(pool)

    def members(self, name: str) -> list:
        """The pool manager's members of one app (worker_id, role, handle)."""
        import ray

        pool = ray.get_actor(self.apps[name], namespace=POOL_NAMESPACE)
        return ray.get(pool.list_members.remote())


def wait_healthy(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} did not answer /health with 200 within {timeout_s:.0f} s")
