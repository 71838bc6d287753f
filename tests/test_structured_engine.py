"""Structured output in the engine: its outputs held to their patterns, token
masks, jump-forward and stop ids under a pattern (the patterns themselves:
tests/test_structured_output.py; P/D over HTTP: tests/test_serve_app.py)."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from actors.json_schema import schema_regex
from actors.json_text import free_json_regex
from actors.llm import LLM
from actors.regex_dfa import START, compile_regex
from actors.sampling_params import InvalidRequestError, SamplingParams
from kernels.logit_bias import _bit_table, keep_masked_
from tests.test_structured_output import SCHEMA


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(tiny_qwen2_dir, max_num_seqs=8)


PROMPTS = ["The answer is", "Hello world, this", "Once upon a time", "1, 2, 3,"]


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[一-龥]{2,4}", schema_regex(SCHEMA),
                                     free_json_regex(), schema_regex({"type": "string", "maxLength": 300}),
                                     schema_regex({"type": "string", "pattern": r"^.{1,40}$"})])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_pattern(llm, pattern, temperature):
    params = SamplingParams(max_new_tokens=200, temperature=temperature, seed=3, regex=pattern)
    dfa = compile_regex(pattern)
    for output in llm.generate(PROMPTS, params):
        if output.finish_reason == "stop":
            assert re.fullmatch(pattern, output.text, re.ASCII), output.text
        else:  # cut by length (a random model may write digits forever): a match's beginning
            assert output.finish_reason == "length" and dfa.walk(1, output.text.encode()), output.text


def test_a_completed_match_ends_the_request_without_another_draw(llm):
    # A pattern with nothing after its match: its last token ends the request (no EOS drawn).
    [output] = llm.generate(["x"], SamplingParams(max_new_tokens=50, regex="abc", ignore_eos=True))
    assert output.text == "abc" and output.finish_reason == "stop"
    assert llm.engine.tokenizer.decode(output.token_ids) == "abc"


def test_max_new_tokens_may_cut_a_match_short(llm):
    [output] = llm.generate(["x"], SamplingParams(max_new_tokens=3, regex=r"a{40}", temperature=0))
    assert output.finish_reason == "length" and re.fullmatch("a*", output.text) and len(output.token_ids) == 3


def test_overlapped_decode_changes_no_constrained_output(tiny_qwen2_dir, llm):
    overlapped = LLM(tiny_qwen2_dir, max_num_seqs=8, overlap_decode=True)
    mixed = [SamplingParams(max_new_tokens=40, temperature=0.9, seed=s, regex=r"[a-z ]{5,60}" if s % 2 else None)
             for s in range(len(PROMPTS))]
    # One batch: the unconstrained rows would be launched ahead but for the constrained ones.
    outputs = {name: [o.token_ids for o in llm_.generate(PROMPTS, mixed)]
               for name, llm_ in (("plain", llm), ("overlapped", overlapped))}
    assert outputs["plain"] == outputs["overlapped"]
    assert all(re.fullmatch(r"[a-z ]{5,60}", o.text) for o in overlapped.generate(PROMPTS[1::2], mixed[1::2]))


def test_a_pattern_with_allowed_token_ids_or_bad_words_is_refused():
    for extra in ({"allowed_token_ids": (5, 6)}, {"bad_words": ("no",)}):
        with pytest.raises(InvalidRequestError, match="cannot be combined"):
            SamplingParams(regex="a+", **extra)


def test_packed_masks_keep_exactly_their_tokens():
    rng = np.random.default_rng(0)
    for vocab, rows in ((13, [0, 2]), (2048, [0, 1, 2, 3]), (1000, [3])):
        bits = rng.random((len(rows), vocab)) < 0.3
        logits = torch.randn(4, vocab)
        want = logits.clone()
        for i, row in enumerate(rows):
            want[row, ~torch.from_numpy(bits[i])] = -torch.inf
        keep_masked_(logits, rows, [np.packbits(b) for b in bits])
        assert torch.equal(logits, want)
    # The GPU path's unpacking (a byte's bits from a table) gives numpy's bits.
    packed = np.packbits(rng.random((3, 21)) < 0.5, axis=1)
    table_bits = _bit_table(torch.device("cpu"))[torch.from_numpy(packed).long()].reshape(3, -1)
    assert np.array_equal(table_bits.numpy(), np.unpackbits(packed, axis=1).astype(bool))


def _vocabulary_with_long_tokens(rng: random.Random) -> list[bytes]:
    """Every byte, then 3000 tokens of 2 to 40 bytes of JSON's and a string's text
    (many past `SHARED_BYTES`), some of whole UTF-8 characters."""
    pieces = [b"a", b"b", b"c", b"d", b"x", b"1", b" ", b'"', b"\\", b"\\n", b"\\u00e9", b"{", b"}", b"[", b"]", b":",
              b",", "é".encode(), "😀".encode(), b"true", b"null", b"\n"]
    tokens = [bytes([b]) for b in range(256)]
    while len(tokens) < 3256:
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(2, 24)))[:40]
        tokens.append(data)
    return tokens


@pytest.mark.parametrize("pattern", [
    schema_regex({"type": "string", "minLength": 3, "maxLength": 300}), free_json_regex(), r"(?:ab|c){2,40}d",
    schema_regex({"type": "string", "pattern": r"^.{1,50}$"}), schema_regex(SCHEMA),
])
def test_a_states_mask_shared_with_its_class_is_the_mask_its_own_walk_gives(pattern):
    """States no text of up to SHARED_BYTES bytes tells apart share the mask of their
    tokens that long; each state's longer tokens are walked apart: every state's mask
    is the one a walk of each token's bytes from it gives."""
    from actors.structured_output import SHARED_BYTES, TokenIndex, VocabularyBytes

    rng = random.Random(pattern)
    tokens = _vocabulary_with_long_tokens(rng)
    assert max(map(len, tokens)) > SHARED_BYTES
    dfa = compile_regex(pattern)
    index = TokenIndex(dfa, VocabularyBytes(tokens))
    states = list(range(1, len(dfa.accepting)))
    for state in rng.sample(states, min(len(states), 150)):
        want = np.packbits([dfa.walk(state, data) != 0 for data in tokens])
        assert np.array_equal(index.continuing(state), want), state


