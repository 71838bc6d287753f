"""Train the deterministic byte-level BPE tokenizer shipped with the built-in presets.

Contract of `build_tokenizer(out_dir, vocab_size, ...)`:
- Trains a byte-level BPE (the `tokenizers` library) on `data/corpus.txt` plus a
  seeded synthetic word stream, so that any vocab size up to a few tens of thousands
  is reachable. Same inputs -> the same bytes in every file, on every run.
- Ids 0, 1, 2 are the special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`;
  ids 3..258 are the 256 byte symbols; the rest are merges. `len(tokenizer)` equals
  `vocab_size` exactly, and every id in `[0, vocab_size)` decodes (a lone id may
  decode to U+FFFD when it holds part of a multi-byte character), so a model that
  samples any id never produces an unknown one.
- Writes `tokenizer.json`, `tokenizer_config.json` (eos/pad/bos tokens, a ChatML
  `chat_template`) and `special_tokens_map.json`; `transformers.AutoTokenizer` loads
  the folder.
- Pre-tokenization is Qwen2's split regex followed by ByteLevel (no prefix space);
  `nfc=True` adds Qwen2's NFC normalizer. transformers v5 rebuilds a `qwen2` model's
  tokenizer with exactly that pipeline whatever tokenizer.json says, so the qwen2
  preset declares it too; encode -> decode then round-trips NFC text only (as with
  the real Qwen2). With `nfc=False` (llama) it round-trips any UTF-8 text.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"

# Qwen2's pre-tokenization regex (contractions, letter runs, single digits, punctuation,
# newlines, whitespace), the same pattern transformers' Qwen2Tokenizer hard-codes.
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, with tools the way Qwen2.5 writes them (Hermes' format): the tools in a
# system turn, an assistant's calls as `<tool_call>` blocks, the tools' answers as
# `<tool_response>` blocks in a user turn. Messages without tools render as plain
# ChatML. cluster/hermes_calls.py reads the calls back out of an answer. As Qwen3's,
# `enable_thinking=False` opens the answer after an empty <think></think> block (a
# reasoning model then answers at once: cluster/reasoning.py).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call the functions described in JSON within <tools></tools>:\n<tools>")
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nTo call one, write a JSON object with its name and arguments within <tool_call></tool_call> "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_INSTRUCTIONS.replace("\n", "\\n") + "' + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
           "w", "z", "br", "ch", "dr", "fl", "gr", "kl", "pr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ie")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")
_NUM_SYNTHETIC_WORDS = 60_000


def _synthetic_lines(seed_text: str) -> Iterator[str]:
    """A deterministic stream of made-up words (seeded Mersenne Twister; only
    `random()` is used, whose output is fixed across Python versions)."""
    seed = int.from_bytes(hashlib.sha256(seed_text.encode()).digest()[:8], "big")
    rng = random.Random(seed)

    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.random() * len(options))]

    # A small lexicon used with a skewed (Zipf-like) frequency, as in real text.
    lexicon = []
    for _ in range(6000):
        num_syllables = 1 + int(rng.random() * 4)
        lexicon.append("".join(pick(_ONSETS) + pick(_VOWELS) + pick(_CODAS)
                               for _ in range(num_syllables)))
    words = []
    for i in range(_NUM_SYNTHETIC_WORDS):
        rank = int(len(lexicon) * rng.random() ** 2.5)
        word = lexicon[rank]
        words.append(word.capitalize() if rng.random() < 0.1 else word)
        if i % 12 == 11:
            yield " ".join(words) + "."
            words = []
    if words:
        yield " ".join(words) + "."


def training_lines() -> Iterator[str]:
    """The full training text: the shipped corpus, then the synthetic stream."""
    yield from CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    yield from _synthetic_lines("tandem/tokenizer/synthetic/v1")


def train_tokenizer(vocab_size: int, *, nfc: bool) -> Tokenizer:
    """Train and return the backend tokenizer with exactly `vocab_size` entries."""
    min_size = len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_lines(), trainer=trainer)
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"BPE training reached {got} tokens, wanted {vocab_size}; "
                           "the training text is too small for this vocab size")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def build_tokenizer(out_dir: Path, vocab_size: int, *, nfc: bool,
                    bos_token: str | None = None, max_length: int = 2048) -> dict[str, int | None]:
    """Write the tokenizer files into `out_dir`; return the special ids for config.json
    (`bos_token_id`, `eos_token_id`, `pad_token_id`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, nfc=nfc)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)

    eos_token, pad_token = ENDOFTEXT, ENDOFTEXT
    added_tokens_decoder = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    _write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": bos_token,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })
    special_map: dict = {"additional_special_tokens": [IM_START, IM_END],
                         "eos_token": eos_token, "pad_token": pad_token}
    if bos_token is not None:
        special_map["bos_token"] = bos_token
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return {
        "bos_token_id": None if bos_token is None else tokenizer.token_to_id(bos_token),
        "eos_token_id": tokenizer.token_to_id(eos_token),
        "pad_token_id": tokenizer.token_to_id(pad_token),
    }
