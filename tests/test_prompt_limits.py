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
from cluster.prompt_limits import prompt_ids_within_limits

PROMPT = [10 + i % 2000 for i in range(3000)]  # 3000 ids (the vocabulary has 2048)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_checkpoint("tiny", "qwen2"))


@pytest.mark.parametrize("limits, max_model_len, kept", [
    (dict(max_prompt_tokens=600, max_new_tokens=100), 2048, 600),  # the prompt limit
    (dict(max_prompt_tokens=4000, max_new_tokens=100), 2048, 2047),  # the context, one token left to generate
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
