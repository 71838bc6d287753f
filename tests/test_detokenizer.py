"""Incremental detokenization never splits a multi-byte character.

Every test runs both ways a tokenizer is detokenized: `bytes` (the byte-level
tables the engine builds for a ByteLevel decoder) and `stream` (DecodeStream, or
windows where the tokenizers library has none)."""

from __future__ import annotations

import random

import pytest

from actors.detokenizer import ByteLevelTables, IncrementalDetokenizer, byte_of_char
from actors.tokenization import load_tokenizer


def test_the_byte_level_alphabet_is_gpt2s_as_transformers_writes_it():
    """The tables' own alphabet (workers import no transformers), against the one
    transformers converts tokenizers with."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_of_char() == {char: byte for byte, char in bytes_to_unicode().items()}


@pytest.fixture(params=["bytes", "stream"])
def detokenizer_of(request):
    """A factory: `detokenizer_of(tokenizer, skip_special_tokens=True)` on this
    test's path."""

    def make(tokenizer, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        tables = None
        if request.param == "bytes":
            tables = ByteLevelTables.of(tokenizer, len(tokenizer) + 8)
            assert tables is not None
        return IncrementalDetokenizer(tokenizer, skip_special_tokens, tables)

    return make


def test_deltas_concatenate_to_the_full_decode(tiny_qwen2_dir, detokenizer_of):
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    text = "naïve café — 中文字符 and emoji 🙂🚀 mixed with ASCII."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer_of(tokenizer)
    deltas = [detok.add(token_id) for token_id in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_tokens_of_one_character_emit_once_complete(tiny_qwen2_dir, detokenizer_of):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    byte_chars = bytes_to_unicode()
    # The four bytes of one emoji, one byte-level token each.
    ids = [tokenizer.convert_tokens_to_ids(byte_chars[b]) for b in "🙂".encode()]
    assert len(ids) == 4
    detok = detokenizer_of(tokenizer)
    emitted = [detok.add(t) for t in ids]
    assert emitted == ["", "", "", "🙂"]


def test_flush_emits_an_incomplete_tail(tiny_qwen2_dir, detokenizer_of):
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    detok = detokenizer_of(tokenizer)
    for token_id in ids[:-1]:
        detok.add(token_id)
    detok.flush()
    assert detok.text == tokenizer.decode(ids[:-1])


def test_random_token_streams_detokenize_as_the_tokenizer_decodes(tiny_model_dir, detokenizer_of):
    """Any id sequence (special tokens, stray byte tokens and ids past the
    tokenizer's vocabulary, as a model with padded rows may sample, included), both
    architectures' tokenizers: the deltas, flushed, are `tokenizer.decode` of all of
    them, as the Transformers wrapper computes it, and never end inside a character
    a later token completes."""
    tokenizer = load_tokenizer(tiny_model_dir)
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(60):
            ids = [rng.randrange(len(tokenizer) + 8) for _ in range(rng.randint(1, 60))]
            detok = detokenizer_of(tokenizer, skip_special_tokens=skip)
            deltas = [detok.add(t) for t in ids]
            whole = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) + detok.flush() == whole
            assert whole.startswith("".join(deltas))


def test_added_tokens_outside_the_byte_alphabet_decode_as_their_text(tiny_qwen2_dir, detokenizer_of):
    """An added token whose characters are not byte symbols (a real tokenizer's
    added words may be) decodes as its own UTF-8, special or not."""
    from tokenizers import AddedToken

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    tokenizer.add_tokens([AddedToken("✓ok", special=False), AddedToken("<tool→>", special=True)])
    plain, special = tokenizer.convert_tokens_to_ids(["✓ok", "<tool→>"])
    ids = tokenizer.encode("one ", add_special_tokens=False) + [plain, special] + tokenizer.encode(" two 🙂")
    for skip in (True, False):
        detok = detokenizer_of(tokenizer, skip_special_tokens=skip)
        text = "".join(detok.add(t) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip) and "✓ok" in text


def test_other_decoders_take_the_stream_path(tiny_qwen2_dir):
    """Tables only where a ByteLevel decoder alone decodes: another decoder has none."""
    from tokenizers import decoders

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    assert ByteLevelTables.of(tokenizer) is not None
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert ByteLevelTables.of(tokenizer) is None


@pytest.mark.parametrize("path", ["bytes", "stream", "windows"])
def test_spaces_are_never_cleaned_up_and_no_punctuation_is_lost(tiny_qwen2_dir, monkeypatch, path):
    """A tokenizer that cleans up spaces after decoding (transformers'
    `clean_up_tokenization_spaces`, set by Llama 3's checkpoints, applied by
    transformers 4 and here forced): its windows were decoded so, a window's
    text came out shorter than its prefix's, and the punctuation went: "a b  c "
    for "a.b, c?". Now no path cleans up, as vLLM's never do, and the byte
    tables stay."""
    import actors.detokenizer

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    tokenizer.clean_up_tokenization_spaces = True
    if hasattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):  # (5.x)
        tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tokenizer.convert_tokens_to_ids(["a", "Ġ", ".", "b", "Ġ", ",", "Ġc", "Ġ", "?"])
    assert tokenizer.decode(ids) == "a.b, c?"  # (the cleanup, as transformers applies it)
    tables = ByteLevelTables.of(tokenizer)
    assert tables is not None
    if path == "windows":
        monkeypatch.setattr(actors.detokenizer, "DecodeStream", None)
    detok = IncrementalDetokenizer(tokenizer, True, tables if path == "bytes" else None,
                                   tokenizer.encode("Hello there", add_special_tokens=False))
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, clean_up_tokenization_spaces=False) == "a .b , c ?"


