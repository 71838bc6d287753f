"""The deterministic checkpoint builder: HF loads what it writes, bytes are stable,
the tokenizer covers every id, sharding is lossless, and the CLI reports mistakes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from actors.model_builder import ARCH_SPECS, PRESETS, build_checkpoint, ensure_checkpoint, num_parameters
from cluster import hermes_calls

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "Hello, world! The tiny model has 2 layers.",
    "café naïve über Müller Ærø Łódź — “quotes” ½ π≈3.14159",
    "中文字符 日本語の文章 русский текст Ελληνικά",
    "emoji 🙂🚀🌧️ and a family 👨‍👩‍👧 joined by zero-width joiners",
    "  leading spaces,\ttabs,\r\nCRLF and trailing spaces   ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_checkpoint("tiny", arch, root / arch) for arch in ARCH_SPECS}


def _hashes(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def _logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("arch", list(ARCH_SPECS))
def test_tiny_loads_and_generates_in_transformers(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())

    assert config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                        "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
                                        "mistral": "MistralForCausalLM"}[arch]]
    assert config["tie_word_embeddings"] is (arch in ("qwen2", "qwen3"))
    assert ("q_norm" in str(model)) is arch.startswith("qwen3")
    assert ("SparseMoeBlock" in str(model)) is (arch == "qwen3_moe")
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 32
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == num_parameters("tiny", arch)
    assert 0.5e6 < num_params < 1.5e6

    input_ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    new_ids = out[0, input_ids.shape[1]:].tolist()
    assert len(new_ids) == 8 and all(0 <= i < config["vocab_size"] for i in new_ids)
    assert len(set(new_ids)) > 1, f"degenerate greedy output {new_ids}"

    logits = model(input_ids).logits[0]
    assert 2.0 < logits.std(dim=-1).mean().item() < 4.5  # decisive, not saturated


def test_build_is_byte_for_byte_deterministic(tmp_path, tiny_dirs):
    again = build_checkpoint("tiny", "qwen2", tmp_path / "again")
    assert _hashes(again) == _hashes(tiny_dirs["qwen2"])
    other_arch = _hashes(tiny_dirs["llama"])["model.safetensors"]
    assert other_arch != _hashes(again)["model.safetensors"]


def test_determinism_across_processes(tmp_path, tiny_dirs):
    code = ("import sys; from actors.model_builder import build_checkpoint; "
            "build_checkpoint('tiny', 'llama', sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "sub")], cwd=REPO, check=True)
    assert _hashes(tmp_path / "sub") == _hashes(tiny_dirs["llama"])


@pytest.mark.parametrize("arch", list(ARCH_SPECS))
def test_tokenizer_covers_vocab_and_round_trips(tiny_dirs, arch):
    from transformers import AutoTokenizer

    folder = tiny_dirs[arch]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size == PRESETS["tiny"].vocab_size
    for token_id in range(vocab_size):
        assert tokenizer.convert_ids_to_tokens(token_id) is not None, token_id
        assert isinstance(tokenizer.decode([token_id]), str)
    assert [tokenizer.decode([i]) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0

    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert max(ids) < vocab_size
        assert tokenizer.decode(ids) == text
    assert tokenizer("<|im_end|>").input_ids == [2]

    decomposed = "cafe\u0301"  # 'e' + combining acute accent
    expected = "caf\u00e9" if arch.startswith("qwen") else decomposed  # the qwen families normalise to NFC
    assert tokenizer.decode(tokenizer(decomposed).input_ids) == expected


def test_chat_template_is_chatml(tiny_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüß dich 👋"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nGrüß dich 👋<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text).input_ids
    assert ids.count(1) == 3 and ids.count(2) == 2 and tokenizer.decode(ids) == text


def test_chat_template_writes_tools_calls_and_answers_in_hermes_format(tiny_dirs):
    """Tools in a system turn, an assistant's calls as `<tool_call>` blocks (which
    cluster/hermes_calls.py reads back as the same calls), tools' answers grouped
    in one user turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    calls = [{"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "a", "content": "9:00"},
                {"role": "tool", "tool_call_id": "b", "content": "8:00"}]
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    system, user, assistant, answers, opened = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(tool) in system
    assert user == "<|im_start|>user\nTime?" and opened == "<|im_start|>assistant\n"
    assert hermes_calls.parse(assistant.removeprefix("<|im_start|>assistant\n"), {"get_time"}) == (
        None, [("get_time", '{"zone": "CET"}'), ("get_time", '{"zone": "UTC"}')])
    assert answers == ("<|im_start|>user\n<tool_response>\n9:00\n</tool_response>"
                       "\n<tool_response>\n8:00\n</tool_response>")
    no_tools = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_tools == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTime?<|im_end|>\n"


def test_sharded_build_matches_single_file(tmp_path, tiny_dirs):
    sharded = build_checkpoint("tiny", "qwen2", tmp_path / "sharded", max_shard_bytes=400_000)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert {(p.name, p.stat().st_mode & 0o777) for p in sharded.glob("*.safetensors")} == {
        (name, 0o644) for name in shards}, "readable by all, as the config beside them (safetensors writes 0600)"

    input_ids = torch.tensor([[5, 77, 301, 1999, 42, 8, 1024]])
    torch.testing.assert_close(_logits(sharded, input_ids), _logits(tiny_dirs["qwen2"], input_ids),
                               rtol=0, atol=0)


def test_half_precision_build_loads(tmp_path):
    from safetensors import safe_open

    folder = build_checkpoint("tiny", "llama", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_unknown_names_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'nope'.*bench.*tiny"):
        build_checkpoint("nope", "qwen2", tmp_path)
    with pytest.raises(ValueError, match=r"unknown arch 'gpt2'.*qwen2.*llama"):
        build_checkpoint("tiny", "gpt2", tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        build_checkpoint("tiny", "llama", tmp_path, dtype="int8")


def test_ensure_checkpoint_builds_once_under_concurrency(tmp_path, tiny_dirs):
    with ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: ensure_checkpoint("tiny", "llama", root=tmp_path), range(4)))
    assert folders == [tmp_path / "tiny-llama"] * 4
    assert _hashes(folders[0]) == _hashes(tiny_dirs["llama"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny-llama.lock", "tiny-llama"]
    mtime = (folders[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint("tiny", "llama", root=tmp_path) == folders[0]
    assert (folders[0] / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_checkpoint_replaces_a_build_from_older_code(tmp_path, tiny_dirs):
    stale = tmp_path / "tiny-qwen2"
    stale.mkdir()
    (stale / "tandem_build.json").write_text(json.dumps({"preset": "tiny", "arch": "qwen2",
                                                         "dtype": "float32", "builder": "old"}))
    (stale / "model.safetensors").write_bytes(b"stale")
    assert ensure_checkpoint("tiny", "qwen2", root=tmp_path) == stale
    assert _hashes(stale) == _hashes(tiny_dirs["qwen2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny-qwen2.lock", "tiny-qwen2"]


def test_cli_make_model(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "cluster.cli", "make-model", "--preset", "tiny", "--arch", "llama"]
    ok = subprocess.run([*cmd, "--out", str(tmp_path / "m")], cwd=REPO, env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file() and "wrote tiny/llama" in ok.stdout

    bad = subprocess.run([*cmd[:4], "--preset", "nope", "--out", str(tmp_path / "x")], cwd=REPO,
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert "nope" in bad.stderr and "tiny" in bad.stderr
    assert not (tmp_path / "x").exists()

    (tmp_path / "a-file").write_text("")
    unwritable = subprocess.run([*cmd, "--out", str(tmp_path / "a-file" / "m")], cwd=REPO, env=env,
                                capture_output=True, text=True)
    assert unwritable.returncode == 2 and "Traceback" not in unwritable.stderr
    assert unwritable.stderr.strip() == f"tandem make-model: cannot write the checkpoint to {tmp_path}/a-file/m: " \
                                        "Not a directory"


def test_the_command_line_loads_no_torch_until_a_command_needs_it():
    """`tandem --help`, and its argument parsing, import neither torch nor Ray: they
    took 2.3 s before (the parser's choices came from the model builder, the pool
    commands' namespace from the pool manager), 0.16 s after."""
    code = ("import sys; from cluster.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_cli_demo_with_an_unknown_preset_is_one_line(capsys):
    from cluster.cli import main

    assert main(["demo", "--preset", "nope"]) == 2
    assert capsys.readouterr().err == "tandem demo: unknown preset 'nope'; choose one of ['bench', 'qwen2.5-0.5b', " \
                                      "'tiny']\n"
    assert main(["make-model", "--preset", "tiny", "--out", ""]) == 2  # (it wrote into the working folder)
    assert capsys.readouterr().err == "tandem make-model: --out is empty: give the folder to write the checkpoint to\n"
    assert main(["demo", "--model", __file__]) == 2
    assert capsys.readouterr().err == f"tandem demo: {__file__}: a file, not a checkpoint folder\n"
    # Found by a review: --arch was ignored beside --model; an empty --model ran the built-in bench model;
    # a path too long was a traceback (Python 3.11's is_dir() lets ENAMETOOLONG through)
    assert main(["demo", "--model", "/models/x", "--arch", "llama"]) == 2
    assert capsys.readouterr().err == "tandem demo: --preset and --arch name a built-in model: give them, or " \
                                      "--model, not both\n"
    assert main(["bench", "engine", "--model", "", "--out", "/tmp/tandem-unused.json"]) == 2
    assert capsys.readouterr().err == "tandem bench: --model is empty: give a checkpoint folder, or leave " \
                                      "--model out for the built-in one\n"
    too_long = "/tmp/" + "x" * 300
    assert main(["make-model", "--preset", "tiny", "--out", too_long]) == 2
    assert capsys.readouterr().err == f"tandem make-model: File name too long: {too_long}\n"


def test_a_manifest_takes_every_preset():
    """The Serve settings' list of presets is the builder's (it lacked qwen2.5-0.5b)."""
    from typing import get_args

    from actors.model_builder import PRESETS
    from cluster.config import ModelSource

    literal, _ = get_args(ModelSource.model_fields["preset"].annotation)
    assert set(get_args(literal)) == set(PRESETS)
    literal, _ = get_args(ModelSource.model_fields["arch"].annotation)  # (None: a checkpoint folder's)
    assert set(get_args(literal)) == set(ARCH_SPECS)


def test_bench_preset_builds(tmp_path):
    # A few seconds on a laptop CPU (the build time is reported, not asserted).
    folder = build_checkpoint("bench", "qwen2", tmp_path / "bench")
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 8192 and config["num_hidden_layers"] == 12
    assert config["rope_parameters"]["rope_theta"] == 1e6
    assert 80e6 < num_parameters("bench", "qwen2") < 100e6


def test_qwen25_half_billion_preset_has_the_real_models_shape():
    """Checked on the meta device (no weights drawn): the config transformers builds
    from it has Qwen2.5-0.5B's shape and parameter count; the tokenizer is smaller
    than the embedding, as in the real model."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.model_builder import ARCH_SPECS, _hf_config

    preset = PRESETS["qwen2.5-0.5b"]
    config = _hf_config(preset, ARCH_SPECS["qwen2"], "qwen2", "bfloat16",
                        {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0})
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (896, 24, 14, 2, 4864, 151_936)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hf_count = sum(p.numel() for p in model.parameters())
    assert hf_count == num_parameters("qwen2.5-0.5b", "qwen2") and 493e6 < hf_count < 495e6
    assert preset.tokenizer_vocab_size == 8192 < preset.vocab_size


def test_a_mistral_window_shorter_than_the_context_bounds_it(tmp_path, tiny_dirs):
    """Mistral 7B v0.1's 4096-token sliding window, under its 32k positions: served
    up to the window, where sliding-window attention is full attention. A Qwen2
    config's window (off unless use_sliding_window) bounds nothing."""
    import shutil

    from actors.config import ModelConfig

    for arch, bounded in (("mistral", 512), ("qwen2", 2048)):
        folder = tmp_path / arch
        shutil.copytree(tiny_dirs[arch], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
        assert ModelConfig.from_hf(folder).max_position_embeddings == bounded
    assert ModelConfig.from_hf(tiny_dirs["mistral"]).max_position_embeddings == 2048  # a null window
