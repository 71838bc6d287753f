"""Load Hugging Face safetensors weights by parameter name into a `ForCausalLM`.

Handles one `model.safetensors` or a sharded checkpoint (`model.safetensors.index.json`
naming its shard files), casts to the engine dtype, and fills the fused projections
from their HF parts: `q_proj|k_proj|v_proj` into `qkv_proj`, `gate_proj|up_proj` into
`gate_up_proj`, and a mixture's experts as the Hub stores them
(`mlp.experts.<e>.gate_proj|up_proj|down_proj`) into the 3D expert tensors
(transformers v5's own layout, `mlp.experts.gate_up_proj`, loads by name). Every
parameter must be filled exactly once, from floating-point weights each given
once, or loading fails with a `CheckpointError` naming what is wrong.
`check_weights` makes the same checks from the files' headers alone (offline,
`tandem check-manifest --local`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from actors.config import CheckpointError
from actors.model import ForCausalLM

_FUSED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # (ValueError: not UTF-8, JSON)
            raise CheckpointError(f"{index}: unreadable index ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map each weight's name to its file's")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: shard {path.name} named in the index is missing")
    return files


def _expert_slice(model: ForCausalLM, name: str) -> tuple[str, int, int, int] | None:
    """For an expert's HF weight: (param name, expert, row start, rows)."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, part = match.groups()
    size = model.config.moe_intermediate_size
    target, start, rows = {"gate_proj": ("gate_up_proj", 0, size), "up_proj": ("gate_up_proj", size, size),
                           "down_proj": ("down_proj", 0, model.config.hidden_size)}[part]
    return f"{prefix}.{target}", int(expert), start, rows


def _fused_slice(model: ForCausalLM, name: str) -> tuple[str, int, int] | None:
    """For an HF name that lives inside a fused parameter: (param name, row start, rows)."""
    match = _FUSED.match(name)
    if match is None:
        return None
    prefix, part, kind = match.groups()
    config = model.config
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    layout = {
        "q_proj": ("self_attn.qkv_proj", 0, q),
        "k_proj": ("self_attn.qkv_proj", q, kv),
        "v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "gate_proj": ("mlp.gate_up_proj", 0, inter),
        "up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    fused, start, rows = layout[part]
    owner = prefix.rsplit(".", 1)[0]  # strip "self_attn" / "mlp"
    return f"{owner}.{fused}.{kind}", start, rows


class _Header(NamedTuple):
    """A tensor as its file's header gives it (`check_weights`: nothing is read)."""

    shape: tuple[int, ...]
    floating: bool


def check_weights(model_dir: Path, config) -> None:
    """What `load_weights` would refuse (a weight missing, of the wrong shape or
    type, unexpected, or given twice), from the files' headers alone, against a
    model of `config` built on the meta device: the offline check a worker's
    start would otherwise be the first to make (`tandem check-manifest --local`)."""
    with torch.device("meta"):
        model = ForCausalLM(config)
    _fill(model, Path(model_dir), None, read=lambda reader, name: _header(reader.get_slice(name)))


def _header(tensor_slice) -> _Header:
    """A safetensors slice's shape and whether its dtype (F32, BF16, F8_E4M3, I32, BOOL...) is floating point."""
    return _Header(tuple(tensor_slice.get_shape()), tensor_slice.get_dtype().startswith(("F", "BF")))


def load_weights(model: ForCausalLM, model_dir: Path, dtype: torch.dtype) -> None:
    _fill(model, model_dir, dtype, read=lambda reader, name: reader.get_tensor(name))


def _fill(model: ForCausalLM, model_dir: Path, dtype: torch.dtype | None, read) -> None:
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}  # elements filled per parameter
    seen: dict[str, str] = {}  # each checkpoint weight's file: one that comes twice is refused
    tied_head = None  # a tied model's lm_head.weight, where the checkpoint has one: it must be the embedding
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as reader:
                for name in reader.keys():
                    if name == "lm_head.weight" and model.lm_head is None:
                        tied_head = read(reader, name)  # tied: the embedding serves as the head (checked below)
                        continue
                    if "rotary_emb" in name:
                        continue
                    if name in seen:  # (counted twice, one could stand in for another, missing)
                        raise CheckpointError(f"{model_dir}: weight {name!r} is in both {seen[name]} and {path.name}")
                    seen[name] = path.name
                    _copy(model, params, filled, name, read(reader, name), dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors ({exc})") from None
    missing = [name for name, count in filled.items() if count != params[name].numel()]
    if missing:
        raise CheckpointError(f"{model_dir}: weights missing or incomplete: {missing[:5]}")
    embedding = params["model.embed_tokens.weight"].data
    if isinstance(tied_head, torch.Tensor) and not torch.equal(tied_head.to(embedding.device, embedding.dtype),
                                                               embedding):
        # (transformers 5 serves such a checkpoint untied, 4 tied: it was served tied, its head dropped)
        raise CheckpointError(f"{model_dir}: tie_word_embeddings is true, but lm_head.weight differs from "
                              "model.embed_tokens.weight: set tie_word_embeddings to what the weights are")


def _copy(model, params, filled, name: str, tensor: torch.Tensor | _Header, dtype: torch.dtype | None) -> None:
    """Fill `name`'s part of its parameter from `tensor` (a `_Header`: check only)."""
    expert = _expert_slice(model, name)
    if expert is not None:
        target_name, index, start, rows = expert
    else:
        fused = _fused_slice(model, name)
        (target_name, start, rows), index = (fused if fused else (name, 0, None)), None
    if target_name not in params:
        raise CheckpointError(f"unexpected weight {name!r} in checkpoint")
    param = params[target_name]
    if index is not None and not index < param.shape[0]:
        raise CheckpointError(f"unexpected weight {name!r} in checkpoint (the model has {param.shape[0]} experts)")
    data = param.data if index is None else param.data[index]
    target = data if rows is None else data[start : start + rows]
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    if isinstance(tensor, _Header):
        floating, kind = tensor.floating, "an integer or boolean type"
    else:
        floating, kind = tensor.dtype.is_floating_point, str(tensor.dtype)
    if not floating:  # (an integer one would be cast to numbers it never meant)
        raise CheckpointError(f"weight {name!r} is {kind}, not floating point: quantized checkpoints "
                              "are not supported")
    if not isinstance(tensor, _Header):
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
    filled[target_name] += target.numel()
