"""Speculative decoding by prompt lookup (actors/prompt_lookup.py, actors/speculation.py):
the drafts are what followed the latest earlier match, and verifying them changes
no token: an engine that speculates gives the tokens, texts, finish reasons and
logprobs of one that does not, colocated and on the decode side of a P/D pair, with
preemption, stop strings, penalties, bans, patterns and every sampling filter. Which drafts a
step verifies (actors/step_costs.py, actors/draft_acceptance.py, `Drafter.trim`):
the most expected tokens per second on the measured costs, against every choice."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.block_pool import BlockPool
from actors.config import EngineConfig
from actors.draft_acceptance import DraftAcceptance
from actors.engine import Engine
from actors.prompt_lookup import PromptLookup
from actors.request import Request
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler
from actors.speculation import EXPLORE_EVERY, Drafter, num_confirmed
from actors.step_costs import MAX_AGE, WEIGHT, DecodeStepCosts
from actors.tokenization import load_tokenizer
from tests.test_engine_fuzz import _finish
from tests.test_pd_engine_fuzz import _run_disaggregated, _same

CONFIG = EngineConfig(block_size=16, prefill_chunk_size=32, max_num_batched_tokens=64, num_kv_blocks=24)
SPECULATING = dataclasses.replace(CONFIG, num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
CAT_TEXT = "the cat sat on the mat. the cat sat on the mat. the dog"  # (a prompt whose text repeats)


def _scan(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The proposal by brute force: the latest earlier occurrence of the longest
    suffix, what followed it, then its period."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                after = start + n
                period = len(tokens) - after
                return [tokens[after + i % period] for i in range(num_tokens)]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(2, 3)
    assert lookup.propose([1, 2, 3, 9, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [9, 2, 3]  # (1, 2, 3) is longest, ...
    assert PromptLookup(2, 2).propose([1, 2, 3, 9, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]  # ... (2, 3) latest
    assert PromptLookup(2, 3).propose([1, 2, 3, 4], 2) == []  # no earlier match
    assert PromptLookup(1, 3).propose([1, 2, 3, 4, 2], 5) == [3, 4, 2, 3, 4]  # a period of 3 past what followed
    assert PromptLookup(1, 1).propose([7], 4) == []


@settings(max_examples=200, deadline=None, database=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 3), extra=st.integers(0, 2),
       num_tokens=st.integers(1, 6))
def test_prompt_lookup_index_matches_a_scan_as_tokens_arrive(tokens, min_n, extra, num_tokens):
    """Grown token by token (as a request's output is), the index proposes what a
    scan of the whole context finds."""
    lookup = PromptLookup(min_n, min_n + extra)
    for end in range(1, len(tokens) + 1):
        assert lookup.propose(tokens[:end], num_tokens) == _scan(tokens[:end], num_tokens, min_n, min_n + extra)


def test_drafts_stand_while_the_samples_equal_them():
    assert num_confirmed((5, 6, 7), [5, 6, 7, 8]) == 3
    assert num_confirmed((5, 6, 7), [5, 9, 7, 8]) == 1
    assert num_confirmed((5, 6, 7), [4, 6, 7, 8]) == 0


@st.composite
def drafting_requests(draw):
    """A prompt that repeats itself now and then (so the lookup finds drafts), and
    any sampling but a pattern: filters, seeds, stops, logprobs, and now and then
    penalties, a bias, allowed tokens, a minimum length, bad words or a pattern,
    which a draft row must read as the plain decode of its token would."""
    unit = draw(st.lists(st.integers(0, 2047), min_size=1, max_size=12))
    prompt = unit * draw(st.integers(1, 6)) + draw(st.lists(st.integers(0, 2047), max_size=8))
    fields = dict(
        max_new_tokens=draw(st.integers(1, 48)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        top_k=draw(st.sampled_from([0, 1, 20])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        seed=draw(st.integers(0, 2**32)),
        ignore_eos=draw(st.sampled_from([True, True, False])),
        stop_token_ids=draw(st.lists(st.integers(0, 2047), max_size=2)),
        stop=draw(st.sampled_from([[], [], ["ing"], ["\n", "the"]])),
        logprobs=draw(st.sampled_from([None, None, 0, 2])),
    )
    processing = draw(st.sampled_from([{}, {}, dict(repetition_penalty=1.3), dict(frequency_penalty=0.5,
                                       presence_penalty=0.4), dict(logit_bias={7: 2.0, 8: -1.0}),
                                       dict(min_new_tokens=min(5, fields["max_new_tokens"])),
                                       dict(bad_words=["the", "quick brown"]),
                                       dict(allowed_token_ids=[7, 8, 9, 10, 11]), dict(regex="[a-z ]{1,60}"),
                                       dict(regex=r'\{"name": "[a-z ]{1,40}", "n": [0-9]{1,3}\}'),
                                       dict(regex="(ab|cd|e)+")]))  # (text fixed after a, c: drafts follow it)
    return prompt, SamplingParams(**fields, **processing)


def test_speculation_gives_the_tokens_of_plain_decoding(tiny_qwen2_dir):
    """Batches through a plain engine and two that speculate, one through the
    static decode step that CUDA graphs replay, all with a pool (12 blocks of 16)
    small enough that long batches preempt: the same outputs, every block back,
    and drafts both confirmed and refused along the way."""
    plain, speculating, static = (Engine(tiny_qwen2_dir, dataclasses.replace(config, num_kv_blocks=12))
                                  for config in (CONFIG, SPECULATING, SPECULATING))
    static.runner.decode_graphs = static.runner.static_decode(capture=False)

    def compare(batch):
        outputs = []
        for engine in (plain, speculating, static):
            for index, (prompt, params) in enumerate(batch):
                engine.add_request(prompt, params, f"r{index}")
            outputs.append(_finish(engine))
            engine.pool.check()
            assert engine.pool.num_used == 0
        for request_id, expected in outputs[0].items():
            _same(outputs[1][request_id], expected)
            _same(outputs[2][request_id], expected)

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(drafting_requests(), min_size=1, max_size=6))
    def check(batch):
        compare(batch)

    check()
    # And a batch that surely preempts: six requests of up to 9 blocks in a pool of 12.
    compare([([7 + i, 8, 9] * 27, SamplingParams(max_new_tokens=48, temperature=0.5 * (i % 2), seed=i,
                                                 ignore_eos=True)) for i in range(6)])
    assert 0 < speculating.num_accepted_draft_tokens < speculating.num_draft_tokens
    assert speculating.num_steps < plain.num_steps
    assert speculating.scheduler.num_preemptions > 0  # the fuzzing reached preemption
    assert static.num_accepted_draft_tokens > 0  # (how many: each engine's own timings trim its drafts)


def test_every_architecture_speculates_to_the_same_tokens(tiny_model_dir):
    prompts = [list(range(40, 52)) * 3, [7, 8, 9] * 9 + [1], list(range(300, 340))]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    outputs = []
    for config in (CONFIG, SPECULATING):
        engine = Engine(tiny_model_dir, config)
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, params, f"r{index}")
        outputs.append({request_id: out.token_ids for request_id, out in _finish(engine).items()})
    assert outputs[0] == outputs[1]


def test_penalised_and_patterned_requests_draft(tiny_qwen2_dir):
    """A draft row's penalties count the drafts before it, so penalised requests
    draft (Qwen's checkpoints ask for a repetition penalty by default); a pattern's
    rows are masked after the drafts before them: the plain tokens. (Drafts
    verified, not confirmed, are counted: how many the trim keeps after the first
    verification follows this machine's step times.)"""
    penalised = _plain_and_speculating(tiny_qwen2_dir, [7, 8, 9] * 9,
                                       SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=1.05))
    _same(penalised[1][0], penalised[0][0])
    assert penalised[1][1].num_draft_tokens > 0
    prompt = penalised[0][1].tokenizer.encode(CAT_TEXT, add_special_tokens=False)
    for pattern in ("[a-z ]{1,60}", r'\{"name": "[a-z ]{1,40}", "n": [0-9]{1,3}\}'):
        outputs = _plain_and_speculating(tiny_qwen2_dir, prompt, SamplingParams(max_new_tokens=50, temperature=0,
                                                                                regex=pattern))
        _same(outputs[1][0], outputs[0][0])
        assert outputs[1][1].num_draft_tokens > 0


def test_a_pattern_fixes_the_text_after_a_draft_as_after_a_sample(tiny_qwen2_dir):
    """Eight x's fix "ame " (jump-forward writes it as "am", "e", " "): where a
    draft that stood is the eighth, so does the speculating engine; the row
    sampled after it (an "a", biased so) is dropped, as a plain decode never
    samples there."""
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    bias = {tokenizer.convert_tokens_to_ids("x"): 30.0, tokenizer.convert_tokens_to_ids("a"): 20.0}
    params = SamplingParams(max_new_tokens=40, temperature=0, regex="(x{1,8}ame )+", logit_bias=bias)
    (expected, plain), (got, speculating) = _plain_and_speculating(
        tiny_qwen2_dir, tokenizer.encode("xxxxxxxxame " * 3, add_special_tokens=False), params)
    assert tokenizer.decode(expected.token_ids).startswith("xxxxxxxxame xxxxxxxxame")
    _same(got, expected)
    assert speculating.num_accepted_draft_tokens > 0 and speculating.num_steps < plain.num_steps


def _plain_and_speculating(model_dir, prompt: list[int], params: SamplingParams):
    """(output, engine) of a plain engine and of one that speculates, for one request."""
    results = []
    for config in (CONFIG, SPECULATING):
        engine = Engine(model_dir, config)
        engine.add_request(prompt, params, "r")
        results.append((_finish(engine)["r"], engine))
        engine.pool.check()
    return results


def test_drafts_follow_the_text_jump_forward_wrote_in_its_chunk():
    """A request with the fixed text to compute (3 tokens) verifies its drafts in
    the same chunk; one whose pending tokens a chunk cannot hold, or a preempted
    one, does not."""
    config = dataclasses.replace(SPECULATING, prefill_chunk_size=8)
    scheduler = Scheduler(config, BlockPool(16, 16))
    (jumped,) = _drafting(1, [SURE], num_pending=3)
    long = Request("long", list(range(20)), SamplingParams(max_new_tokens=50), seed=0)  # 20 pending
    long.draft_token_ids = [5] * 4
    for request in (jumped, long):
        scheduler.add_running(request)
    chunks = scheduler.schedule().chunks
    assert (chunks[0].num_new_tokens, chunks[0].known_end, chunks[0].draft_token_ids) == (7, jumped.num_tokens,
                                                                                          (5, 5, 5, 5))
    assert chunks[1].draft_token_ids == () and chunks[1].num_new_tokens == 8
    scheduler._preempt(jumped)
    assert jumped.draft_token_ids == []


def test_a_patterns_drafts_end_where_they_would_leave_it_or_it_fixes_the_text(tiny_qwen2_dir):
    engine, tokenizer = Engine(tiny_qwen2_dir, SPECULATING), load_tokenizer(tiny_qwen2_dir)
    chars = lambda text: [tokenizer.convert_tokens_to_ids(c) for c in text]  # noqa: E731  (a token a byte)
    eos = tokenizer.eos_token_id
    constraint = engine.token_indexes.constraint("(ab|cd)+", [eos])
    output = chars("ab")
    assert constraint.num_useful_drafts(output, chars("cdab"), False) == 4
    assert constraint.num_useful_drafts(output, chars("cdxab"), False) == 2  # "x" leaves the pattern
    assert constraint.num_useful_drafts(output, chars("cd") + [eos, *chars("ab")], False) == 2
    assert constraint.num_useful_drafts([], chars("b"), False) == 0
    assert constraint.num_useful_drafts(output, chars("cdab"), True) == 1  # "d" is fixed after "c"
    # A draft row's mask is the state's after the drafts before it, walked without being kept.
    fresh = lambda: engine.token_indexes.constraint("(ab|cd)+", [eos])  # noqa: E731
    after_c = constraint.mask(output, len(output) + 1, tuple(chars("c")))
    assert (after_c == fresh().mask(output + chars("c"), len(output) + 1)).all()
    assert not (after_c == fresh().mask(output, len(output))).all()
    assert (constraint.mask(output, len(output)) == fresh().mask(output, len(output))).all()


def test_confirmed_drafts_fill_the_prefix_cache(tiny_qwen2_dir):
    """Blocks that confirmed drafts complete are published with their tokens: the
    whole conversation so far is a cache hit for the next turn."""
    engine = Engine(tiny_qwen2_dir, SPECULATING)
    prompt = [7, 8, 9] * 9
    engine.add_request(prompt, SamplingParams(max_new_tokens=45, temperature=0, ignore_eos=True), "first")
    first = _finish(engine)["first"]
    assert engine.num_accepted_draft_tokens > 0
    turn = prompt + first.token_ids + [11]
    engine.add_request(turn, SamplingParams(max_new_tokens=1, temperature=0), "second")
    second = _finish(engine)["second"]
    assert second.num_cached_tokens == (len(turn) - 1) // 16 * 16
    fresh = Engine(tiny_qwen2_dir, dataclasses.replace(CONFIG, enable_prefix_cache=False))
    fresh.add_request(turn, SamplingParams(max_new_tokens=1, temperature=0), "second")
    assert _finish(fresh)["second"].token_ids == second.token_ids


def test_drafts_before_the_token_that_ends_a_request_fill_the_prefix_cache_and_count(tiny_qwen2_dir):
    """Found by a review: the drafts a request's last step confirmed, before the
    token that ended it, were never published (the next turn hit up to a block
    fewer than after plain decoding), and drafts that stood past that token were
    counted accepted. Here a repeating output of 13 tokens, every draft verified."""
    prompt = [7, 8, 9] * 6 + [7, 8]
    params = SamplingParams(max_new_tokens=13, temperature=0, ignore_eos=True, logit_bias={9: 100.0})
    cached = []
    for config in (CONFIG, SPECULATING):
        engine = Engine(tiny_qwen2_dir, config)
        engine.drafter.trim = lambda running: None  # (verify every draft, as on a GPU)
        engine.add_request(prompt, params, "first")
        first = _finish(engine)["first"]
        engine.add_request(prompt + first.token_ids + [11], SamplingParams(max_new_tokens=1, temperature=0), "second")
        cached.append(_finish(engine)["second"].num_cached_tokens)
        engine.pool.check()
    assert cached[1] == cached[0] == (len(prompt) + 13 - 1) // 16 * 16
    assert 0 < engine.num_accepted_draft_tokens <= len(first.token_ids) - 1  # (the first token is the prefill's)


def test_text_a_pattern_fixes_after_a_draft_may_end_the_request_at_any_place_in_a_block(tiny_qwen2_dir):
    """Found by a second read: a draft that stood, then the text its pattern
    fixed after it ending the request (its blocks released), then the draft
    counted computed: on a block's last slot its publishing read the emptied
    block table, and the step failed (with every request of the worker). The
    prompt is padded so that the last draft lands on each slot of a block."""
    engine, tokenizer = Engine(tiny_qwen2_dir, SPECULATING), load_tokenizer(tiny_qwen2_dir)
    bias = {tokenizer.convert_tokens_to_ids("x"): 30.0, tokenizer.convert_tokens_to_ids("a"): 20.0}
    base = tokenizer.encode("xxxxxxxxame " * 3, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, temperature=0, regex="x{1,8}ame", logit_bias=bias)
    for pad in range(16):
        engine = Engine(tiny_qwen2_dir, SPECULATING)
        engine.drafter.trim = lambda running: None  # (verify every draft)
        engine.add_request([7] * pad + base, params, "r")
        assert _finish(engine)["r"].text == "xxxxxxxxame", pad
        assert engine.num_accepted_draft_tokens > 0
        engine.pool.check()


def test_a_speculating_decode_worker_gives_the_colocated_tokens(tiny_qwen2_dir):
    """P prefills and samples the first token; D proposes drafts from its
    activation on (for a patterned request too, after walking P's token): the
    outputs of a plain colocated engine."""
    prefill, decode = Engine(tiny_qwen2_dir, SPECULATING), Engine(tiny_qwen2_dir, SPECULATING)  # (P: no drafts)
    colocated = Engine(tiny_qwen2_dir, CONFIG)
    batch = {f"pd-{i}": ([7, 8, 9] * (4 + i) + [i], SamplingParams(max_new_tokens=30, temperature=t, seed=i,
                                                                   logprobs=1))
             for i, t in enumerate([0.0, 0.0, 0.8, 1.0])}
    prompt = prefill.tokenizer.encode(CAT_TEXT, add_special_tokens=False)
    batch["pd-pattern"] = (prompt, SamplingParams(max_new_tokens=40, temperature=0, regex="[a-z ]{1,60}"))
    got, seeds = _run_disaggregated(prefill, decode, batch, {"cached_blocks": 0})
    for request_id, (prompt, params) in batch.items():
        colocated.add_request(prompt, dataclasses.replace(params, seed=seeds[request_id]), request_id)
    expected = _finish(colocated)
    for request_id in batch:
        _same(got[request_id], expected[request_id])
    assert decode.num_accepted_draft_tokens > 0 and prefill.num_draft_tokens == 0


def test_speculation_and_overlap_are_one_or_the_other():
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(num_speculative_tokens=2, overlap_decode=True)
    assert not EngineConfig(device="cuda", num_speculative_tokens=2).overlaps_decode
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_drafting_backs_off_where_drafts_fail_and_in_large_batches():
    drafter = Drafter(dataclasses.replace(SPECULATING, speculative_max_batch=4), max_model_len=2048)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_new_tokens=50), seed=0)
    drafter.propose(request, num_running=5)
    assert request.draft_token_ids == []  # more than 4 running
    proposals = []
    for confirmed in (0, None, 0, None, None, None, 2, 0):
        drafter.propose(request, num_running=4)
        proposals.append(request.draft_token_ids)
        if confirmed is not None:
            drafter.record(request, len(proposals[-1]), confirmed)
    # A failed step pauses 1 proposal, a second in a row 3; a confirmed draft resets the count.
    assert [bool(p) for p in proposals] == [True, False, True, False, False, False, True, True]
    assert proposals[0] == [3, 1, 2, 3]


