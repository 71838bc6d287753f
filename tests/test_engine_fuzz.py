"""Hostile requests batched together (hypothesis): whatever the engine accepts ends
with tokens its params allow, and no request fails another; what it refuses is an
InvalidRequestError; every block comes back; and overlapped decode gives the
tokens reading every step first gives (penalised rows count their last token on
the device then, kernels/penalties.py). The schema fuzzing over HTTP
(tests/test_serve_app.py) found two accepted requests that failed a worker's step,
and every request on it (a stop id outside the vocabulary under min_tokens; a
temperature of 5e-50, which is 0 in float32); this holds the engine to it without
a server, with edge values a schema does not know to try."""

from __future__ import annotations

import functools
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.bad_words import encode_bad_words
from actors.config import EngineConfig
from actors.engine import Engine
from actors.regex_dfa import compile_regex
from actors.sampling_params import InvalidRequestError, SamplingParams

VOCAB = 2048  # the tiny preset's
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 5e-324, 5e-50, 1e-30, 1e-6, 1e-5, 0.01, 2.0, 10.0, 100.0, 1e30, 1e300,
                               -1.0, -1e300, math.inf, -math.inf, math.nan])
EDGE_INTS = st.sampled_from([-1, 0, 1, 21, VOCAB, 10**6, 2**64])
EDGE_IDS = st.lists(st.sampled_from([-1, 0, VOCAB - 1, VOCAB, 10**9]), min_size=1, max_size=3)
token_ids = st.integers(0, VOCAB - 1)
WORDS = ["the", " the", "and", "hello", "fox", "quick brown", "\u2603", "a"]
PATTERNS = [r"\d+", "yes|no", r'\{"a": (true|false)\}', "[\u4e00-\u9fa5 ]{1,8}", "x"]
# What an odd field may be set to: each field's edges, one field a request.
ODD = {name: EDGE_FLOATS for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                        "presence_penalty")}
ODD.update({name: EDGE_INTS for name in ("max_new_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
                                         "min_new_tokens")})
ODD.update({"stop_token_ids": EDGE_IDS, "allowed_token_ids": EDGE_IDS,
            "logit_bias": st.lists(st.tuples(st.sampled_from([-1, 5, VOCAB]), EDGE_FLOATS), min_size=1, max_size=2),
            "bad_words": st.lists(st.sampled_from(["", " ", "\n", "x" * 300]), min_size=1, max_size=2)})


@st.composite
def requests(draw):
    """A prompt and valid fields (any mix: greedy or sampled, filters, penalties,
    biases, bans), and now and then one field set to an edge value."""
    fields = dict(
        max_new_tokens=draw(st.integers(1, 10)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.5])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.5, 1e-9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 1.0])),
        top_k=draw(st.sampled_from([0, 0, 1, 20, 5000])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        stop_token_ids=draw(st.lists(token_ids, max_size=3)), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        prompt_logprobs=draw(st.one_of(st.none(), st.none(), st.integers(0, 3))),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.5, 1.3, 10.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, -2.0, 0.5, 2.0])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, -2.0, 0.5, 2.0])),
        logit_bias=draw(st.lists(st.tuples(token_ids, st.sampled_from([-100.0, -5.0, 5.0, 100.0])), max_size=3,
                                 unique_by=lambda pair: pair[0])),
        allowed_token_ids=draw(st.one_of(st.just([]), st.just([]), st.lists(token_ids, min_size=1, max_size=4))),
        min_new_tokens=draw(st.sampled_from([0, 0, 1, 3, 10])),
        bad_words=draw(st.lists(st.sampled_from(WORDS), max_size=3)),
    )
    fields["min_new_tokens"] = min(fields["min_new_tokens"], fields["max_new_tokens"])
    pattern = draw(st.sampled_from([None, None, None, *PATTERNS]))
    if pattern is not None:  # (refused beside allowed_token_ids and bad_words, unless the odd field sets one)
        fields.update(regex=pattern, allowed_token_ids=[], bad_words=[])
    odd = draw(st.one_of(st.none(), st.sampled_from(sorted(ODD))))
    if odd is not None:
        fields[odd] = draw(ODD[odd])
    prompt = draw(st.lists(token_ids, min_size=1, max_size=70))
    return prompt, fields


def _engine(model_dir, overlap: bool, num_speculative_tokens: int = 0) -> Engine:
    engine = Engine(model_dir, EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=64,
                                            num_kv_blocks=64, overlap_decode=overlap,
                                            num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=1))
    engine.runner.decode_graphs = engine.runner.static_decode(capture=False)  # the step CUDA graphs replay
    return engine


