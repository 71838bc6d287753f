"""What a redeploy may change of running pools (cluster/pool_settings.py): the
settings a worker was started from are named, leaf by leaf, when a manifest
changes them; its pool sizes, SLO and autoscaling knobs, limits and served name
are the deployment's to change. The refusal against a real pool manager is in
tests/test_pool_sizes.py, through `serve run` in tests/test_serve_app.py."""

from __future__ import annotations

from cluster.config import AppSettings
from cluster.pool_settings import pools_keep, redeploy_refusal

BASE = {"model": {"preset": "tiny", "arch": "qwen2"}, "engine": {"block_size": 16, "num_kv_blocks": 64},
        "limits": {"max_prompt_tokens": 1023}, "pool_name": "p"}


def _dump(**changes) -> dict:
    return AppSettings.model_validate({**BASE, **changes}).model_dump()


def test_a_manifest_the_pools_could_have_been_started_from_changes_nothing_they_keep():
    running = _dump()
    assert pools_keep(running, running) == []
    tuned = _dump(prefill={"replicas": 3}, slo={"ttft_ms": 900}, autoscaling={"interval_s": 1},
                  limits={"max_prompt_tokens": 1000, "max_new_tokens": 64}, routing="least_load",
                  model={"preset": "tiny", "arch": "qwen2", "name": "renamed"})
    assert pools_keep(running, tuned) == []


def test_each_setting_a_worker_was_started_from_is_named_with_both_values():
    running = _dump()
    changed = _dump(model={"preset": "bench", "arch": "qwen2"},
                    engine={"block_size": 32, "num_kv_blocks": 64, "max_num_seqs": 8},
                    kv_store={"host_gib": 0.5}, timeouts={"transfer_s": 5}, mode="colocated",
                    limits={"max_prompt_tokens": 2047},
                    colocated={"replicas": 1})
    assert pools_keep(running, changed) == [
        "model.preset: 'tiny' -> 'bench'",
        "mode: 'disaggregated' -> 'colocated'",
        "engine.block_size: 16 -> 32",
        "engine.max_num_seqs: 64 -> 8",
        "kv_store: None -> {'host_gib': 0.5, 'disk_path': None, 'disk_gib': 16.0, 'shared_path': None, "
        "'shared_gib': None, 'ttl_s': None, 'high_watermark': 0.9, 'low_watermark': 0.7, "
        "'write_through_shared': True}",
        "timeouts.transfer_s: 30.0 -> 5.0",
    ]
    message = redeploy_refusal("p", pools_keep(running, _dump(engine={"block_size": 32})))
    assert message.startswith("the running worker pools 'p' keep the settings they were started from; this "
                              "manifest changes engine.block_size: 16 -> 32") and "`tandem teardown`" in message



def test_pools_started_by_the_version_before_redeploy_as_before():
    """It dumped a checkpoint folder's model.arch as "qwen2" (the default, unread);
    this one dumps none: a redeploy over such pools was refused for it (found by
    a review)."""
    folder = {**BASE, "model": {"path": "/models/x"}}
    deployed = AppSettings.model_validate(folder).model_dump()
    older = {**deployed, "model": {**deployed["model"], "arch": "qwen2"}}
    assert deployed["model"]["arch"] is None and pools_keep(older, deployed) == []