def test_a_long_prompt_is_indexed_a_slice_a_step_and_then_drafts_as_it_would_have():
    """Its whole index built at its first proposal held the engine thread (104 ms
    for 32k tokens), and every running request's next token with it."""
    from actors.speculation import INDEX_ENTRIES_A_STEP

    drafter = Drafter(SPECULATING, max_model_len=1 << 16)
    per_step = INDEX_ENTRIES_A_STEP // (drafter.max_n - drafter.min_n + 1)
    prompt = [(i * 7919) % 1000 for i in range(int(per_step * 2.5))] + [1, 2, 3, 4, 5, 6, 1, 2, 3]
    request = Request("r", prompt, SamplingParams(max_new_tokens=50), seed=0)
    proposals = []
    for _ in range(4):
        drafter.propose(request, num_running=1)
        proposals.append((len(request.lookup.tokens), request.draft_token_ids))
    assert proposals[:3] == [(per_step, []), (2 * per_step, []), (len(prompt), [4, 5, 6, 1])]
    whole = PromptLookup(drafter.min_n, drafter.max_n)
    whole.add(prompt)
    assert proposals[3][1] == whole.next_tokens(4)


def _costs(intercept_s: float, row_s: float, rows: list[int]) -> DecodeStepCosts:
    costs = DecodeStepCosts()
    for num_rows in rows:
        costs.record(num_rows, intercept_s + row_s * num_rows)
    return costs


