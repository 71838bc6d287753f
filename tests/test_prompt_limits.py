"""A prompt against the deployment's limits, with the tiny preset's tokenizer:
vLLM's truncate_prompt_tokens of -1 keeps as many tokens as this request can be
served with, whichever limit is the tightest."""

from __future__ import annotations

import pytest

from actors.model_builder import ensure_checkpoint
from actors.sampling_params import SamplingParams
from actors.tokenization import load_tokenizer
from cluster.api_models import ApiError
from cluster.config import LimitSettings
from cluster.prompt_limits import fitted_output, prompt_ids_within_limits

PROMPT = [10 + i % 2000 for i in range(3000)]  # 3000 ids (the vocabulary has 2048)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_checkpoint("tiny", "qwen2"))


@pytest.mark.parametrize("limits, max_model_len, kept", [
    (dict(max_prompt_tokens=600, max_new_tokens=100), 2048, 600),  # the prompt limit
    (dict(max_prompt_tokens=4000, max_new_tokens=100), 2048, 1998),  # the context, with room for the 50 new
    (dict(max_prompt_tokens=4000, max_new_tokens=100, max_total_tokens=1000), 2048, 950),  # prompt + 50 new
])
def test_keeping_the_most_a_request_can_be_served_with(tokenizer, limits, max_model_len, kept):
    params = SamplingParams(max_new_tokens=50)
    ids = prompt_ids_within_limits(tokenizer, LimitSettings(**limits), max_model_len, PROMPT, params, keep_last=-1)
    assert ids == PROMPT[-kept:]
    with pytest.raises(ApiError, match="the limit is|the model's context"):
        prompt_ids_within_limits(tokenizer, LimitSettings(**limits), max_model_len, PROMPT, params)


def test_no_room_for_the_output_is_refused_for_the_output(tokenizer):
    limits = LimitSettings(max_prompt_tokens=600, max_new_tokens=100, max_total_tokens=40)
    with pytest.raises(ApiError, match="prompt plus the new tokens asked for is 51 tokens; the limit is 40"):
        prompt_ids_within_limits(tokenizer, limits, 2048, PROMPT, SamplingParams(max_new_tokens=50), keep_last=-1)


def test_an_output_length_left_out_is_held_to_the_room_an_asked_one_is_not(tokenizer):
    """vLLM sizes an omitted max_tokens to the room the prompt leaves, and refuses
    an asked-for one past it; so here, under the context and max_total_tokens."""
    limits = LimitSettings(max_prompt_tokens=4000, max_new_tokens=500, max_total_tokens=1000)
    prompt = PROMPT[:900]
    default = SamplingParams(max_new_tokens=500, max_new_tokens_is_default=True)
    assert prompt_ids_within_limits(tokenizer, limits, 2048, prompt, default) == prompt
    assert fitted_output(limits, 2048, len(prompt), default).max_new_tokens == 100  # the total's room
    assert fitted_output(limits, 950, len(prompt), default).max_new_tokens == 50  # the context's
    assert fitted_output(limits, 2048, 10, default) is default  # room for all of it
    with pytest.raises(ApiError, match="prompt plus the new tokens asked for is 1400 tokens; the limit is 1000"):
        prompt_ids_within_limits(tokenizer, limits, 2048, prompt, SamplingParams(max_new_tokens=500))
    with pytest.raises(ApiError, match="900 tokens and the request asks for up to 51 new tokens: 951 tokens, "
                                       "past the model's context of 950"):
        prompt_ids_within_limits(tokenizer, limits, 950, prompt, SamplingParams(max_new_tokens=51))
    at_least = SamplingParams(max_new_tokens=500, min_new_tokens=120, max_new_tokens_is_default=True)
    with pytest.raises(ApiError, match="prompt plus the new tokens asked for is 1020 tokens"):
        prompt_ids_within_limits(tokenizer, limits, 2048, prompt, at_least)  # min_new_tokens has no room


def test_an_id_the_model_does_not_know_is_refused_at_the_ingress(tokenizer):
    """A tokenizer with more entries than the model's vocabulary (added tokens past
    `vocab_size`): the ingress took the tokenizer's count, and an id past the
    model's was refused by P's engine, after D had reserved for it."""
    limits = LimitSettings(max_prompt_tokens=600, max_new_tokens=100)
    assert len(tokenizer) == 2048
    params = SamplingParams(max_new_tokens=4)
    assert prompt_ids_within_limits(tokenizer, limits, 2048, [5, 1999], params, vocab_size=2000) == [5, 1999]
    with pytest.raises(ApiError, match=r"prompt token ids must be in \[0, 2000\)"):
        prompt_ids_within_limits(tokenizer, limits, 2048, [5, 2000], params, vocab_size=2000)
    with pytest.raises(ApiError, match="logit_bias token id 2000 is outside the vocabulary"):
        prompt_ids_within_limits(tokenizer, limits, 2048, [5], SamplingParams(max_new_tokens=4, logit_bias={2000: 1}),
                                 vocab_size=2000)


def test_truncation_keeps_room_for_an_output_asked_for_not_for_a_default(tokenizer):
    """truncate_prompt_tokens -1 keeps the most prompt the request can be served
    with: room for the new tokens asked for, or, where they were left out, for
    one (the default is then fitted to what is left)."""
    limits = LimitSettings(max_prompt_tokens=4000, max_new_tokens=1024)
    default = SamplingParams(max_new_tokens=1024, max_new_tokens_is_default=True)
    assert len(prompt_ids_within_limits(tokenizer, limits, 2048, PROMPT, default, keep_last=-1)) == 2047
    asked = SamplingParams(max_new_tokens=1024)
    assert len(prompt_ids_within_limits(tokenizer, limits, 2048, PROMPT, asked, keep_last=-1)) == 1024
