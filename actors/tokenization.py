"""A model folder's tokenizer, and the token ids a prompt is given."""

from __future__ import annotations

import json
from pathlib import Path

from actors.config import CheckpointError
from actors.model_shapes import BUILD_STAMP


def load_tokenizer(model_dir: str | Path):
    if not Path(model_dir).is_dir():  # (transformers would take the path for a Hub repo id)
        raise CheckpointError(f"{model_dir}: no such checkpoint folder")
    try:
        tokenizer = _tokenizer_class(Path(model_dir)).from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad folder
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({type(exc).__name__}: {exc})") from None
    # Without its vocabulary files transformers still builds a tokenizer, from the
    # special tokens alone (a Qwen2 folder without tokenizer.json: 3 tokens), that
    # encodes every text as no tokens: every prompt was then "empty".
    if not tokenizer.encode("Hello, world", add_special_tokens=False):
        raise CheckpointError(f"{model_dir}: the tokenizer encodes no text ({len(tokenizer)} tokens known): is its "
                              "vocabulary there (tokenizer.json, or vocab.json and merges.txt, or tokenizer.model)?")
    return tokenizer


def _tokenizer_class(model_dir: Path):
    """The transformers class that loads the folder's tokenizer.

    A folder Tandem's builder wrote (its stamp names a builder: the build completed)
    holds a tokenizer.json that already is what transformers makes of it: for a
    `qwen2` model, AutoTokenizer picks Qwen2Tokenizer, which rebuilds the pipeline
    with Qwen2's NFC normaliser, and `actors.tokenizer_builder` writes exactly that
    in. Such a folder loads with the generic class, to the same pipeline, ids, text
    and chat template (tests/test_tokenization.py compares the two on every arch).
    AutoTokenizer first imports transformers' whole model catalogue and, with it,
    torch: about 1.3 s of every worker's and scheduler replica's start here. Any
    other folder goes through AutoTokenizer, which may pick a model's own class."""
    try:
        built_here = "builder" in json.loads((model_dir / BUILD_STAMP).read_text())
    except (OSError, ValueError, TypeError):
        built_here = False
    if built_here and (model_dir / "tokenizer.json").is_file():  # (without it: AutoTokenizer's say)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def encode_prompt(tokenizer, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids. Text gets the tokenizer's special tokens (a BOS where
    the model has one: Llama 3's `<|begin_of_text|>`; Qwen2 has none), as
    transformers' `tokenizer(text)`, vLLM's completions and SGLang's /generate give
    it. Text a chat template wrote should get none (`add_special_tokens=False`,
    the chat bodies' default, as vLLM's): the template wrote them, and a second
    BOS changes what the model says. Ids are used as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return [int(t) for t in prompt]