def test_a_steps_cost_is_read_off_its_latest_decode_steps():
    costs = DecodeStepCosts()
    assert costs.curve() is None
    for _ in range(3):
        costs.record(1, 0.022)
    assert costs.curve() is None  # one row count tells nothing of another
    costs.record(3, 0.029)
    costs.record(5, 0.034)
    curve = costs.curve()
    assert [curve(n) for n in (1, 3, 5)] == pytest.approx([0.022, 0.029, 0.034])
    assert curve(2) == pytest.approx(0.0255) and curve(4) == pytest.approx(0.0315)  # between neighbours
    assert curve(9) == pytest.approx(0.044) and curve(0) == pytest.approx(0.0185)  # the end segments
    costs.record(5, 0.044)  # a new step weighs WEIGHT of its count's time
    assert costs.curve()(5) == pytest.approx(0.034 + WEIGHT * 0.010)
    for _ in range(MAX_AGE):
        costs.record(1, 0.022)
    assert costs.curve() is None  # the other counts forgotten: unknown again, till one is seen
    costs.record(4, 0.031)
    assert costs.curve()(4) == pytest.approx(0.031)


def _drafting(num_requests: int, acceptances: list[DraftAcceptance], num_drafts: int = 4,
              num_pending: int = 1) -> list[Request]:
    """Requests decoding (`num_pending` 1), or with the text jump-forward wrote to compute."""
    requests = []
    for i in range(num_requests):
        request = Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_new_tokens=50), seed=0)
        request.num_computed_tokens = request.num_tokens - num_pending
        request.draft_token_ids = [5] * num_drafts
        request.draft_acceptance = dataclasses.replace(acceptances[i % len(acceptances)])
        requests.append(request)
    return requests


