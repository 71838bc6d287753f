"""The application's settings, as a manifest's `args` give them (pydantic at the
Serve boundary; cross-field checks here, frozen engine dataclasses inside).

    args:
      model: {preset: tiny, arch: qwen2}      # or {path: /models/my-checkpoint}
      mode: disaggregated                     # or colocated
      channel: gloo                           # gloo | object_store | nccl | store (through shared_path)
      routing: cache_aware                    # round_robin | least_load | cache_aware
      engine: {block_size: 16, prefill_chunk_size: 256, num_kv_blocks: 2048}
      prefill: {replicas: 1, min_replicas: 1, max_replicas: 4, num_cpus: 1, label_selector: {tandem/role: prefill}}
      decode: {replicas: 1, num_cpus: 1, label_selector: {tandem/role: decode}}
      slo: {ttft_ms: 2000, tbt_ms: 200, attainment: 0.9}
      autoscaling: {scale_down_cooldown_s: 60, kv_usage_up: 0.8}   # see AutoscalingSettings
      limits: {max_prompt_tokens: 1536, max_new_tokens: 512}
      kv_store: {host_gib: 2, disk_path: /var/tmp/tandem-kv, shared_path: /mnt/kv, ttl_s: 86400}   # optional
      scheduler_replicas: 2                   # the global scheduler's Serve replicas (default 1)
      sampling_defaults: model                # omitted sampling fields: generation_config.json's, or openai
      response_store_mib: 64                  # stored responses and conversations (0: none), least recently used out

A pool's `replicas` is its initial size; it autoscales between `min_replicas` and
`max_replicas` (both default to `replicas`: a fixed pool) - see cluster/autoscaling.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.config import MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, EngineConfig, ModelLocation
from actors.kv_store import GIB, KVStoreSettings
from actors.model_shapes import PRESETS
from actors.sampling_defaults import SamplingDefaultsSource

MAX_GIB = float(1 << 20)  # a store's size at most (1 PiB): past it, sizes overflowed an int in bytes
MAX_SCHEDULER_REPLICAS = 10_000  # (Serve refused 2**31 at deploy, past its checks)


class _Strict(BaseModel):
    """No unknown settings, and each value of its own type, as YAML or JSON writes
    it: pydantic's lax mode read `replicas: "2"` as 2, `num_gpus: true` as 1 and
    `enable_prefix_cache: "no"` as False. An integer where a float is expected is
    still one. No float is infinite (YAML's `.inf`: `response_store_mib: .inf` passed
    and then failed the pool manager's start, OverflowError)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def absolute_folder(name: str, folder: str | None) -> str | None:
    """A folder setting `~` expanded; else it must be absolute. `~/traces` made a
    folder named `~` in the worker's working directory, a relative path landed
    there too (a "shared" path then shared by nobody), and "" wrote into it."""
    if folder is None:
        return None
    expanded = os.path.expanduser(folder)
    if not os.path.isabs(expanded):
        raise ValueError(f"{name} must be an absolute path (or start with ~), got {folder!r}")
    return expanded


class ModelSource(_Strict):
    """A checkpoint folder, or a built-in preset built on first use (on each node)."""

    path: str | None = None
    preset: Literal["tiny", "bench", "qwen2.5-0.5b"] | None = None  # actors/model_builder.py's PRESETS
    # A preset's (actors/model_builder.py's ARCH_SPECS; qwen2 where left out); none for a folder
    arch: Literal["qwen2", "qwen3", "qwen3_moe", "llama", "mistral"] | None = None
    name: str | None = None  # the id /v1/models lists; default from the source

    @model_validator(mode="before")
    @classmethod
    def _a_presets_arch(cls, data):
        if isinstance(data, dict) and data.get("preset") is not None and data.get("arch") is None:
            return {**data, "arch": "qwen2"}
        return data

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.preset is None):
            raise ValueError("model needs exactly one of `path` or `preset`")
        if self.path is not None and self.arch is not None:  # (it was taken, and unread)
            raise ValueError("model.arch is a preset's: a checkpoint folder's config.json names its architecture")
        return self

    @field_validator("path")
    @classmethod
    def _home_expanded(cls, path: str | None) -> str | None:
        """`~` expanded: `~/models/x` was looked for as a folder named `~`."""
        return None if path is None else os.path.expanduser(path)

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return f"tandem-{self.preset}-{self.arch}" if self.preset else Path(self.path).name

    def location(self) -> ModelLocation:
        return ModelLocation(self.path, self.preset, self.arch or "qwen2")

    @property
    def context_tokens(self) -> int | None:
        """The checkpoint's context where the settings know it: a preset's; None for
        a folder's, which its config.json gives (`ModelConfig.from_hf`)."""
        return None if self.preset is None else PRESETS[self.preset].max_position_embeddings


