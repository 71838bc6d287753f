"""Repetition, frequency and presence penalties (kernels/penalties.py): the batched
kernel against a token-by-token reference, and the engine's greedy tokens against
transformers' `generate` (float32) with its own `repetition_penalty` and, for the
OpenAI penalties, a logits processor written here from OpenAI's definition; through
chunked prefill, overlapped decode and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from actors.config import EngineConfig
from actors.engine import Engine
from actors.sampling_params import InvalidRequestError, SamplingParams
from kernels.penalties import TokenCounts, penalise_, reference_penalties
from tests.conftest import hf_model

NEW_TOKENS = 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_penalties_equal_the_reference_row_by_row(dtype):
    rng = random.Random(7)
    vocab = 97
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows = [0, 3, 4, 8]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in rows]
    outputs = [[rng.randrange(vocab) for _ in range(n)] for n in (0, 5, 40, 17)]
    repetition, frequency, presence = [1.3, 1.0, 0.6, 2.0], [0.0, 1.5, -0.5, 0.2], [2.0, 0.0, 1.0, -2.0]
    counts = []
    for prompt, output, r in zip(prompts, outputs, repetition):
        counts.append(TokenCounts(prompt if r != 1 else ()))
        for token in output:  # kept up to date a token at a time, as the engine does
            counts[-1].add_output(token)
    out = logits.clone()
    penalise_(out, rows, counts, repetition, frequency, presence)
    for i, row in enumerate(rows):
        want = reference_penalties(logits[row], prompts[i], outputs[i], repetition[i], frequency[i], presence[i])
        torch.testing.assert_close(out[row], want.to(dtype))  # the dtype's default tolerance
    untouched = [r for r in range(9) if r not in rows]
    assert torch.equal(out[untouched], logits[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pending_token_counted_on_the_device_equals_counting_it_on_the_host(dtype):
    """What overlapped decode relies on: penalties over a row's counts, then its
    uncounted last token added on the device (new, in the prompt only, in the output
    already; repetition on and off), equal the penalties with the token counted."""
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)).to(dtype)
    logits[5, 7] = -torch.inf  # a banned token stays banned
    prompts = [[1, 2, 3], [1, 2, 3], [4, 4], [], [9, 10], [7]]
    outputs = [[5, 5, 6], [5, 6], [8], [11, 11], [12], [3]]
    pending = [5, 2, 30, 11, 9, 7]  # in the output, the prompt only, new, output (repetition off), prompt, banned
    repetition, frequency, presence = [1.3, 0.7, 2.0, 1.0, 1.2, 1.5], [0.5, -1.0, 0.0, 2.0, 0.3, 1.0], \
        [1.0, 0.4, -2.0, 0.5, 0.0, 1.0]
    rows = list(range(6))

    def counted(output_of):
        counts = []
        for prompt, output, r in zip(prompts, output_of, repetition):
            counts.append(TokenCounts(prompt if r != 1 else ()))
            for token in output:
                counts[-1].add_output(token)
        return counts

    on_host = logits.clone()
    penalise_(on_host, rows, counted([o + [t] for o, t in zip(outputs, pending)]), repetition, frequency, presence)
    on_device = logits.clone()
    uncounted = [0, 1, 2, 3, 4, 5]
    penalise_(on_device, rows, counted(outputs), repetition, frequency, presence, torch.tensor(pending), uncounted)
    torch.testing.assert_close(on_device, on_host)
    some = logits.clone()  # only some rows' tokens uncounted: the others' counts are whole
    whole = [o + [t] if i in (0, 3) else o for i, (o, t) in enumerate(zip(outputs, pending))]
    penalise_(some, rows, counted(whole), repetition, frequency, presence, torch.tensor(pending), [1, 2, 4, 5])
    torch.testing.assert_close(some, on_host)
    first = logits[:1].clone()  # nothing counted yet: the first output token, uncounted
    penalise_(first, [0], [TokenCounts()], [1.0], [0.5], [1.0], torch.tensor([8]), [0])
    expected, eight = logits[:1].clone(), TokenCounts()
    eight.add_output(8)
    penalise_(expected, [0], [eight], [1.0], [0.5], [1.0])
    torch.testing.assert_close(first, expected)
    assert on_device[5, 7] == -torch.inf


def test_token_counts_are_the_distinct_ids_and_output_counts():
    counts = TokenCounts([5, 3, 5, 9])
    for token in (9, 1, 9, 12, 1, 9):
        counts.add_output(token)
    assert counts.ids.tolist() == [1, 3, 5, 9, 12] and counts.counts.tolist() == [2, 0, 0, 3, 1]
    assert counts.num_output == 6


def test_out_of_range_penalties_are_refused():
    for bad in (dict(repetition_penalty=0), dict(repetition_penalty=11), dict(frequency_penalty=2.5),
                dict(presence_penalty=-3)):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties


class _OpenAIPenalties:
    """OpenAI's frequency and presence penalties as an HF logits processor: each
    logit minus frequency x the token's count in the output so far, minus presence
    if it is there at all."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            for token, count in zip(*ids[self.num_prompt:].unique(return_counts=True)):
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def _hf(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([_OpenAIPenalties(len(prompt), params.frequency_penalty,
                                                       params.presence_penalty)])
    with torch.no_grad():
        out = hf_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0, repetition_penalty=params.repetition_penalty,
            logits_processor=processors)
    return out[0, len(prompt):].tolist()


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency+presence": dict(frequency_penalty=1.2, presence_penalty=0.7),
    "all three": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4),
}
ENGINES = {
    "chunked": dict(block_size=16, prefill_chunk_size=32),
    "overlap": dict(block_size=16, prefill_chunk_size=64, overlap_decode=True),
    "preempting": dict(block_size=16, prefill_chunk_size=64, num_kv_blocks=14),
}


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_greedy_with_penalties_matches_transformers(tiny_model_dir, engine_name):
    rng = random.Random(11)
    engine = Engine(tiny_model_dir, EngineConfig(**ENGINES[engine_name]))
    vocab = engine.model_config.vocab_size
    # Short prompts of few distinct tokens, so greedy decoding repeats itself and
    # the penalties change what it picks.
    prompts = [[rng.randrange(3, 40) for _ in range(n)] for n in (5, 40, 70)]
    requests = {}
    for prompt in prompts:
        for name, penalties in CASES.items():
            params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **penalties)
            requests[engine.add_request(prompt, params)] = (prompt, params)
    plain = {engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)): p
             for p in prompts}
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    for request_id, (prompt, params) in requests.items():
        assert done[request_id] == _hf(tiny_model_dir, prompt, params), (len(prompt), params)
        assert all(0 <= t < vocab for t in done[request_id])
    changed = sum(done[r] != done[p] for r, (prompt, _) in requests.items() for p, q in plain.items() if q == prompt)
    assert changed >= len(requests) - 1  # the penalties do change greedy decoding here
    if engine_name == "preempting":
        assert engine.scheduler.num_preemptions > 0
    engine.pool.check()
