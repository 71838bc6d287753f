"""OpenAI response formatting: vLLM's prompt_logprobs entries."""

from __future__ import annotations

from actors.request import TokenLogprob
from cluster import openai_format as fmt


class _Letters:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_prompt_logprobs_name_each_prompt_token_and_the_best_by_id():
    logprobs = [None, TokenLogprob(3, -2.5, [(1, -0.5), (3, -2.5), (0, -3.0)], rank=2),
                TokenLogprob(4, -7.0, [(0, -0.1), (2, -1.0), (1, -4.0)], rank=40)]
    entries = fmt.prompt_logprobs(_Letters(), logprobs, num_top=2)
    assert entries[0] is None
    assert entries[1] == {3: {"logprob": -2.5, "rank": 2, "decoded_token": "d"},
                          1: {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}
    assert list(entries[2]) == [4, 0, 2] and entries[2][4]["rank"] == 40 and entries[2][2]["rank"] == 2
    completion = fmt.completion_body("id", "m", [("x", "length", None)] * 2, {}, False, [entries, entries], created=0)
    assert all(choice["prompt_logprobs"] == entries for choice in completion["choices"])
    chat = fmt.completion_body("id", "m", [("x", "length", None)] * 2, {}, True, [entries], created=0)
    assert chat["prompt_logprobs"] == entries and all("prompt_logprobs" not in c for c in chat["choices"])


def test_a_request_aborted_before_or_during_its_prefill_has_what_came_of_its_prompt_logprobs():
    """/abort_request before the prompt's logprobs came (P/D: before D's
    handshake), or mid-prefill (colocated: those of the chunks not computed are
    None): each was a 500 (a TypeError, an AttributeError) for the whole answer."""
    assert fmt.prompt_logprobs(_Letters(), None, num_top=1) is None
    partial = [None, TokenLogprob(3, -2.5, [(3, -2.5)], rank=1), None, None]
    assert fmt.prompt_logprobs(_Letters(), partial, num_top=1) == [
        None, {3: {"logprob": -2.5, "rank": 1, "decoded_token": "d"}}, None, None]
