"""Schedulers and cost models for tests of admission and routing (no Ray): models
fitted to known laws, a worker's idle stats, and a GlobalScheduler over a view of
workers whose models are those."""

from __future__ import annotations

from cluster.admission import WorkerModels
from cluster.cost_model import decode_features, prefill_features
from cluster.router import PrefixIndex


def fitted_models(now: float | None = None) -> WorkerModels:
    """Fitted models; with `now`, their clock stands still there (a slow machine's
    time between the test's calls does not move the predictions it compares)."""
    models = WorkerModels(block_size=16) if now is None else WorkerModels(block_size=16, clock=lambda: now)
    for new in (16, 64, 256):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.001 * new)
        models.prefill_model("p1").observe(prefill_features(new, 0), 0.001 * new)
    for batch in (1, 4, 16):
        models.decode_model("d0").observe(decode_features(batch, 0), 0.01 * batch)
    return models


class _Tokenizer:
    def __len__(self):
        return 1000


def idle_stats(worker_id: str, **figures):
    from actors.worker_base import WorkerStats

    idle = dict(num_blocks=1000, num_used_blocks=0, num_cached_blocks=0, num_running=0, num_waiting=0,
                num_reserved=0, num_channels=0, last_step_s=0.0)
    return WorkerStats(worker_id, **{**idle, **figures})


def make_scheduler(ttft_ms: float, tbt_ms: float = 1000.0, decodes: tuple[str, ...] = ("d0",), **engine):
    """A GlobalScheduler with one P and the given Ds whose cost models are known
    (`engine`: engine settings besides a block size of 16)."""
    from cluster.config import AppSettings
    from cluster.pool_manager import Member
    from cluster.service import GlobalScheduler

    settings = AppSettings.model_validate({"model": {"preset": "tiny"}, "slo": {"ttft_ms": ttft_ms, "tbt_ms": tbt_ms},
                                           "engine": {"block_size": 16, **engine}})
    scheduler = GlobalScheduler(settings, _Tokenizer(), pool=None, max_model_len=2048, kv_seed=b"")
    scheduler.view.models = fitted_models()
    for worker_id, role in (("p0", "prefill"), *((d, "decode") for d in decodes)):
        scheduler.view.members[worker_id] = Member(worker_id, role, handle=None)
        scheduler.view.stats[worker_id] = idle_stats(worker_id)
        scheduler.view.prefix[worker_id] = PrefixIndex(1000)
        scheduler.view.profiled.add(worker_id)
    return scheduler