class EngineSettings(_Strict):
    block_size: Literal[16, 32, 64] = 16
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_bytes: int = Field(256 * 2**20, ge=2**20)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    prefill_chunk_size: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Under Ray an actor sees the GPUs it asked for (num_gpus) from index 0: "cuda".
    device: Literal["cpu", "cuda", "cuda:0"] = "cpu"
    enable_prefix_cache: bool = True
    kernel_backend: Literal["auto", "torch"] = "auto"
    cuda_graphs: bool = True
    prefill_graphs: bool = False  # on CUDA: a prompt's chunk from position 0 replays a CUDA graph
    overlap_decode: bool | None = None  # None: on CUDA only
    decode_reserve_tokens: int = Field(512, ge=0)  # room a decode worker keeps for each request's next tokens
    jump_forward: bool = True  # structured output: fixed text appended without sampling (actors/engine.py)
    # Speculative decoding by prompt lookup on decode (and colocated) workers: draft
    # tokens a step, 0 off; the n-gram lengths matched (actors/prompt_lookup.py).
    num_speculative_tokens: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_min: int = Field(2, ge=1, le=MAX_PROMPT_LOOKUP)
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_PROMPT_LOOKUP)
    speculative_max_batch: int | None = Field(None, ge=1)  # no drafts while more requests than this run

    @model_validator(mode="after")
    def _engine_accepts(self):
        self.engine_config()  # its cross-field checks (speculation against overlap, n-gram bounds): a ValueError
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump())


class _Placement:
    """What Ray checks a pool's placement against (`PoolSettings._ray_takes_placement`)."""