UNSURE = DraftAcceptance(first_stood=0.0, first_verified=1.0)  # first 1/3, next 1/2
SURE = DraftAcceptance(first_stood=16.0, first_verified=18.0, next_stood=60.0, next_verified=60.0)  # 0.85, 0.98


def test_a_step_verifies_the_drafts_that_raise_its_tokens_per_second():
    drafter = Drafter(SPECULATING, max_model_len=2048)
    alone = _drafting(1, [UNSURE])
    drafter.trim(alone)
    assert alone[0].draft_token_ids == [5] * 4  # a row's cost unknown: every draft
    drafter.step_costs = _costs(0.021, 0.003, [1, 5])  # a lone row 24 ms, a draft 3 ms
    drafter.trim(alone)
    assert len(alone[0].draft_token_ids) == 2  # gains 1/3 and 1/6 pay for a 3 ms row, 1/12 does not
    sure, unsure = _drafting(2, [SURE, UNSURE])
    batch = [sure, unsure] + _drafting(6, [UNSURE], num_drafts=0)  # eight decoding
    drafter.trim(batch)
    assert len(sure.draft_token_ids) == 4 and unsure.draft_token_ids == []
    drafter.step_costs = _costs(0.021, 0.0, [1, 5])  # rows for free: all
    for request in _drafting(3, [UNSURE]):
        drafter.trim([request])
        assert len(request.draft_token_ids) == 4


