"""Engine-side configuration: frozen dataclasses, built once at start-up.

`ModelConfig.from_hf` is the one place that absorbs Hugging Face config quirks
(field names that differ by family, optional fields, rope_scaling spellings, end
tokens split between config.json and generation_config.json).
Values measured at run time (the number of KV blocks) live on runtime objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.checkpoint_error import CheckpointError
from kernels import check_kernel_backend

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                           "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen2" | "qwen3" | "qwen3_moe" | "llama" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    # Every id that ends a turn: config.json's eos_token_id, then any more that
    # generation_config.json lists (`_eos_ids`).
    eos_token_ids: tuple[int, ...]
    # An RMSNorm over each query and key head before RoPE (Qwen3's q_norm, k_norm).
    qk_norm: bool = False
    # A bias on the attention's output projection: Llama's and Qwen3's `attention_bias`
    # (which biases q, k, v and o alike; Qwen2's q, k, v biases come without one).
    o_bias: bool = False
    # A mixture of experts (Qwen3-MoE): a sparse layer's MLP is `num_experts` experts
    # of `moe_intermediate_size`, each token through the `num_experts_per_tok` the
    # router scores best (their weights renormalised to sum 1 with `norm_topk_prob`);
    # the layers in `dense_layers` keep one MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (is this a checkpoint folder?)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # (ValueError: not UTF-8, not JSON)
            raise CheckpointError(f"{path}: unreadable config ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise CheckpointError(f"{path}: architectures must be a list of names, got {json.dumps(archs)[:80]}")
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise CheckpointError(
                f"{path}: architectures {archs} not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope_params = raw.get("rope_parameters") or {}
            if not isinstance(rope_params, dict):
                raise ValueError(f"rope_parameters must be an object, got {json.dumps(rope_params)[:80]}")
            scaling = raw.get("rope_scaling") or (
                rope_params if rope_params.get("rope_type", "default") != "default" else None
            )
            if "rope_theta" in raw and "rope_theta" in rope_params and raw["rope_theta"] != rope_params["rope_theta"]:
                # (transformers v5 takes rope_parameters', v4 the top level's: served one way, it is wrong the other)
                raise ValueError(f"rope_theta {raw['rope_theta']} and rope_parameters.rope_theta "
                                 f"{rope_params['rope_theta']} differ")
            theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            activation = raw.get("hidden_act", "silu")
            if activation not in ("silu", "swish"):  # (the MLP is SwiGLU; another was served as SiLU)
                raise ValueError(f"hidden_act {activation!r} is not supported (silu only)")
            if raw.get("mlp_bias"):  # (it failed at the weights, "unexpected weight ...down_proj.bias")
                raise ValueError("mlp_bias is not supported (an MLP without biases only)")
            config = cls(
                architecture=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=_context_len(raw),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=dict(scaling) if scaling else None,
                # (left out: untied, as transformers reads it; Qwen2's was taken as tied and its lm_head dropped)
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always carries q/k/v biases; Llama and Qwen3 only with attention_bias.
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
                eos_token_ids=_eos_ids(raw, Path(model_dir)),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                **(_experts(raw) if family == "qwen3_moe" else {}),
            )
        except CheckpointError:  # (generation_config.json's, which says where)
            raise
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise CheckpointError(f"{path}: invalid config field ({exc!r})") from None
        config._check(path)
        return config

    def _check(self, path: Path) -> None:
        """What a model of this config could not be built or run from, as a
        CheckpointError here, not a traceback from the model's build (which the
        manifest check does not reach): sizes below one, and a RoPE scaling the
        kernels do not have (YaRN, dynamic: Qwen2.5's long-context setting)."""
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                 "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
                 "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "max_position_embeddings": self.max_position_embeddings}
        for name, value in sizes.items():
            if value < 1:
                raise CheckpointError(f"{path}: {name} must be at least 1, got {value}")
        if self.num_heads % self.num_kv_heads:  # (accepted, it failed at the first step: a worker's crash)
            raise CheckpointError(f"{path}: num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"{path}: head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        from kernels.rope import rope_inv_freq

        try:
            rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: rope_scaling {json.dumps(self.rope_scaling)[:120]}: "
                                  f"{exc if isinstance(exc, ValueError) else f'missing or bad {exc}'}") from None


def _context_len(raw: dict) -> int:
    """The context Tandem serves: `max_position_embeddings`, or the checkpoint's
    `sliding_window` where some layer slides and that is shorter. Within the
    window, sliding-window attention is full attention, so a context held to it
    is exact (vLLM did the same before it had window kernels). Mistral's layers
    all slide (Mistral 7B v0.2 on leave the window null); Qwen2's and Qwen3's
    with `use_sliding_window`, those its `layer_types` name, else those from
    `max_window_layers` on (transformers' rule): their windows were ignored, and
    past them every layer attended to the whole context."""
    positions = int(raw["max_position_embeddings"])
    window = raw.get("sliding_window")
    if "MistralForCausalLM" in (raw.get("architectures") or []):
        slides = True
    elif raw.get("use_sliding_window"):
        layer_types = raw.get("layer_types")
        slides = ("sliding_attention" in layer_types if isinstance(layer_types, list)
                  else int(raw["num_hidden_layers"]) > int(raw.get("max_window_layers", 28)))
    else:
        slides = False
    return min(positions, int(window)) if slides and window else positions


def _experts(raw: dict) -> dict:
    """Qwen3-MoE's expert fields; a layer is sparse unless `mlp_only_layers` names
    it or it falls between `decoder_sparse_step`s (HF's rule)."""
    step = int(raw.get("decoder_sparse_step", 1))
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    layers = int(raw["num_hidden_layers"])
    experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]  # (transformers v5's name)
    return dict(num_experts=int(experts), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # (transformers' default)
                dense_layers=tuple(i for i in range(layers) if i in dense_only or (i + 1) % step))


