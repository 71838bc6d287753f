"""The application builder starts the pool manager beside the replicas' start
(cluster/early_pools.py), where the deploy will stand: the checkpoint is on this
node and loads. A model that is wrong, or not here, leaves no pool behind."""

from __future__ import annotations

import shutil

import ray

from actors.model_builder import built_checkpoint
from cluster.app import build_app
from cluster.config import AppSettings
from cluster.early_pools import start_pools_early
from cluster.pool_manager import NAMESPACE

ARGS = {"mode": "colocated", "colocated": {"replicas": 1, "num_cpus": 1}, "engine": {"num_kv_blocks": 128},
        "pool_name": "test-pool-early"}


def _pool_running(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _remove_pool(name: str) -> None:
    pool = ray.get_actor(name, namespace=NAMESPACE)
    ray.get(pool.shutdown.remote())
    ray.kill(pool)


def test_building_the_app_starts_its_pools_where_the_checkpoint_loads(ray_local, tiny_qwen2_dir):
    build_app({**ARGS, "model": {"path": str(tiny_qwen2_dir)}})
    try:
        assert _pool_running(ARGS["pool_name"])
        members = ray.get(ray.get_actor(ARGS["pool_name"], namespace=NAMESPACE).list_members.remote())
        assert [m.role for m in members] == ["colocated"]  # (its workers start at once)
    finally:
        _remove_pool(ARGS["pool_name"])


def test_a_wrong_or_absent_checkpoint_starts_no_pools(ray_local, tiny_qwen2_dir, tmp_path):
    broken = tmp_path / "no-config"
    shutil.copytree(tiny_qwen2_dir, broken)
    (broken / "config.json").unlink()
    no_vocabulary = tmp_path / "no-vocabulary"
    shutil.copytree(tiny_qwen2_dir, no_vocabulary)
    (no_vocabulary / "tokenizer.json").unlink()
    bad_generation = tmp_path / "bad-generation"
    shutil.copytree(tiny_qwen2_dir, bad_generation)
    (bad_generation / "generation_config.json").write_text("{not json")
    for folder in (broken, no_vocabulary, bad_generation, tmp_path / "nowhere"):
        settings = AppSettings.model_validate({**ARGS, "model": {"path": str(folder)}})
        assert not start_pools_early(settings), folder.name
        assert not _pool_running(ARGS["pool_name"]), folder.name


def test_a_preset_not_built_on_this_node_is_not_built_for_it(ray_local, tmp_path, monkeypatch):
    """Presets are built on the nodes that run them; the builder's node may be none."""
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path))
    settings = AppSettings.model_validate({**ARGS, "model": {"preset": "tiny", "arch": "llama"}})
    assert settings.model.location().present() is None
    assert not start_pools_early(settings)
    assert not _pool_running(ARGS["pool_name"]) and built_checkpoint("tiny", "llama") is None
    assert list(tmp_path.iterdir()) == []


def test_without_ray_connected_the_replicas_start_the_pools(tiny_qwen2_dir, monkeypatch):
    """`serve run module:app` builds before it connects to Ray."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert not start_pools_early(AppSettings.model_validate({**ARGS, "model": {"path": str(tiny_qwen2_dir)}}))


def test_a_built_preset_is_present(tiny_qwen2_dir):
    settings = AppSettings.model_validate({**ARGS, "model": {"preset": "tiny", "arch": "qwen2"}})
    assert settings.model.location().present() == tiny_qwen2_dir
