"""Response formatting: the kept-encoded cumulative `/generate` chunks are byte for
byte what encoding the whole payload gives; vLLM's prompt_logprobs entries."""

from __future__ import annotations

import random

from actors.request import TokenLogprob
from cluster import openai_format as fmt

PIECES = ["the", " cat", "é", "\u2603", '"q"', "\\", "\n", "\t", "\x00", "\U0001f642", "</script>", "", "\ud7ff", " tok"]


def test_cumulative_chunks_match_encoding_the_whole_payload():
    rng = random.Random(0)
    for _ in range(50):
        chunks = fmt.CumulativeChunks()
        text, ids = "", []
        for step in range(rng.randrange(1, 40)):
            delta = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 4)))
            new_ids = [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 4))]
            chunks.add(delta, new_ids)
            text, ids = text + delta, ids + new_ids
            meta = {"id": None, "completion_tokens": len(ids), "finish_reason": {"type": None if step else "length"}}
            assert chunks.sse(meta) == fmt.sse({"text": text, "output_ids": ids, "meta_info": meta})
            assert chunks.num_tokens == len(ids)


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
    completion = fmt.completion_body("id", "m", [("x", "length", None)] * 2, {}, False, [entries, entries])
    assert all(choice["prompt_logprobs"] == entries for choice in completion["choices"])
    chat = fmt.completion_body("id", "m", [("x", "length", None)] * 2, {}, True, [entries])
    assert chat["prompt_logprobs"] == entries and all("prompt_logprobs" not in c for c in chat["choices"])