def _finish(engine: Engine) -> dict:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_a_batch_of_hostile_requests_never_fails_a_step(tiny_qwen2_dir):
    """Each batch runs through an overlapped engine, then through one without
    overlap and one that speculates (prompt lookup), which must give the same
    tokens (every request seeded)."""
    engine, plain = _engine(tiny_qwen2_dir, overlap=True), _engine(tiny_qwen2_dir, overlap=False)
    speculating = _engine(tiny_qwen2_dir, overlap=False, num_speculative_tokens=3)

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(requests(), min_size=1, max_size=5))
    def check(batch):
        accepted = {}
        counts["requests"] += len(batch)
        for index, (prompt, fields) in enumerate(batch):
            fields["seed"] = index if fields["seed"] is None else fields["seed"]  # the same draws in both engines
            try:
                params = SamplingParams(**fields)
                request_id = engine.add_request(prompt, params, f"fuzz-{index}")
            except InvalidRequestError:
                continue
            accepted[request_id] = (prompt, params)
        finished = _finish(engine)
        assert finished.keys() == accepted.keys()
        overlapped = {request_id: out.token_ids for request_id, out in finished.items()}
        for other in (plain, speculating):
            for request_id, (prompt, params) in accepted.items():
                other.add_request(prompt, params, request_id)
            assert {request_id: out.token_ids for request_id, out in _finish(other).items()} == overlapped
        counts["accepted"] += len(accepted)
        counts["patterns"] += sum(params.regex is not None for _, params in accepted.values())
        for request_id, (_, params) in accepted.items():
            _holds_to(params, finished[request_id].token_ids, engine)
        for each in (engine, plain, speculating):
            each.pool.check()
            assert each.pool.num_used == 0

    counts = {"requests": 0, "accepted": 0, "patterns": 0}
    check()
    assert counts["accepted"] >= counts["requests"] / 3 and counts["patterns"], counts
    assert engine.num_steps_launched_ahead > 0  # the fuzzing reached the steps
    assert speculating.num_draft_tokens > 0  # (tests/test_speculation.py fuzzes requests that draft more)


def _holds_to(params: SamplingParams, tokens: list[int], engine: Engine) -> None:
    """The output obeys what its params promise: each token is one its draw could
    take (allowed, a way on in its pattern, and not banned as a stop token under
    min_new_tokens nor as a bad word's next token; where the bans leave nothing, they
    give way: kernels/logit_bias.py), a stop token past the minimum ends it, and a
    pattern's output is a match's beginning that an end token ends only where it
    matches or was the one way on."""
    assert 1 <= len(tokens) <= params.max_new_tokens
    assert all(0 <= t < VOCAB for t in tokens)
    stops = params.stop_ids(engine.model_config.eos_token_ids)
    assert all(t not in stops for i, t in enumerate(tokens[:-1]) if i >= params.min_new_tokens)
    bad = encode_bad_words(engine.tokenizer, params.bad_words, VOCAB)
    allowed = set(params.allowed_token_ids or range(VOCAB))
    dfa = None
    if params.regex is not None:
        dfa, token_bytes = compile_regex(params.regex), tuple(engine.byte_level.without_special[:VOCAB])
    state = 1
    for index, token in enumerate(tokens):
        banned = set(bad.banned(tokens, index) if bad else ()) | (stops if index < params.min_new_tokens else set())
        candidates = allowed if dfa is None else allowed & _ways_on(params.regex, state, frozenset(stops), token_bytes)
        assert token in (candidates - banned or candidates), (index, token)
        if dfa is not None:
            state = dfa.walk(state, token_bytes[token])
    if dfa is not None:  # (the walk above took every token: an end token has no bytes, or is the pattern's text)
        ended = tokens[-1] in stops and len(tokens) > params.min_new_tokens
        before_end = dfa.walk(1, b"".join(token_bytes[t] for t in (tokens[:-1] if ended else tokens)))
        one_way_on = not _ways_on(params.regex, before_end, frozenset(), token_bytes) - stops
        assert before_end and (dfa.accepting[before_end] or not ended or one_way_on), (params.regex, tokens)


@functools.cache
def _ways_on(pattern: str, state: int, stops: frozenset, token_bytes: tuple[bytes, ...]) -> frozenset:
    """The tokens a draw in `state` of `pattern` may take, found by walking each one
    (actors/structured_output.py's rule): those whose bytes keep the output a match's
    beginning, with the end tokens where the output matches; elsewhere an end token
    only where it is the one way on."""
    dfa = compile_regex(pattern)
    going_on = frozenset(t for t, data in enumerate(token_bytes) if data and dfa.walk(state, data))
    return going_on | stops if dfa.accepting[state] else (going_on - stops or going_on)