def _byte_fallback_tokenizer():
    """A sentencepiece-style tokenizer with Llama 2's decoders (Replace, ByteFallback,
    Fuse, Strip): byte tokens `<0xE4>` for what its pieces do not spell."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "c", "▁a", "▁c"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def test_a_byte_fallback_run_that_stops_being_utf8_does_not_fail_the_stream():
    """"中" in three byte tokens, then a lone byte in the same run: the run decodes
    as U+FFFD whole, the character already sent changes, and DecodeStream raised
    (which failed the engine step, and every request on the worker). The stream
    goes on in windows; the text after the run is the decode's."""
    tokenizer = _byte_fallback_tokenizer()
    assert ByteLevelTables.of(tokenizer) is None
    ids = tokenizer.convert_tokens_to_ids(["▁a", "<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>", "▁c", "▁a"])
    detok = IncrementalDetokenizer(tokenizer)
    assert detok._stream is not None
    text = "".join(detok.add(token_id) for token_id in ids) + detok.flush()
    assert text.startswith("a中") and text.endswith(" c a") and text == detok.text
    # A character held back (0xCC, incomplete) when the run broke: sent from the windows, not
    # taken as sent and lost ("aR c")
    held = tokenizer.convert_tokens_to_ids(["▁a", "<0x52>", "<0xCC>", "▁c"])
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(token_id) for token_id in held) + detok.flush() == "aR\ufffd c"
    well_formed = tokenizer.convert_tokens_to_ids(["▁a", "<0xE4>", "<0xB8>", "<0xAD>", "▁c"])
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(token_id) for token_id in well_formed) + detok.flush() == tokenizer.decode(well_formed)


def test_any_range_of_the_text_reads_as_a_slice_of_the_whole(tiny_qwen2_dir):
    """The text is kept as pieces (never one string re-copied every token);
    `text_between` joins only the pieces a range overlaps."""
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    text = "naïve café — 中文字符 and emoji 🙂🚀 mixed with ASCII, twice: naïve café 🙂."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids:
        detok.add(token_id)
    detok.flush()
    whole = detok.text
    assert len(detok.pieces) > 10 and detok.num_chars == len(whole) == detok.piece_ends[-1]
    rng = random.Random(0)
    ranges = [(0, len(whole)), (0, 0), (len(whole), len(whole))] + [
        tuple(sorted(rng.randrange(len(whole) + 1) for _ in range(2))) for _ in range(300)]
    ranges += [(start, len(whole)) for start in [0] + detok.piece_ends]  # the last piece alone among them
    for start, end in ranges:
        assert detok.text_between(start, end) == whole[start:end], (start, end)


