"""A local Ray cluster whose worker nodes the autoscaler launches and terminates:
autoscaler v2 with the fake multi-node provider, every node a set of processes on
this machine.

    types = {"prefill": fake_node_type({"CPU": 1}, {"tandem/role": "prefill"}, max_workers=2)}
    with FakeAutoscalingCluster(types) as cluster:
        ray.init(address=cluster.address)
        ...                       # an actor that asks for a prefill node gets one
    # every process of the cluster stopped

Why not `ray.cluster_utils.AutoscalingCluster`: its `start()` and `shutdown()` run
`ray stop --force`, which kills every Ray process of this user on the machine
(other people's clusters and test sessions included), it reads a config file the
PyPI wheel lacks (`fake_multi_node/example.yaml`; the launcher also reads it for
the `fake_multinode` provider type's defaults, so the provider is named here as an
`external` module instead), and it leaves the address in
the default `/tmp/ray/ray_current_cluster`, where any later plain `ray.init()` on
the machine would connect to it. This one writes its full config itself, starts
the head with `ray start --head --block` in a new process group, on a free port,
under its own temp dir, and stops exactly that process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"  # the provider's fixed head id


def fake_node_type(resources: dict, labels: dict, min_workers: int = 0, max_workers: int = 1) -> dict:
    """One `available_node_types` entry (integer resources, as Ray's schema wants)."""
    return {"resources": dict(resources), "labels": dict(labels), "node_config": {},
            "min_workers": min_workers, "max_workers": max_workers}


def cluster_config(node_types: dict, head_resources: dict, gcs_address: str, idle_timeout_s: float) -> dict:
    """A complete cluster-launcher config for the fake multi-node provider (every
    key the launcher's schema expects; no file from Ray's source tree needed)."""
    return {
        "cluster_name": "tandem-fake",
        "max_workers": sum(t["max_workers"] for t in node_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            # "external" names the provider class: the "fake_multinode" type would make
            # the launcher read its defaults from a file the PyPI wheel lacks.
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            **node_types,
            "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0},
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeAutoscalingCluster:
    def __init__(self, node_types: dict, head_cpus: int = 0, idle_timeout_s: float = 6.0,
                 start_timeout_s: float = 120.0) -> None:
        self.node_types = node_types
        self.head_cpus = head_cpus
        self.idle_timeout_s = idle_timeout_s
        self.start_timeout_s = start_timeout_s
        self.temp_dir: str | None = None
        self.address: str | None = None
        self._head: subprocess.Popen | None = None

    def __enter__(self) -> FakeAutoscalingCluster:
        import ray._private.services as services

        # Short: Ray's unix socket paths live under it (108-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="tfc-", dir="/tmp")
        port = _free_port()
        self.address = f"{services.get_node_ip_address()}:{port}"
        config = cluster_config(self.node_types, {"CPU": self.head_cpus}, self.address, self.idle_timeout_s)
        config_path = Path(self.temp_dir) / "autoscaler.json"
        config_path.write_text(json.dumps(config))
        env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_enable_autoscaler_v2="1",
                   RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID, RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
        ray_cli = str(Path(sys.executable).with_name("ray"))
        command = [ray_cli, "start", "--head", "--block", f"--port={port}", f"--temp-dir={self.temp_dir}",
                   f"--num-cpus={self.head_cpus}", f"--autoscaling-config={config_path}",
                   "--include-dashboard=false", "--disable-usage-stats",
                   # Ray's fixed default ports would collide with another cluster on the machine.
                   f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}"]
        log = open(Path(self.temp_dir) / "head.log", "wb")
        self._head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_up(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        host, port = self.address.rsplit(":", 1)
        while time.monotonic() < deadline:
            if self._head.poll() is not None:
                raise RuntimeError(f"ray start exited with {self._head.returncode}; see {self.temp_dir}/head.log")
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"the fake cluster's head did not come up within {self.start_timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop this cluster's processes only: its own process group (the head's
        `ray start --block` leads it; fake nodes are started inside it)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._head is not None:
            pgid = self._head.pid
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and _group_alive(pgid):
                    self._head.poll()  # reap the leader, or it stays in the group as a zombie
                    time.sleep(0.2)
                if not _group_alive(pgid):
                    break
            self._head.wait(timeout=5)
            self._head = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
