"""SGLang's `/generate` formatting: the kept-encoded cumulative chunks are byte for
byte what encoding the whole payload gives, a batch's `index` included."""

from __future__ import annotations

import random

from cluster.openai_format import sse
from cluster.sglang_format import CumulativeChunks

PIECES = ["the", " cat", "é", "\u2603", '"q"', "\\", "\n", "\t", "\x00", "\U0001f642", "</script>", "", "\ud7ff",
          " tok"]


def test_cumulative_chunks_match_encoding_the_whole_payload():
    rng = random.Random(0)
    for _ in range(50):
        chunks = CumulativeChunks()
        text, ids = "", []
        for step in range(rng.randrange(1, 40)):
            delta = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 4)))
            new_ids = [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 4))]
            chunks.add(delta, new_ids)
            text, ids = text + delta, ids + new_ids
            meta = {"id": None, "completion_tokens": len(ids), "finish_reason": {"type": None if step else "length"}}
            assert chunks.sse(meta) == sse({"text": text, "output_ids": ids, "meta_info": meta})
            index = rng.randrange(64)
            assert chunks.sse(meta, index) == sse({"text": text, "output_ids": ids, "meta_info": meta, "index": index})
            assert chunks.num_tokens == len(ids)
