"""A checkpoint folder's tokenizer (actors/tokenization.py): a folder Tandem built
loads with transformers' generic class, to what AutoTokenizer gives, without
importing transformers' model catalogue, and for an engine with the `tokenizers`
library alone, to the same ids and text; any other folder goes through AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from actors.config import CheckpointError
from actors.detokenizer import ByteLevelTables
from actors.model_shapes import BUILD_STAMP
from actors.tokenization import PipelineTokenizer, load_engine_tokenizer, load_tokenizer

TEXTS = ["Hello, world", " a leading space", "ünïcödé 日本語 🙂 e\u0301", "<|im_start|>user\nhi<|im_end|>",
         "a\n\n\tb   c", "x" * 300, ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


def _pipeline(tokenizer) -> dict:
    """The backend's whole pipeline; BPE's empty affixes and absent ones mean the same."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    for field in ("continuing_subword_prefix", "end_of_word_suffix"):
        spec["model"][field] = spec["model"].get(field) or None
    return spec


def test_a_built_folder_loads_to_what_autotokenizer_gives(tiny_model_dir):
    ours, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert _pipeline(ours) == _pipeline(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    for text in TEXTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "model_max_length", "clean_up_tokenization_spaces", "chat_template"):
        assert getattr(ours, name) == getattr(auto, name), name
    for prompt in (True, False):
        assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
                == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt))


def test_a_built_folder_loads_without_transformers_model_catalogue(tiny_qwen2_dir):
    probe = ("import sys; from actors.tokenization import load_tokenizer; load_tokenizer(sys.argv[1]); "
             "print('transformers.models.auto' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(tiny_qwen2_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_an_engine_reads_a_built_folder_as_transformers_does_without_it(tiny_model_dir):
    """The pipeline alone: the same ids for text, with and without the special
    tokens, the same text for random ids (special ones among them), with and
    without them, and the same detokenizing tables."""
    ours, full = load_engine_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir)
    assert isinstance(ours, PipelineTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == full.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(full)) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids
    assert ByteLevelTables.of(ours, len(full) + 8) == ByteLevelTables.of(full, len(full) + 8)


def test_an_engine_on_a_built_folder_never_imports_transformers(tiny_qwen2_dir):
    """About 1 s of CPU of every worker's start (actors/tokenization.py); a request
    with stop strings, bad words and a pattern, which the engine encodes, too."""
    probe = ("import sys; from actors.llm import LLM; from actors.sampling_params import SamplingParams; "
             "llm = LLM(sys.argv[1], block_size=16); "
             "llm.generate(['Hello', 'Hi'], [SamplingParams(max_new_tokens=8, stop=['zz'], bad_words=['the']), "
             "SamplingParams(max_new_tokens=8, regex='(ab|cd)+')]); print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(tiny_qwen2_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_a_built_folders_unreadable_tokenizer_is_a_checkpoint_error_for_an_engine(tiny_qwen2_dir, tmp_path):
    shutil.copytree(tiny_qwen2_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match="cannot load tokenizer"):
        load_engine_tokenizer(tmp_path)


def test_any_other_folder_goes_through_autotokenizer(tiny_qwen2_dir, tmp_path):
    """A stamp that names no builder is a build cut short, not Tandem's word on the
    tokenizer: AutoTokenizer picks Qwen2's own class for model_type qwen2."""
    shutil.copytree(tiny_qwen2_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / BUILD_STAMP).write_text(json.dumps({"building": "tiny/qwen2"}))
    assert type(load_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"
    (tmp_path / BUILD_STAMP).unlink()
    assert type(load_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"
    assert type(load_tokenizer(tiny_qwen2_dir)).__name__ != "Qwen2Tokenizer"  # (the generic class)
    assert type(load_engine_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"  # (an engine's too)
