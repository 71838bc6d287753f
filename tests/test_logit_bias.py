"""logit_bias (OpenAI's), allowed_token_ids and min_new_tokens (vLLM's
min_tokens): the kernels against plain indexing, and what the engine does with them
(a token forced or banned, only the allowed ones sampled, stop tokens and strings
held off until the minimum)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actors.config import EngineConfig
from actors.engine import Engine
from actors.logit_rules import LogitRules
from actors.sampling_params import InvalidRequestError, SamplingParams
from kernels.logit_bias import add_logit_bias_, keep_only_

GREEDY = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def test_bias_adds_to_the_named_entries_and_a_repeated_token_gets_the_sum():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    want[1, 3] += 5.0
    want[1, 7] -= 2.5
    want[3, 0] = -math.inf
    out = logits.clone()
    add_logit_bias_(out, [1, 2, 3], [[3, 7], [], np.array([0, 0])], [[5.0, -2.5], [], np.array([100.0, -math.inf])])
    assert torch.equal(out, want)


def test_a_row_its_bans_would_leave_with_nothing_keeps_what_it_had():
    """Bans that cover every token a row may still take (a pattern's one way on is a
    stop id under min_new_tokens, say) would leave it nothing to draw: a row of
    minus infinities samples an arbitrary id. That row is left as it was before
    them; the other rows take theirs."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    logits[0, 2:] = -math.inf  # row 0 may take 0 and 1 alone
    want = logits.clone()
    want[1, 4] = -math.inf
    out = logits.clone()
    add_logit_bias_(out, [0, 1], [[0, 1, 5], [4]], [[-math.inf, -math.inf, 3.0], [-math.inf]])
    assert torch.equal(out, want)


def test_a_requests_rules_give_each_draw_its_bias_and_bans():
    params = SamplingParams(logit_bias={9: 2.0, 4: -1.0}, allowed_token_ids=[8, 3], min_new_tokens=2)
    rules = LogitRules.of(params, {7, 5})
    assert rules.allowed_ids.tolist() == [3, 8]
    ids, values = rules.additions(num_output=1, bad_word_ids=[6])  # under the minimum of 2
    assert list(zip(ids.tolist(), values.tolist())) == [(4, -1.0), (9, 2.0), (5, -math.inf), (7, -math.inf),
                                                        (6, -math.inf)]
    ids, values = rules.additions(num_output=2)
    assert list(zip(ids.tolist(), values.tolist())) == [(4, -1.0), (9, 2.0)]


def test_keep_only_bans_every_other_entry_of_the_named_rows():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    want[1, [0, 1, 3, 4, 6, 7, 8, 9]] = -math.inf
    want[3, 1:] = -math.inf
    out = logits.clone()
    keep_only_(out, [1, 2, 3], [[2, 5], [], [0]])  # row 2: no list, left as it is
    assert torch.equal(out, want)


def test_bad_bias_and_minimum_are_refused(tiny_qwen2_dir):
    with pytest.raises(InvalidRequestError, match="logit_bias values"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(InvalidRequestError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)
    engine = Engine(tiny_qwen2_dir, EngineConfig(num_kv_blocks=32))
    with pytest.raises(InvalidRequestError, match="logit_bias token id 99999"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token id 99999"):
        engine.add_request([1, 2, 3], SamplingParams(allowed_token_ids=[5, 99999]))
    eos = engine.model_config.eos_token_ids[0]
    with pytest.raises(InvalidRequestError, match="allowed_token_ids are all banned"):
        engine.add_request([1, 2, 3], SamplingParams(allowed_token_ids=[eos], min_new_tokens=2))


def _greedy(engine: Engine, prompt: list[int], **params) -> tuple[list[int], str, str]:
    request_id = engine.add_request(prompt, SamplingParams(**{**GREEDY, **params}))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                result = (out.token_ids, out.text, out.finish_reason.value)
    return result


@pytest.mark.parametrize("overlap", [False, True])
def test_a_bias_forces_or_bans_a_token(tiny_qwen2_dir, overlap):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16, overlap_decode=overlap))
    prompt = [11, 12, 13, 14]
    plain, _, _ = _greedy(engine, prompt)
    forced, _, _ = _greedy(engine, prompt, logit_bias={42: 100.0})
    assert forced == [42] * len(plain)
    banned, _, _ = _greedy(engine, prompt, logit_bias={t: -100.0 for t in set(plain)})
    assert not set(banned) & set(plain)
    engine.pool.check()


def test_only_allowed_tokens_are_sampled(tiny_qwen2_dir):
    """Greedy picks the best allowed token (allowing all of the free output changes
    nothing); sampling draws only allowed ones; a bias still counts among them."""
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16))
    prompt = [31, 32, 33, 34]
    plain, _, _ = _greedy(engine, prompt)
    assert _greedy(engine, prompt, allowed_token_ids=sorted(set(plain)) + [7])[0] == plain
    allowed = [t for t in range(100, 200) if t not in plain][:3]
    restricted, _, _ = _greedy(engine, prompt, allowed_token_ids=allowed)
    sampled, _, _ = _greedy(engine, prompt, allowed_token_ids=allowed, temperature=1.0, seed=4, max_new_tokens=40)
    assert set(restricted) <= set(allowed) and set(sampled) <= set(allowed) and len(set(sampled)) > 1
    assert _greedy(engine, prompt, allowed_token_ids=allowed, logit_bias={allowed[1]: 100.0})[0] == [allowed[1]] * 12
    engine.pool.check()


def test_stop_tokens_and_strings_wait_for_min_new_tokens(tiny_qwen2_dir):
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16))
    prompt = [21, 22, 23]
    plain, plain_text, _ = _greedy(engine, prompt, max_new_tokens=30)
    stop_token = plain[2]
    early, _, reason = _greedy(engine, prompt, max_new_tokens=30, stop_token_ids=[stop_token])
    assert reason == "stop" and len(early) == plain.index(stop_token) + 1
    held, _, _ = _greedy(engine, prompt, max_new_tokens=30, stop_token_ids=[stop_token], min_new_tokens=8)
    assert len(held) > 8 and stop_token not in held[:8]  # banned until 8 tokens are out
    assert held[-1] == stop_token or len(held) == 30
    # A stop string found in the first tokens' text does not end the request either.
    stop_string = plain_text[:3]
    cut, text, reason = _greedy(engine, prompt, max_new_tokens=30, stop=[stop_string])
    assert reason == "stop" and len(cut) < 30
    kept, kept_text, _ = _greedy(engine, prompt, max_new_tokens=30, stop=[stop_string], min_new_tokens=10)
    assert len(kept) >= 10 and kept[:10] == plain[:10]
    engine.pool.check()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bad_word_that_bans_every_allowed_token_gives_way_to_them(tiny_qwen2_dir, temperature):
    """allowed_token_ids "a" and the bad word "aa": from the second draw on the ban
    covers every allowed token (a first draw so banned is refused when the request
    comes). The draws keep to the allowed token; before, they took EOS or the last
    id of the vocabulary every other token."""
    engine = Engine(tiny_qwen2_dir, EngineConfig(block_size=16))
    [a] = engine.tokenizer.encode("a", add_special_tokens=False)
    assert engine.tokenizer.encode("aa", add_special_tokens=False) == [a, a]
    tokens, text, _ = _greedy(engine, [5, 6, 7], max_new_tokens=6, allowed_token_ids=[a], bad_words=["aa"],
                              temperature=temperature, seed=3)
    assert tokens == [a] * 6 and text == "a" * 6
    engine.pool.check()
