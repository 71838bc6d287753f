"""A model folder's tokenizer, and the token ids a prompt is given."""

from __future__ import annotations

from pathlib import Path

from actors.config import CheckpointError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    if not Path(model_dir).is_dir():  # (transformers would take the path for a Hub repo id)
        raise CheckpointError(f"{model_dir}: no such checkpoint folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad folder
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({type(exc).__name__}: {exc})") from None
    # Without its vocabulary files transformers still builds a tokenizer, from the
    # special tokens alone (a Qwen2 folder without tokenizer.json: 3 tokens), that
    # encodes every text as no tokens: every prompt was then "empty".
    if not tokenizer.encode("Hello, world", add_special_tokens=False):
        raise CheckpointError(f"{model_dir}: the tokenizer encodes no text ({len(tokenizer)} tokens known): is its "
                              "vocabulary there (tokenizer.json, or vocab.json and merges.txt, or tokenizer.model)?")
    return tokenizer


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