class PoolSettings(_Strict):
    replicas: int = Field(1, ge=0)  # the initial size
    min_replicas: int | None = Field(None, ge=0)  # None: `replicas`
    max_replicas: int | None = Field(None, ge=0)  # None: `replicas`
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    label_selector: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _initial_within_bounds(self):
        if self.min_replicas is not None and self.max_replicas is not None and self.min_size > self.max_size:
            raise ValueError(f"min_replicas ({self.min_size}) is above max_replicas ({self.max_size})")
        if self.replicas > self.max_size:
            raise ValueError(f"replicas ({self.replicas}, the initial size) is above max_replicas ({self.max_size})")
        if self.replicas < self.min_size:
            raise ValueError(f"replicas ({self.replicas}, the initial size) is below min_replicas ({self.min_size})")
        return self

    @model_validator(mode="after")
    def _ray_takes_placement(self):
        """Ray's own checks of the actor options a worker starts with (cluster/workers.py):
        a label key with a space, or num_cpus finer than 0.0001, passed here and at
        `check-manifest`, then failed each start (the pool manager's every step)."""
        import ray

        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        try:
            ray.remote(_Placement).options(**options, **({"label_selector": self.label_selector}
                                                         if self.label_selector else {}))
        except ValueError as exc:
            raise ValueError(f"Ray refuses this pool's placement: {exc}") from None
        return self

    @property
    def min_size(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def max_size(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def autoscales(self) -> bool:
        return self.max_size > self.min_size


class SloSettings(_Strict):
    ttft_ms: float = Field(5000.0, gt=0)
    tbt_ms: float = Field(500.0, gt=0)
    # The share of requests to serve within the SLO: the autoscaler's target, and the
    # quantile of P's TTFT errors and D's TBT errors that admission adds to its predictions.
    attainment: float = Field(0.9, gt=0, le=1)
    early_rejection: bool = True


class AutoscalingSettings(_Strict):
    """The knobs of every pool's scaling policy (cluster/autoscaling.py) and of the
    pool manager's loop that runs it. Thresholds come in (up, down) pairs: between
    them the pool holds (hysteresis)."""

    interval_s: float = Field(2.0, gt=0)  # how often each pool's policy decides
    window_s: float = Field(30.0, gt=0)  # SLO attainment over the outcomes of the last window_s
    min_samples: int = Field(5, ge=1)  # fewer outcomes in the window: attainment unknown
    scale_down_margin: float = Field(0.05, ge=0, le=1)  # down only at attainment >= target + margin
    scale_up_cooldown_s: float = Field(10.0, ge=0)  # since the pool last had a worker starting or draining
    scale_down_cooldown_s: float = Field(60.0, ge=0)
    # A size whose SLO attainment fell short is not come back to for this long unless the load fell
    # (cluster/autoscaling.py `Shortfall`)
    shortfall_memory_s: float = Field(1800.0, ge=0)
    prefill_backlog_up_tokens: int = Field(4096, ge=1)  # queued prompt tokens per prefill worker
    prefill_backlog_down_tokens: int = Field(512, ge=1)  # (down below it: 0 turned scale-down off)
    kv_usage_up: float = Field(0.8, gt=0, le=1)  # fraction of the decode pool's KV blocks in use
    kv_usage_down: float = Field(0.3, gt=0, lt=1)
    drain_grace_s: float = Field(5.0, ge=0)  # a draining worker lives at least this long (schedulers catch up)
    drain_timeout_s: float = Field(600.0, gt=0)  # then it is killed even with requests in flight
    start_timeout_s: float = Field(600.0, gt=0)  # a new worker not ready by then is given up
    # A worker that failed to start is started again after restart_backoff_s, twice that after a
    # second failure in a row, ... up to restart_backoff_max_s (cluster/restart_backoff.py)
    restart_backoff_s: float = Field(2.0, gt=0)
    restart_backoff_max_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _down_below_up(self):
        if self.prefill_backlog_down_tokens >= self.prefill_backlog_up_tokens:
            raise ValueError("prefill_backlog_down_tokens must be below prefill_backlog_up_tokens")
        if self.kv_usage_down >= self.kv_usage_up:
            raise ValueError("kv_usage_down must be below kv_usage_up")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be at least restart_backoff_s")
        return self


class LimitSettings(_Strict):
    max_prompt_tokens: int = Field(4096, ge=1)
    max_new_tokens: int = Field(1024, ge=1)
    max_total_tokens: int | None = Field(None, ge=2)
    max_stop_sequences: int = Field(8, ge=0)
    max_body_bytes: int = Field(2 * 2**20, ge=1024)
    request_timeout_s: float = Field(300.0, gt=0)


class TimeoutSettings(_Strict):
    handshake_s: float = Field(10.0, gt=0)
    transfer_s: float = Field(30.0, gt=0)
    reservation_ttl_s: float = Field(60.0, gt=0)


class KVStoreSection(_Strict):
    """The tiers behind the workers' device pools (docs/kv-store.md). Paths must be
    the same on every node; the shared path is a mount every node sees."""

    # (bounded: `host_gib: 1.0e+300` passed, and the pool manager's start raised OverflowError)
    host_gib: float = Field(1.0, ge=0, le=MAX_GIB)
    disk_path: str | None = None
    disk_gib: float = Field(16.0, gt=0, le=MAX_GIB)
    shared_path: str | None = None
    shared_gib: float | None = Field(None, gt=0, le=MAX_GIB)  # None: unbounded by size, by ttl_s (one is needed)
    ttl_s: float | None = Field(None, gt=0)
    high_watermark: float = Field(0.9, gt=0, le=1)
    low_watermark: float = Field(0.7, gt=0, le=1)
    write_through_shared: bool = True

    @field_validator("disk_path", "shared_path")
    @classmethod
    def _absolute(cls, folder: str | None, info) -> str | None:
        return absolute_folder(f"kv_store.{info.field_name}", folder)

    @model_validator(mode="after")
    def _coherent(self):
        if self.low_watermark > self.high_watermark:
            raise ValueError("kv_store.low_watermark must not exceed kv_store.high_watermark")
        if not self.host_gib and self.disk_path is None and self.shared_path is None:
            raise ValueError("kv_store needs at least one tier: host_gib > 0, disk_path or shared_path")
        if (self.disk_path is not None and self.shared_path is not None
                and os.path.normpath(self.disk_path) == os.path.normpath(self.shared_path)):
            raise ValueError("kv_store.disk_path and kv_store.shared_path must be two folders (each tier counts "
                             "and evicts the files in its own; in one, each deleted the other's)")
        if self.shared_path is not None and self.shared_gib is None and self.ttl_s is None:
            raise ValueError("kv_store.shared_path needs a bound: shared_gib (per writer), ttl_s, or both "
                             "(without either its files grow for good)")
        return self

    def store_settings(self) -> KVStoreSettings:
        gib = lambda v: None if v is None else int(v * GIB)  # noqa: E731
        return KVStoreSettings(
            host_bytes=gib(self.host_gib), disk_path=self.disk_path, disk_bytes=gib(self.disk_gib),
            shared_path=self.shared_path, shared_bytes=gib(self.shared_gib), ttl_s=self.ttl_s,
            high_watermark=self.high_watermark, low_watermark=self.low_watermark,
            write_through_shared=self.write_through_shared,
        )


class AppSettings(_Strict):
    model: ModelSource
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    channel: Literal["gloo", "object_store", "nccl", "store"] = "gloo"
    routing: Literal["round_robin", "least_load", "cache_aware"] = "cache_aware"
    engine: EngineSettings = EngineSettings()
    prefill: PoolSettings = PoolSettings(label_selector={})
    decode: PoolSettings = PoolSettings(label_selector={})
    colocated: PoolSettings = PoolSettings(replicas=0)
    slo: SloSettings = SloSettings()
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    limits: LimitSettings = LimitSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    kv_store: KVStoreSection | None = None
    stream_interval: int = Field(1, ge=1)  # tokens a streamed event gathers (first and last at once)
    # What a request's omitted temperature/top_p/top_k/min_p/repetition_penalty take: the
    # checkpoint's generation_config.json (`model`) or OpenAI's (actors/sampling_defaults.py).
    sampling_defaults: SamplingDefaultsSource = "model"
    # `think`: a chat answer's <think> block comes back as `reasoning_content` (cluster/reasoning.py)
    reasoning_parser: Literal["think"] | None = None
    # How the served model writes tool calls under tool_choice "auto" (cluster/tool_calls.py TOOL_CALL_FORMATS)
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] = "hermes"
    scheduler_replicas: int = Field(1, ge=1, le=MAX_SCHEDULER_REPLICAS)  # the global scheduler's Serve replicas
    api_key: str | None = Field(None, min_length=1, pattern=r"\S")  # or TANDEM_API_KEY; "" is refused (not "off")
    # The Responses API's stored responses (previous_response_id) and conversations (/v1/conversations;
    # cluster/response_store.py): 0 stores none
    response_store_mib: float = Field(64, ge=0, le=MAX_GIB * 1024)
    pool_name: str = "tandem-pool"  # the detached pool manager's actor name
    profile_dir: str | None = None  # where /start_profile's traces go, on each worker's node (None: off)

    @field_validator("profile_dir")
    @classmethod
    def _an_absolute_folder(cls, folder: str | None) -> str | None:
        return absolute_folder("profile_dir", folder)  # (the endpoint answered a bad one as given)

    @field_validator("pool_name")
    @classmethod
    def _names_an_actor(cls, pool_name: str) -> str:
        if not pool_name.strip():
            raise ValueError(f"must name the pool manager's actor (replicas find the pools by it), got {pool_name!r}")
        return pool_name

    @model_validator(mode="after")
    def _pools_fit_mode(self):
        if self.mode == "disaggregated" and (self.prefill.min_size < 1 or self.decode.min_size < 1):
            raise ValueError("disaggregated mode needs prefill.replicas >= 1 and decode.replicas >= 1 "
                             "(and min_replicas >= 1)")
        if self.mode == "colocated" and self.colocated.replicas < 1:
            raise ValueError("colocated mode needs colocated.replicas >= 1")
        if self.channel == "store" and (self.kv_store is None or self.kv_store.shared_path is None):
            raise ValueError("channel: store moves KV through the shared path: set kv_store.shared_path")
        if self.colocated.autoscales:
            raise ValueError("colocated.min_replicas/max_replicas: only the prefill and decode pools autoscale")
        if self.engine.device.startswith("cuda"):
            pools = ("colocated",) if self.mode == "colocated" else ("prefill", "decode")
            gpuless = [name for name in pools if getattr(self, name).num_gpus <= 0]
            if gpuless:
                raise ValueError(f"engine.device {self.engine.device!r} needs num_gpus > 0 in the "
                                 f"{' and '.join(gpuless)} pool settings (Ray shows an actor only the GPUs it asks for)")
        elif self.channel == "nccl":
            raise ValueError("channel: nccl moves KV between GPUs: set engine.device: cuda (or use gloo on CPU)")
        # (the default limit, above a shorter max_model_len, gives way to it: a prompt is refused past either)
        if ("max_prompt_tokens" in self.limits.model_fields_set and self.engine.max_model_len is not None
                and self.limits.max_prompt_tokens + 1 > self.engine.max_model_len):
            raise ValueError(f"limits.max_prompt_tokens ({self.limits.max_prompt_tokens}) must leave room for one new "
                             f"token within engine.max_model_len ({self.engine.max_model_len})")
        return self

    @model_validator(mode="after")
    def _pool_holds_the_longest_prompt(self):
        problem = self.kv_pool_problem(self.model.context_tokens)
        if problem is not None:
            raise ValueError(problem)
        return self

    def kv_pool_problem(self, context_tokens: int | None) -> str | None:
        """Why a pool of `engine.num_kv_blocks` cannot serve the longest prompt the
        settings let through, with one new token, for a checkpoint of
        `context_tokens`; None where it can, where the workers size the pool
        (kv_cache_bytes), or where the context is not known (a checkpoint folder
        not read: `tandem check-manifest` reads one that is here).

        Exact: an engine refuses a request whose tokens (prompt plus max_new_tokens,
        at most its context) need more blocks than its pool has (`Engine.validate`);
        a decode worker reserves the prompt and the first token's slot
        (`blocks_to_reserve`), and the room it keeps for later tokens
        (decode_reserve_tokens) is at most a request's max_new_tokens: none for a
        request of one token, which an empty pool of that many blocks serves."""
        if self.engine.num_kv_blocks is None or context_tokens is None:
            return None
        bounds = {"limits.max_prompt_tokens": self.limits.max_prompt_tokens + 1,
                  "limits.max_total_tokens": self.limits.max_total_tokens,
                  "engine.max_model_len": self.engine.max_model_len,
                  "the model's context": context_tokens}
        bound, num_tokens = min(((name, n) for name, n in bounds.items() if n is not None), key=lambda b: b[1])
        num_blocks = -(-num_tokens // self.engine.block_size)
        if self.engine.num_kv_blocks >= num_blocks:
            return None
        return (f"engine.num_kv_blocks ({self.engine.num_kv_blocks}) cannot hold one request of the longest prompt "
                f"the settings let through: {num_tokens - 1} tokens ({bound}) and one new token need {num_blocks} "
                f"blocks of {self.engine.block_size} tokens")

    @property
    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("TANDEM_API_KEY") or None
