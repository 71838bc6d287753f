"""vLLM's bad_words (actors/bad_words.py): a word's token sequences, the tokens a
draw must not take, and outputs that never write the word, with and without
overlapped decode."""

from __future__ import annotations

import pytest

from actors.bad_words import BadWords, encode_bad_words
from actors.config import EngineConfig
from actors.engine import Engine
from actors.llm import LLM
from actors.sampling_params import InvalidRequestError, SamplingParams
from actors.tokenization import load_tokenizer


def test_a_draw_bans_what_would_complete_a_word():
    words = BadWords(prefixes=([], [5, 6], [6]), lasts=(9, 7, 8))
    assert words.banned([1, 5, 6, 2], 3) == [9, 7, 8]  # the output so far ends 5, 6
    assert words.banned([1, 5, 6, 2], 4) == [9]
    assert words.banned([1, 5, 6, 2], 0) == [9]  # a one-token word, from the first draw
    assert words.reads_output and not BadWords(([],), (9,)).reads_output


def test_a_word_is_banned_as_written_first_and_after_a_space(tiny_qwen2_dir):
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    words = encode_bad_words(tokenizer, ("hello", " fox", "the"), 2048)
    sequences = [prefix + [last] for prefix, last in zip(words.prefixes, words.lasts)]
    # "hello" and " hello" are three tokens each, their first differs: both; as "the".
    assert sequences == [[74, 338, 843], [303, 338, 843], [72, 81, 90], [305, 81, 90], [1522], [423]]
    assert [tokenizer.decode(s) for s in sequences] == ["hello", " hello", "fox", " fox", "the", " the"]
    assert encode_bad_words(tokenizer, (), 2048) is None
    assert encode_bad_words(tokenizer, ("the",), 500).lasts == (423,)  # 1522 is no token of a 500-token model


@pytest.mark.parametrize("words", [("",), (" ",), ("x",) * 101])
def test_blank_or_too_many_words_are_refused(words):
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=words)


def test_allowed_tokens_that_are_all_banned_are_refused(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(num_kv_blocks=32))
    eos = engine.model_config.eos_token_ids[0]
    for params in (SamplingParams(allowed_token_ids=[1522, 423], bad_words=("the",)),
                   SamplingParams(allowed_token_ids=[1522, eos], bad_words=("the",), min_new_tokens=1)):
        with pytest.raises(InvalidRequestError, match="no token could be sampled"):
            engine.add_request([1, 2, 3], params)
    engine.add_request([1, 2, 3], SamplingParams(allowed_token_ids=[1522, eos], bad_words=("the",)))  # eos is left


def _first_occurrence(ids: list[int], sequences: list[list[int]]) -> tuple[int, int]:
    """(where, length) of the first of `sequences` in `ids`."""
    return min((start, len(s)) for s in sequences for start in range(len(ids) - len(s) + 1)
               if ids[start : start + len(s)] == s)


def _occurs(ids: list[int], sequences: list[list[int]]) -> bool:
    return any(ids[i : i + len(s)] == s for s in sequences for i in range(len(ids)))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_greedy_output_writes_everything_but_the_banned_word(tiny_qwen2_dir, overlap):
    """A two-token word the greedy output writes is banned: the output is the same
    up to the word's last token, which is then another, and the word never appears;
    overlapped decode (the static step) gives the same tokens."""
    llm = LLM(tiny_qwen2_dir, block_size=16, overlap_decode=overlap, enable_prefix_cache=False)
    engine = llm.engine
    engine.runner.decode_graphs = engine.runner.static_decode(capture=False)
    tokenizer = engine.tokenizer
    greedy = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True)

    def generate(**fields) -> list[int]:
        return llm.generate(["The bad words"], SamplingParams(**greedy, **fields))[0].token_ids

    free = generate()
    word = next(tokenizer.decode(free[k : k + 2]) for k in range(2, len(free) - 1)
                if tokenizer.encode(tokenizer.decode(free[k : k + 2]), add_special_tokens=False) == free[k : k + 2])
    bad = encode_bad_words(tokenizer, (word,), engine.model_config.vocab_size)
    sequences = [prefix + [last] for prefix, last in zip(bad.prefixes, bad.lasts)]
    start, length = _first_occurrence(free, sequences)
    banned = generate(bad_words=(word,))
    assert banned[: start + length - 1] == free[: start + length - 1]
    assert banned[start + length - 1] != free[start + length - 1]
    assert not _occurs(banned, sequences)
    if overlap:
        assert engine.num_steps_launched_ahead > 0  # the free run overlapped; the banned one paused