def test_the_copies_of_a_long_strings_characters_share_their_masks():
    """A JSON string of at most 2000 characters: 28,004 states, each a step of a request
    writing it, in 211 classes of states alike to a token of up to SHARED_BYTES bytes,
    so the masks of a long walk through it are mostly the ones already made."""
    from actors.structured_output import TokenIndex, VocabularyBytes

    dfa = compile_regex(schema_regex({"type": "string", "maxLength": 2000}))
    index = TokenIndex(dfa, VocabularyBytes(_vocabulary_with_long_tokens(random.Random(0))))
    assert len(dfa.accepting) == 28_004 and len(set(index.classes.tolist())) == 211
    state, visited = START, set()
    for byte in b'"' + b"ab\\n" * 450:
        state = dfa.walk(state, bytes([byte]))
        visited.add(state)
        index.continuing(state)
    assert len(visited) == 1801 and len(index._shared) < 40


PET = {"type": "object", "required": ["name", "kind", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}}}


def test_jump_forward_writes_the_fixed_text_without_steps(tiny_qwen2_dir):
    """The keys, quotes, colons and commas, and an enum's rest once its first letter
    is drawn, are appended untouched by a step: fewer steps for the same answers."""
    pattern, steps, outputs = schema_regex(PET), {}, {}
    for jump in (True, False):
        engine_llm = LLM(tiny_qwen2_dir, max_num_seqs=8, jump_forward=jump)
        outputs[jump] = engine_llm.generate(PROMPTS, SamplingParams(max_new_tokens=80, temperature=1.0, seed=1,
                                                                    regex=pattern))
        steps[jump] = engine_llm.engine.num_steps
    for answers in outputs.values():
        assert all(o.finish_reason == "stop" and re.fullmatch(pattern, o.text) for o in answers)
    assert steps[True] * 3 < steps[False], steps
    # With logprobs every token is drawn (a jumped token would have none).
    with_logprobs = LLM(tiny_qwen2_dir, max_num_seqs=8)
    [answer] = with_logprobs.generate(PROMPTS[:1], SamplingParams(max_new_tokens=80, regex=pattern, logprobs=0))
    assert with_logprobs.engine.num_steps == len(answer.token_ids) and len(answer.logprobs) == len(answer.token_ids)


def test_a_stop_id_that_is_text_of_the_pattern_is_drawn_only_where_the_output_matches(tiny_qwen2_dir):
    """A request naming as a stop id a token its pattern writes ("t" of "true", say)
    would end short of a match if the draw took it there (a fuzzer drew one)."""
    import numpy as np

    from actors.engine import Engine

    engine = Engine(tiny_qwen2_dir)
    token_bytes = engine.byte_level.without_special
    t = next(i for i, data in enumerate(token_bytes) if data == b"t")
    constraint = engine.token_indexes.constraint("t[a-z]{0,3}", [t])
    allowed = np.unpackbits(constraint.mask([], 0))[:len(token_bytes)]
    assert not allowed[t] and allowed.any()  # "th", "the", ... go on by other tokens
    after = np.unpackbits(constraint.mask([t], 1))[:len(token_bytes)]
    assert after[t]  # a match: the stop id may end it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_id_that_is_a_patterns_one_way_on_is_drawn_as_text_under_the_minimum(llm, temperature):
    """The pattern's only way on is a token the request named as a stop id, which
    min_new_tokens bans: the draw takes it, as text (under the minimum it ends
    nothing), and the match completes. Before, the bans left the row nothing, and a
    sampled request wrote an arbitrary id forever ("derderder")."""
    [x] = llm.engine.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=1, regex="x", stop_token_ids=[x],
                            min_new_tokens=2)
    [output] = llm.generate(["Once upon a time"], params)
    assert (output.token_ids, output.text, output.finish_reason) == ([x], "x", "stop")


@pytest.mark.parametrize("asked", [dict(ignore_eos=True), dict(min_new_tokens=1)])
def test_a_pattern_of_empty_text_alone_that_nothing_may_end_is_refused(llm, asked):
    """Its first draw's mask held no token (the pattern allows none, and no end
    token may end it): every logit was -inf, and the output (any token) did not
    match. Without ignore_eos, the end token ends it empty."""
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, regex="a{0}", **asked)
    with pytest.raises(InvalidRequestError, match="matches only empty text"):
        llm.generate(["Hello"], params)
    [out] = llm.generate(["Hello"], SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, regex="a{0}"))
    assert out.text == "" and out.finish_reason == "stop"
