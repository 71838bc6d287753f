"""A model folder's tokenizer, and the token ids a prompt is given.

Two loaders. `load_tokenizer`: transformers' tokenizer, all of it (chat templates,
special tokens by name, token strings), for the scheduler and the offline `LLM`'s
chats. `load_engine_tokenizer`: what an engine asks of one (ids from text, text from
ids, the `tokenizers` pipeline the detokenizer steps through), which for a folder
Tandem built needs no transformers at all: importing it is about 1 s of CPU of
every worker's start here, and each worker process pays it.
"""

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
    torch: about 1.3 s of every scheduler replica's start here (and of a worker's,
    on a folder Tandem did not build: `load_engine_tokenizer`). Any other folder
    goes through AutoTokenizer, which may pick a model's own class."""
    if _holds_whole_pipeline(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def _holds_whole_pipeline(model_dir: Path) -> bool:
    """Tandem's builder wrote the folder, to the end (its stamp names the builder),
    and its tokenizer.json is there (without it: AutoTokenizer's say)."""
    try:
        built_here = "builder" in json.loads((model_dir / BUILD_STAMP).read_text())
    except (OSError, ValueError, TypeError):
        return False
    return built_here and (model_dir / "tokenizer.json").is_file()


def load_engine_tokenizer(model_dir: str | Path):
    """The tokenizer an engine encodes and decodes with. A folder Tandem built (its
    stamp names a builder) holds in tokenizer.json the pipeline transformers would run
    (`_tokenizer_class`), so it loads with the `tokenizers` library alone, to the same
    ids and text (tests/test_tokenization.py holds every arch to transformers' own);
    any other folder through transformers (`load_tokenizer`), whose class may change
    the pipeline it reads."""
    model_dir = Path(model_dir)
    if not _holds_whole_pipeline(model_dir):
        return load_tokenizer(model_dir)
    from tokenizers import Tokenizer

    try:
        return PipelineTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
        raise CheckpointError(f"{model_dir}: cannot load tokenizer ({type(exc).__name__}: {exc})") from None


class PipelineTokenizer:
    """A `tokenizers` pipeline with the calls an engine makes of transformers' fast
    tokenizer, which makes them of its pipeline the same way (`encode` of one text,
    `decode`; BPE's `clean_up_tokenization_spaces` is off: transformers ignores it
    for BPE too)."""

    def __init__(self, backend_tokenizer) -> None:
        self.backend_tokenizer = backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


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