def test_one_trim_in_so_many_verifies_a_few_drafts_more_than_pay():
    """So that the time of more rows than the rule keeps stays measured."""
    drafter = Drafter(SPECULATING, max_model_len=2048)
    drafter.step_costs = _costs(0.021, 0.003, [1, 5])
    kept = []
    for _ in range(2 * EXPLORE_EVERY):
        batch = _drafting(8, [UNSURE])  # eight decoding, none sure enough to pay for a row
        drafter.trim(batch)
        kept.append(sum(len(r.draft_token_ids) for r in batch))
    explored = ([0] * (EXPLORE_EVERY - 1) + [SPECULATING.num_speculative_tokens]) * 2
    assert kept == explored


acceptances = st.builds(DraftAcceptance, *(st.floats(0, 20) for _ in range(4))).filter(
    lambda a: a.first_stood <= a.first_verified and a.next_stood <= a.next_verified)


@settings(max_examples=60, deadline=None)
@given(drafting_acceptances=st.lists(acceptances, min_size=1, max_size=4), num_plain=st.integers(0, 4),
       lengths=st.lists(st.integers(1, 4), min_size=4, max_size=4),
       pending=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=4, max_size=4),
       step_ms=st.lists(st.floats(1, 50), min_size=2, max_size=6))
def test_trimmed_drafts_give_the_best_expected_tokens_per_second(drafting_acceptances, num_plain, lengths, pending,
                                                                  step_ms):
    """Against every choice of how many drafts each request keeps (a prefix: a
    draft after a failed one is not verified), on step costs of any shape; some
    drafting requests have jump-forward's text to compute first (rows, one token)."""
    drafter = Drafter(SPECULATING, max_model_len=2048)
    for num_rows, ms in zip((1, 3, 6, 10, 15, 21), step_ms):
        drafter.step_costs.record(num_rows, ms / 1e3)
    curve = drafter.step_costs.curve()
    drafting = [_drafting(1, [acceptance], num_pending=n)[0] for acceptance, n in zip(drafting_acceptances, pending)]
    for request, length in zip(drafting, lengths):
        del request.draft_token_ids[length:]
    running = drafting + _drafting(num_plain, [UNSURE], num_drafts=0)
    num_rows = sum(r.num_pending_tokens for r in running)

    def goodput(counts) -> float:
        gained = sum(sum(r.draft_acceptance.gain(j) for j in range(1, n + 1)) for r, n in zip(drafting, counts))
        return (len(running) + gained) / max(curve(num_rows + sum(counts)), 1e-9)

    best = max(goodput(c) for c in itertools.product(*(range(len(r.draft_token_ids) + 1) for r in drafting)))
    drafter.trim(running)
    assert goodput([len(r.draft_token_ids) for r in drafting]) == pytest.approx(best, rel=1e-9)