def _ids(value) -> tuple[int, ...]:
    """An `eos_token_id` field: one id, a list of them, or null."""
    if value is None:
        return ()
    return tuple(int(i) for i in value) if isinstance(value, list) else (int(value),)


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    """config.json's end tokens, then generation_config.json's others. Instruct
    checkpoints often declare their end of turn only in the latter (Llama 3
    Instruct: `<|end_of_text|>` in config.json, `<|eot_id|>` as well in
    generation_config.json; the built-in presets, like Qwen2.5 Instruct:
    `<|endoftext|>`, then `<|im_end|>`): reading config.json alone, a chat answer
    would run past its end to max_tokens. transformers' `generate`, vLLM and SGLang
    all stop at the union."""
    ids = _ids(raw.get("eos_token_id"))
    generation = read_generation_config(model_dir)  # (its own errors say what is wrong with it)
    try:
        more = _ids(generation.get("eos_token_id"))
    except (TypeError, ValueError) as exc:
        path = model_dir / GENERATION_CONFIG
        raise CheckpointError(f"{path}: invalid eos_token_id ({exc!r})") from None
    return ids + tuple(dict.fromkeys(i for i in more if i not in ids))


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(model_dir: str | Path) -> dict:
    """A checkpoint's generation_config.json as a dict ({} where there is none):
    its end tokens (`_eos_ids`) and its authors' sampling defaults
    (actors/sampling_defaults.py)."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # (ValueError: not UTF-8, not JSON)
        raise CheckpointError(f"{path}: unreadable generation config ({exc})") from None
    if not isinstance(generation, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return generation


MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 16


@dataclass(frozen=True)
class EngineConfig:
    """How one engine schedules and stores KV. Validated at construction."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings (at least 2)
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_cache: bool = True
    kernel_backend: str = "auto"  # auto: C++ (CPU) / Triton (CUDA) kernels where they apply; torch: the references
    cuda_graphs: bool = True  # on CUDA, decode steps of up to min(max_num_seqs, 256) sequences replay CUDA graphs
    # On CUDA, a step that is one prompt's chunk from position 0 replays a CUDA graph
    # (actors/prefill_graphs.py); off until measured on a GPU.
    prefill_graphs: bool = False
    # Launch the next decode step before reading this one's tokens (actors/engine.py).
    # None: on CUDA only, where the host then works while the device computes.
    overlap_decode: bool | None = None
    # Where the seeds of requests that give none come from: an engine draws them from
    # random.Random(seed), so engines with one config draw the same sequence (every
    # worker of a pool, every restart). Reproducible offline, as vLLM's engine seed;
    # a server's global scheduler draws its requests' seeds itself (cluster/service.py).
    seed: int = 0
    # A decode worker grants a reservation only while its pool keeps room for the
    # next this many tokens (at most max_new_tokens) of each request it holds and of
    # the new one (actors/decode_room.py; SGLang reserves 512 too); 0: room for the
    # prompt and its first token alone, running requests then outgrow the pool and
    # are preempted.
    decode_reserve_tokens: int = 512
    # Structured output: the text a request's pattern fixes next is appended without
    # a step sampling it (actors/output_writer.py `_jump_forward`).
    jump_forward: bool = True
    # Speculative decoding by prompt lookup (actors/prompt_lookup.py): after each
    # sampled token, up to this many draft tokens, those that followed the latest
    # earlier occurrence of the context's last `prompt_lookup_max` down to
    # `prompt_lookup_min` tokens, verified in the next step; 0: off. The samples
    # are the same as without it (each position draws its own token's draw), held
    # to a pattern too (its drafts cut where they would leave it). Overlapped decode
    # then stays off.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts while more requests than this run (None: any number). Below it each
    # step verifies only the drafts that pay for their rows on the measured step
    # costs (actors/speculation.py `Drafter.trim`); this is the hard stop.
    speculative_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:  # (0 was the model's whole context)
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and one to generate), or None for the "
                             f"model's, got {self.max_model_len}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_PROMPT_LOOKUP}, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1 (or None), got {self.speculative_max_batch}")
        if self.num_speculative_tokens and self.overlap_decode:
            raise ValueError("overlap_decode and num_speculative_tokens exclude each other: a step launched ahead "
                             "cannot carry drafts of tokens not read yet")
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be >= 0, got {self.decode_reserve_tokens}")
        check_kernel_backend(self.kernel_backend)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def overlaps_decode(self) -> bool:
        if self.overlap_decode is None:
            return torch.device(self.device).type == "cuda" and not self.num_speculative_tokens
        return self.overlap_decode


@dataclass(frozen=True)
class ModelLocation:
    """Where a worker finds its checkpoint: a folder, or a built-in preset that is
    built on first use on the worker's own node (so no files need copying)."""

    path: str | None = None
    preset: str | None = None
    arch: str = "qwen2"

    def resolve(self) -> Path:
        if self.path is not None:
            if not Path(self.path).is_dir():
                raise CheckpointError(
                    f"model folder {self.path} not found: model.path must name a checkpoint folder that exists "
                    f"on every node that runs a worker or a scheduler replica")
            return Path(self.path)
        from actors.model_builder import ensure_checkpoint

        return Path(ensure_checkpoint(self.preset, self.arch))

    def present(self) -> Path | None:
        """The checkpoint's folder where this node has it now (a preset built
        here before), else None; unlike `resolve`, this builds nothing."""
        if self.path is not None:
            return Path(self.path) if Path(self.path).is_dir() else None
        from actors.model_builder import built_checkpoint

        return built_checkpoint(self.preset, self.arch)