def test_an_output_keeps_the_text_of_its_step(tiny_qwen2_dir):
    """Outputs share the request's growing text; each reads it as of its own step."""
    from actors.llm import LLM
    from actors.sampling_params import SamplingParams

    engine = LLM(tiny_qwen2_dir).engine
    engine.add_request("hello there", SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    for earlier in outputs[:-1]:
        assert final.text.startswith(earlier.text) and len(earlier.text) == earlier.num_chars
        assert earlier.new_text(2) == earlier.text[2:]
    assert [len(o.text) for o in outputs] == sorted(len(o.text) for o in outputs)


def _metaspace_tokenizer():
    """Metaspace with prepend_scheme "first", as tokenizers converts Llama 2's and
    Mistral's sentencepiece models: a decode strips its text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, ".": 7, "▁": 8}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("path", ["stream", "windows"])
@pytest.mark.parametrize("make", [_metaspace_tokenizer, _byte_fallback_tokenizer])
def test_an_output_keeps_its_first_space_where_a_decode_strips_a_texts_first(monkeypatch, path, make):
    """Found by a review: "The capital is" answered "Paris." (vLLM: " Paris."),
    and prompt plus completion read "isParis". The decode starts from the
    prompt's last tokens, and the output is what follows them."""
    import actors.detokenizer

    if path == "windows":
        monkeypatch.setattr(actors.detokenizer, "DecodeStream", None)
    tokenizer = make()
    if make is _metaspace_tokenizer:
        prompt = tokenizer.convert_tokens_to_ids(["<s>", "▁The", "▁capital", "▁is"])
        outputs = [tokenizer.convert_tokens_to_ids(["▁Paris", "."])]
    else:
        prompt = tokenizer.convert_tokens_to_ids(["▁a", "▁c", "<0xE4>", "<0xB8>", "<0xAD>", "▁a"])
        rng = random.Random(5)
        pieces = ["▁", "a", "c", "▁a", "▁c", "<0xE4>", "<0xB8>", "<0xAD>", "<0x41>"]
        outputs = [tokenizer.convert_tokens_to_ids(["▁c", "<0xE4>", "<0xB8>", "<0xAD>"])]
        outputs += [tokenizer.convert_tokens_to_ids(rng.choices(pieces, k=12)) for _ in range(30)]
    for ids in outputs:
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
        text = "".join(detok.add(token_id) for token_id in ids) + detok.flush()
        whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
        if "\ufffd" not in whole:  # (a broken byte run: the known byte-fallback case)
            assert text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):], ids
    assert text == detok.text
    if make is _metaspace_tokenizer:
        assert text == " Paris."
        # (found by the second read: a prompt ending in special tokens, skipped, left no text to start from)
        ended = prompt + tokenizer.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "</s>"])
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=ended)
        assert "".join(detok.add(token_id) for token_id in outputs[0]) + detok.flush() == " Paris."
        alone = IncrementalDetokenizer(tokenizer)  # (no prompt: an output's text as decode gives it)
        assert "".join(alone.add(token_id) for token_id in outputs[0]) + alone.flush() == "Paris."


@pytest.mark.parametrize("before", ["ok", "ok\ufffd"])
@pytest.mark.parametrize("rest, expected", [("🙂 end", "🙂 end"), ("a end", "a end")])
def test_a_prompt_that_ends_inside_a_character_starts_the_output_with_it_on_every_path(tiny_qwen2_dir,
                                                                                        monkeypatch, rest, expected,
                                                                                        before):
    """A prompt of ids cut inside "🙂" (an output cut mid-emoji, sent back to go
    on): the byte path gave the output's continuation bytes as U+FFFDs, the
    windows lost the character (a review's probe). Now every path starts the
    output with the character where the output completes it; where it does
    not, its U+FFFD is the prompt's text and is left out (DecodeStream gives it:
    an output held to a pattern began with a U+FFFD the pattern does not allow).
    A prompt's own U+FFFD just before the cut hid the cut from the windows, and
    DecodeStream gave it with the output (a review's probe)."""
    import actors.detokenizer

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    ids = tokenizer.encode("ok🙂 end", add_special_tokens=False)  # ok, then 🙂 in four byte tokens
    prompt = tokenizer.encode(before, add_special_tokens=False) + ids[1:3]
    assert tokenizer.decode(prompt) == before + "\ufffd"
    out = ids[3:] if rest == "🙂 end" else tokenizer.encode(rest, add_special_tokens=False)
    texts = []
    for tables, stream in ((ByteLevelTables.of(tokenizer), True), (None, True), (None, False)):
        if not stream:
            monkeypatch.setattr(actors.detokenizer, "DecodeStream", None)
        detok = IncrementalDetokenizer(tokenizer, True, tables, prompt)
        texts.append("".join(detok.add(t) for t in out) + detok.flush())
    assert texts == [expected] * 3