def test_acceptance_reads_drafts_that_stand_or_fall_together():
    acceptance = DraftAcceptance()
    assert acceptance.gain(1) == 0.5 and acceptance.gain(2) == 0.25
    for _ in range(5):  # a request half in a loop: all four stand, or the first fails
        acceptance.record(4, 4)
        acceptance.record(4, 0)
    assert 0.4 < acceptance.gain(1) < 0.6 and acceptance.next > 0.9
    assert acceptance.gain(4) > 0.7 * acceptance.gain(1)  # (one rate, 0.6 or so, would say a fifth)
    for _ in range(10):
        acceptance.record(4, 0)
    assert acceptance.first < 0.2  # the text moved on


def test_a_draft_rows_bad_words_read_the_drafts_before_it(tiny_qwen2_dir):
    """"eam\x02" is two tokens of the tiny preset (403, 193), which its greedy text
    after this prompt writes again and again: after a draft of 403, the next row
    must ban 193 as a plain decode after 403 does (a row that read its output
    without the drafts took 193 there, and the tokens differed)."""
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True, bad_words=["eam\x02"])
    outputs = []
    for config in (CONFIG, SPECULATING):
        engine = Engine(tiny_qwen2_dir, config)
        engine.add_request([7, 8, 9] * 9, params, "r")
        outputs.append(_finish(engine)["r"].token_ids)
    assert engine.tokenizer.encode("eam\x02", add_special_tokens=False) == [403, 193]
    assert outputs[0] == outputs[1] and engine.num_accepted_draft_tokens > 0
