"""Incremental detokenization never splits a multi-byte character."""

from __future__ import annotations

from actors.detokenizer import IncrementalDetokenizer
from actors.engine import load_tokenizer


def test_deltas_concatenate_to_the_full_decode(tiny_qwen2_dir):
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    text = "naïve café — 中文字符 and emoji 🙂🚀 mixed with ASCII."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(token_id) for token_id in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_tokens_of_one_character_emit_once_complete(tiny_qwen2_dir):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    byte_chars = bytes_to_unicode()
    # The four bytes of one emoji, one byte-level token each.
    ids = [tokenizer.convert_tokens_to_ids(byte_chars[b]) for b in "🙂".encode()]
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer)
    emitted = [detok.add(t) for t in ids]
    assert emitted == ["", "", "", "🙂"]


def test_flush_emits_an_incomplete_tail(tiny_qwen2_dir):
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids[:-1]:
        detok.add(token_id)
    detok.flush()
    assert detok.text == tokenizer.decode(ids[:-1])


def test_random_token_streams_detokenize_as_the_tokenizer_decodes(tiny_model_dir):
    """Any id sequence (special tokens and stray byte tokens included), both
    architectures' tokenizers: the deltas, flushed, are `tokenizer.decode` of all
    of them, as the Transformers wrapper computes it."""
    import random

    tokenizer = load_tokenizer(tiny_model_dir)
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
            detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            text = "".join(detok.add(t) for t in ids) + detok.flush()
            assert text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_any_range_of_the_text_reads_as_a_slice_of_the_whole(tiny_qwen2_dir):
    """The text is kept as pieces (never one string re-copied every token);
    `text_between` joins only the pieces a range overlaps."""
    import random

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
