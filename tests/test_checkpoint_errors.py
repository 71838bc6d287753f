"""A checkpoint folder that cannot serve is refused with a CheckpointError naming
the file and what is wrong (what `tandem demo`, `check-manifest --local` and a
worker's start report), never a traceback nor a wrong model. Each case was
found by a review: a traceback, or (integer weights, a repeated weight) a model
that loaded and answered garbage."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.config import CheckpointError, EngineConfig, ModelConfig
from actors.engine import Engine
from actors.model import ForCausalLM
from actors.sampling_params import SamplingParams
from actors.weights import load_weights
from cluster.cli import main


@pytest.fixture()
def copy(tmp_path, tiny_qwen2_dir):
    """A fresh copy of the tiny checkpoint, to damage."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, folder)
    return folder


def _edit_config(folder, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "unsupported rope_scaling type 'yarn'"),  # (Qwen2.5's long-context setting: a traceback at the model's build)
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling .*missing or bad 'factor'"),
    ({"architectures": 5}, "architectures must be a list of names"),
    ({"architectures": [["Qwen2ForCausalLM"]]}, "architectures must be a list of names"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"num_attention_heads": 0, "head_dim": None}, "invalid config field .*ZeroDivisionError"),
    ({"vocab_size": -5}, "vocab_size must be at least 1"),
    # Found by a review: served as something else than transformers computes
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
     "rope_theta 1000000.0 and rope_parameters.rope_theta 100.0 differ"),
])
def test_a_config_the_model_cannot_be_built_from_is_refused(copy, fields, message):
    _edit_config(copy, **fields)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(copy)


def test_config_fields_that_change_the_math_are_read_as_transformers_reads_them(copy):
    """Found by a review, each served wrong: Qwen2's sliding window was ignored
    (every layer attended to the whole context past it), a Qwen2 config without
    tie_word_embeddings was read as tied (its lm_head dropped: garbage), and
    Qwen3-MoE's norm_topk_prob defaulted the other way."""
    _edit_config(copy, use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None)
    assert ModelConfig.from_hf(copy).max_position_embeddings == 16  # (held to the window: exact within it)
    _edit_config(copy, max_window_layers=100)  # (no layer from 100 on: none slides)
    assert ModelConfig.from_hf(copy).max_position_embeddings > 16
    _edit_config(copy, layer_types=["sliding_attention", "full_attention"])  # (named: it wins)
    assert ModelConfig.from_hf(copy).max_position_embeddings == 16
    config = json.loads((copy / "config.json").read_text())
    del config["tie_word_embeddings"]
    (copy / "config.json").write_text(json.dumps(config))
    assert not ModelConfig.from_hf(copy).tie_word_embeddings


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                                           r"num_key_value_heads \(3\)"),
    ({"head_dim": 7}, "head_dim must be even"),
    ({"mlp_bias": True}, "mlp_bias is not supported"),
])
def test_a_config_that_failed_only_at_the_first_step_or_its_weights_is_refused(copy, fields, message):
    """Found by a review: accepted, then a worker crashed at its first step (heads
    that do not group) or at its weights (an MLP's biases), with no word why."""
    _edit_config(copy, **fields)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(copy)


def test_llamas_attention_bias_biases_the_output_projection_too(tmp_path):
    """transformers' `attention_bias` puts a bias on o_proj as on q, k and v:
    such a Llama (or Qwen3) failed at its weights ("unexpected weight
    ...o_proj.bias"). Served, it answers as transformers does."""
    from actors.model_builder import ensure_checkpoint
    from tests.conftest import hf_greedy

    folder = tmp_path / "biased"
    shutil.copytree(ensure_checkpoint("tiny", "llama"), folder)
    _edit_config(folder, attention_bias=True)
    config = json.loads((folder / "config.json").read_text())
    shard = next(folder.glob("*.safetensors"))
    weights = load_file(shard)
    gen = torch.Generator().manual_seed(0)
    for layer in range(config["num_hidden_layers"]):
        for name, size in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"]),
                           ("v_proj", config["num_key_value_heads"]), ("o_proj", None)):
            rows = config["hidden_size"] if size is None else size * config.get("head_dim", config["hidden_size"]
                                                                                 // config["num_attention_heads"])
            weights[f"model.layers.{layer}.self_attn.{name}.bias"] = torch.randn(rows, generator=gen) * 0.5
    save_file(weights, shard, metadata={"format": "pt"})
    assert ModelConfig.from_hf(folder).o_bias
    engine = Engine(folder, EngineConfig(block_size=16, num_kv_blocks=64))
    prompt = list(range(5, 30))
    engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), "r")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.token_ids == hf_greedy(folder, prompt, 8)


