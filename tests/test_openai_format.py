"""Response formatting: the kept-encoded cumulative `/generate` chunks are byte for
byte what encoding the whole payload gives."""

from __future__ import annotations

import random

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
