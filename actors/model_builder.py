"""Deterministic Hugging Face checkpoints for the built-in presets (`tiny`, `bench`).

Contract:
- `build_checkpoint(preset, arch, out_dir)` writes a complete HF model folder:
  config.json (through transformers' Qwen2Config / Qwen3Config / Qwen3MoeConfig /
  LlamaConfig),
  generation_config.json,
  the tokenizer files (actors.tokenizer_builder) and safetensors weights under HF
  parameter names, either one `model.safetensors` or, with `max_shard_bytes`,
  `model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`.
  `transformers.AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(out_dir)` load it.
- Same (preset, arch, dtype, max_shard_bytes) -> the same bytes in every file, on every
  run: each tensor is drawn in float32 on the CPU from its own `torch.Generator`,
  seeded with sha256("tandem/<preset>/<arch>/<parameter name>") (never Python's
  salted `hash()`), then cast to `dtype` at save time.
- Init, chosen so greedy decoding is decisive but not degenerate: linear weights
  N(0, 1/fan_in); the residual-branch outputs (o_proj, down_proj) times
  RESIDUAL_GAIN / sqrt(2 * num_layers), so the residual stream (rms 8-10) dwarfs the
  tied embedding (rms 3/sqrt(hidden)) and a token's own logit gets little boost
  (with gain 1, tiny qwen2 repeated its input token at 92% of positions); q/k/v
  biases N(0, 0.02^2); RMSNorm gains (qwen3's per-head q_norm and k_norm too)
  1 + N(0, 0.05^2); a mixture's router N(0, 1/hidden) and its experts as an MLP's
  linear layers; the output embedding
  (lm_head, or the tied embed_tokens) N(0, (3/sqrt(hidden))^2), so final logits
  have a standard deviation near 3; an untied input embedding N(0, 1).
  Measured with transformers in fp32 over eight prompts: logit std 3.04 / 3.00 and
  median top1-top2 margin 0.60 / 0.64 for tiny qwen2 / llama (bench: std 3.00 /
  2.99, margin 0.54 / 0.50); a token's own logit sits 0.32 / 0.15 std above the mean.
- `ensure_checkpoint(preset, arch)` builds once into a cache folder and returns it;
  concurrent callers (threads or processes) are safe: a file lock serialises
  builders, each build goes to a temp dir that is renamed into place, so a reader
  sees either no folder or a complete one. The folder's `tandem_build.json` names a
  fingerprint of this builder's code and corpus; a folder built by other code is
  rebuilt and swapped in (moved aside, then replaced, under the lock).
- Unknown preset, arch or dtype -> UnknownModel (a ValueError) naming the choices.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from actors import model_shapes, tokenizer_builder
from actors.model_shapes import ARCH_SPECS, BUILD_STAMP, MOE_DENSE_LAYERS, PRESETS, ArchSpec, Preset, UnknownModel
from actors.tokenizer_builder import IM_END, SPECIAL_TOKENS, build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_STD = 3.0
NORM_NOISE_STD = 0.05
BIAS_STD = 0.02
RESIDUAL_GAIN = 16.0


def _check(preset: str, arch: str, dtype: str = "float32") -> tuple[Preset, ArchSpec]:
    if preset not in PRESETS:
        raise UnknownModel(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCH_SPECS:
        raise UnknownModel(f"unknown arch {arch!r}; choose one of {list(ARCH_SPECS)}")
    if dtype not in DTYPES:
        raise UnknownModel(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    return PRESETS[preset], ARCH_SPECS[arch]


def _hf_config(p: Preset, spec: ArchSpec, arch: str, dtype: str, token_ids: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
        intermediate_size=p.intermediate_size, hidden_act="silu",
        max_position_embeddings=p.max_position_embeddings, rope_theta=p.rope_theta(arch),
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings,
        architectures=[spec.architecture], initializer_range=0.02, use_cache=True,
        dtype=dtype, **token_ids,
    )
    if arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, sliding_window=None,
                             max_window_layers=p.num_hidden_layers, **common)
    elif arch == "qwen3":
        config = Qwen3Config(use_sliding_window=False, sliding_window=None, attention_bias=False,
                             max_window_layers=p.num_hidden_layers, **common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(use_sliding_window=False, sliding_window=None, attention_bias=False,
                                max_window_layers=p.num_hidden_layers, num_experts=p.num_experts,
                                num_experts_per_tok=p.num_experts_per_tok,
                                moe_intermediate_size=p.moe_intermediate_size, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=list(MOE_DENSE_LAYERS), **common)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **common)
    else:
        config = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return config


def _write_config(config, out_dir: Path, *, rope_theta: float, dtype: str) -> None:
    """config.json as transformers writes it, plus the top-level `rope_theta` and
    `torch_dtype` (and a mixture's `num_experts`) that v5 no longer writes but older
    readers (transformers 4.x, engines that parse config.json themselves) look for."""
    config_dict = json.loads(config.to_json_string(use_diff=True))
    config_dict.setdefault("rope_theta", rope_theta)
    config_dict.setdefault("torch_dtype", dtype)
    if "num_local_experts" in config_dict:  # v5's name for the Hub's (and vLLM's) num_experts
        config_dict.setdefault("num_experts", config_dict["num_local_experts"])
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")


def _param_specs(p: Preset, spec: ArchSpec) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, std) for every tensor, in the fixed build order.
    kind: "normal" draws N(0, std^2); "norm" draws 1 + N(0, std^2)."""
    h, q_dim = p.hidden_size, p.num_attention_heads * p.head_dim
    kv_dim, inter = p.num_key_value_heads * p.head_dim, p.intermediate_size
    out_std = LOGIT_STD / math.sqrt(h)
    branch_scale = RESIDUAL_GAIN / math.sqrt(2 * p.num_hidden_layers)
    yield "model.embed_tokens.weight", (p.vocab_size, h), "normal", (
        out_std if spec.tie_word_embeddings else 1.0)
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", (h,), "norm", NORM_NOISE_STD
        for proj, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            yield pre + f"self_attn.{proj}.weight", (rows, h), "normal", 1 / math.sqrt(h)
            if spec.qkv_bias:
                yield pre + f"self_attn.{proj}.bias", (rows,), "normal", BIAS_STD
        if spec.qk_norm:
            yield pre + "self_attn.q_norm.weight", (p.head_dim,), "norm", NORM_NOISE_STD
            yield pre + "self_attn.k_norm.weight", (p.head_dim,), "norm", NORM_NOISE_STD
        yield pre + "self_attn.o_proj.weight", (h, q_dim), "normal", branch_scale / math.sqrt(q_dim)
        yield pre + "post_attention_layernorm.weight", (h,), "norm", NORM_NOISE_STD
        if spec.moe and i not in MOE_DENSE_LAYERS:
            size = p.moe_intermediate_size
            yield pre + "mlp.gate.weight", (p.num_experts, h), "normal", 1 / math.sqrt(h)
            for e in range(p.num_experts):
                yield pre + f"mlp.experts.{e}.gate_proj.weight", (size, h), "normal", 1 / math.sqrt(h)
                yield pre + f"mlp.experts.{e}.up_proj.weight", (size, h), "normal", 1 / math.sqrt(h)
                yield pre + f"mlp.experts.{e}.down_proj.weight", (h, size), "normal", branch_scale / math.sqrt(size)
            continue
        yield pre + "mlp.gate_proj.weight", (inter, h), "normal", 1 / math.sqrt(h)
        yield pre + "mlp.up_proj.weight", (inter, h), "normal", 1 / math.sqrt(h)
        yield pre + "mlp.down_proj.weight", (h, inter), "normal", branch_scale / math.sqrt(inter)
    yield "model.norm.weight", (h,), "norm", NORM_NOISE_STD
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (p.vocab_size, h), "normal", out_std


def num_parameters(preset: str, arch: str) -> int:
    """Parameter count of a preset/arch (tied embeddings counted once)."""
    p, spec = _check(preset, arch)
    return sum(math.prod(shape) for _, shape, _, _ in _param_specs(p, spec))


def _draw(seed_text: str, shape: tuple[int, ...], kind: str, std: float) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(seed_text.encode()).digest()[:8], "big") >> 1
    gen = torch.Generator(device="cpu").manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    return values + 1.0 if kind == "norm" else values


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors writes its files private (mode 0600), the config beside them is
    0644: the cache may be shared (`ensure_checkpoint`), and another user's worker
    could read the config and not the weights."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def _save_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        _save_file(tensors, out_dir / "model.safetensors")
        return
    shards = _shards(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, out_dir / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_checkpoint(preset: str, arch: str, out_dir: Path, *, progress: bool = False,
                     dtype: str = "float32", max_shard_bytes: int | None = None) -> Path:
    """Write the checkpoint folder `out_dir` (created if missing) and return it."""
    from transformers import GenerationConfig

    p, spec = _check(preset, arch, dtype)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A stamp naming no builder first: a build cut short (Ctrl-C, a full disk) leaves a folder
    # `tandem make-model` knows as its own, to build again, and no reader takes as current.
    (out_dir / BUILD_STAMP).write_text(json.dumps({"building": f"{preset}/{arch}"}) + "\n")

    token_ids = build_tokenizer(out_dir, p.tokenizer_vocab_size or p.vocab_size, nfc=spec.nfc, bos_token=spec.bos_token,
                                max_length=p.max_position_embeddings)
    _write_config(_hf_config(p, spec, arch, dtype, token_ids), out_dir,
                  rope_theta=p.rope_theta(arch), dtype=dtype)
    # Generation stops at <|endoftext|> and at the chat turn end <|im_end|>.
    GenerationConfig(
        bos_token_id=token_ids["bos_token_id"],
        eos_token_id=[token_ids["eos_token_id"], SPECIAL_TOKENS.index(IM_END)],
        pad_token_id=token_ids["pad_token_id"], do_sample=False, max_new_tokens=256,
    ).save_pretrained(out_dir)

    for stale in [*out_dir.glob("model*.safetensors"), *out_dir.glob("model.safetensors.index.json")]:
        stale.unlink()  # a previous build's weights in another layout would confuse loaders
    specs = list(_param_specs(p, spec))
    if progress:
        from tqdm import tqdm
        specs = tqdm(specs, desc=f"building {preset}/{arch}", unit="tensor")
    tensors = {
        name: _draw(f"tandem/{preset}/{arch}/{name}", shape, kind, std).to(DTYPES[dtype])
        for name, shape, kind, std in specs
    }
    _save_weights(tensors, out_dir, max_shard_bytes)
    (out_dir / BUILD_STAMP).write_text(json.dumps(
        {"preset": preset, "arch": arch, "dtype": dtype, "builder": builder_fingerprint(),
         "num_parameters": num_parameters(preset, arch)}, indent=2, sort_keys=True) + "\n")
    return out_dir


def builder_fingerprint() -> str:
    """sha256 of the code and text that determine a checkpoint's bytes; a cached
    build whose stamp names another fingerprint is stale."""
    digest = hashlib.sha256()
    for path in (Path(__file__), Path(model_shapes.__file__), Path(tokenizer_builder.__file__),
                 tokenizer_builder.CORPUS_PATH):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _is_current(folder: Path, preset: str, arch: str) -> bool:
    try:
        stamp = json.loads((folder / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("builder") == builder_fingerprint() and (
        stamp.get("preset"), stamp.get("arch"), stamp.get("dtype")) == (preset, arch, "float32")


def default_cache_root() -> Path:
    env = os.environ.get("TANDEM_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tandem" / "models"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def built_checkpoint(preset: str, arch: str = "qwen2", root: Path | None = None) -> Path | None:
    """`ensure_checkpoint`'s folder where it is built, by this builder's code, else
    None: this call builds nothing."""
    _check(preset, arch)
    final = _folder(preset, arch, root)
    return final if _is_current(final, preset, arch) else None


def _folder(preset: str, arch: str, root: Path | None) -> Path:
    return (Path(root) if root is not None else default_cache_root()) / f"{preset}-{arch}"


def ensure_checkpoint(preset: str, arch: str = "qwen2", root: Path | None = None) -> Path:
    """Return `<root>/<preset>-<arch>`, building it first if it does not exist yet.

    root defaults to $TANDEM_MODEL_CACHE, else ~/.cache/tandem/models. Safe under
    concurrent calls from several processes (see the module docstring)."""
    built = built_checkpoint(preset, arch, root)
    if built is not None:
        return built
    final = _folder(preset, arch, root)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{preset}-{arch}.lock"):
        if _is_current(final, preset, arch):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-{arch}.", dir=root))
        stale = tmp.with_name(tmp.name + ".stale")
        try:
            build_checkpoint(preset, arch, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            if final.exists():  # built by older code: move it aside, then swap in
                os.rename(final, stale)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
    return final