def test_a_broken_generation_config_is_named_as_itself(copy):
    """Its errors were wrapped as config.json's 'invalid eos_token_id'."""
    (copy / "generation_config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=r"generation_config.json: unreadable generation config \('utf-8'"):
        ModelConfig.from_hf(copy)
    (copy / "generation_config.json").write_text("[" * 100000)
    with pytest.raises(CheckpointError, match="generation_config.json: unreadable generation config"):
        ModelConfig.from_hf(copy)


def test_integer_weights_and_a_weight_given_twice_are_refused(copy):
    tensors = load_file(copy / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    save_file({**tensors, name: tensors[name].to(torch.int32)}, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"weight '{name}' is torch.int32, not floating point"):
        Engine(copy)
    save_file(tensors, copy / "model.safetensors")
    save_file({name: tensors[name]}, copy / "model-extra.safetensors")
    with pytest.raises(CheckpointError, match=f"weight '{name}' is in both"):
        Engine(copy)


@pytest.mark.parametrize("index", [{"weight_map": []}, {"weight_map": {"a": 5}}, [1], "[" * 100000])
def test_a_malformed_index_is_refused(copy, index):
    (copy / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: (unreadable index|weight_map must)"):
        Engine(copy)


def test_a_tied_checkpoint_whose_lm_head_differs_from_its_embedding_is_refused(copy):
    """Served tied, its lm_head was dropped: transformers 5 serves it untied
    (garbage against it, found by a review). One equal to the embedding loads."""
    tensors = load_file(copy / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    config = ModelConfig.from_hf(copy)
    assert config.tie_word_embeddings
    save_file({**tensors, "lm_head.weight": embedding.clone()}, copy / "model.safetensors")
    load_weights(ForCausalLM(config), copy, torch.float32)
    save_file({**tensors, "lm_head.weight": embedding.flip(0).contiguous()}, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true, but lm_head.weight differs"):
        load_weights(ForCausalLM(config), copy, torch.float32)


def test_make_model_does_not_write_over_another_checkpoint(tmp_path, capsys):
    """It replaced the folder's config and tokenizer and deleted its weights."""
    theirs = tmp_path / "my-llama"
    theirs.mkdir()
    (theirs / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    assert main(["make-model", "--preset", "tiny", "--out", str(theirs)]) == 2
    assert "holds files, and no checkpoint this command wrote" in capsys.readouterr().err
    assert (theirs / "model-00001-of-00002.safetensors").read_bytes() == b"weights"


def test_make_model_cut_short_can_be_run_again(tmp_path, capsys, monkeypatch):
    """A build interrupted (Ctrl-C, a full disk) left its config and tokenizer and
    no stamp: the same command again was refused as another checkpoint's folder,
    and the folder had to be removed by hand. Nor is a cut build current."""
    from actors import model_builder

    out = tmp_path / "m"
    save = model_builder._save_weights

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_builder, "_save_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["make-model", "--preset", "tiny", "--out", str(out)])
    assert (out / "config.json").exists() and not model_builder._is_current(out, "tiny", "qwen2")
    monkeypatch.setattr(model_builder, "_save_weights", save)
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    assert model_builder._is_current(out, "tiny", "qwen2") and "wrote tiny/qwen2 checkpoint" in capsys.readouterr().out


def test_demo_with_an_empty_model_is_refused(capsys):
    """`--model "$UNSET"` ran the built-in model instead."""
    assert main(["demo", "--model", "", "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert "--model is empty" in capsys.readouterr().err
