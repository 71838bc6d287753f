"""SGLang's `/generate` formatting: the kept-encoded cumulative chunks are byte for
byte what encoding the whole payload gives, a batch's `index` included; logprob
entries are SGLang's triples; a stream failing on the server's side says so."""

from __future__ import annotations

import asyncio
import json
import random
import time

from actors.messages import TokenEvent
from actors.request import TokenLogprob
from cluster.openai_format import sse
from cluster.sglang_format import Answered, CumulativeChunks, meta_info, stream

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


def test_logprob_entries_are_sglangs_triples_with_text_when_asked():
    """[logprob, token id, text]: None for the text unless return_text_in_logprobs
    (then each token's own text); the prompt's first token has no logprob."""
    generated = [TokenLogprob(7, -0.5, top=[(7, -0.5), (9, -1.5)]), TokenLogprob(3, -2.0, top=[(4, -1.0), (3, -2.0)])]
    prompt = [None, TokenLogprob(6, -3.0, top=[(1, -0.1), (6, -3.0)])]
    plain = meta_info(Answered("r", [5, 6], 0, 2), 2, "length", 0, generated, prompt)
    assert plain["output_token_logprobs"] == [[-0.5, 7, None], [-2.0, 3, None]]
    assert plain["output_top_logprobs"] == [[[-0.5, 7, None], [-1.5, 9, None]], [[-1.0, 4, None], [-2.0, 3, None]]]
    assert plain["input_token_logprobs"] == [[None, 5, None], [-3.0, 6, None]]
    assert plain["input_top_logprobs"] == [None, [[-0.1, 1, None], [-3.0, 6, None]]]
    named = meta_info(Answered("r", [5, 6], 1, 1, token_text=lambda t: f"<{t}>"), 2, "length", 0, generated, prompt)
    assert named["output_token_logprobs"] == [[-0.5, 7, "<7>"], [-2.0, 3, "<3>"]]
    assert named["output_top_logprobs"] == [[[-0.5, 7, "<7>"]], [[-1.0, 4, "<4>"]]]
    # Found by a review: from logprob_start_len 1, the first entry's logprob was the token's, where SGLang's is None
    assert named["input_token_logprobs"] == [[None, 6, "<6>"]] and named["input_top_logprobs"] == [None]


def test_the_default_logprob_start_len_gives_the_prompts_last_token_padded():
    """-1, SGLang's default, starts at the prompt's last token (its entry None):
    the keys were left out, and SGLang's frontend `select`, which sends
    `return_logprob` alone for its unconditional scores, read a missing key."""
    generated = [TokenLogprob(7, -0.5, top=[(7, -0.5)])]
    plain = meta_info(Answered("r", [5, 6], -1, 0), 1, "length", 0, generated)
    assert plain["input_token_logprobs"] == [[None, 6, None]] and "input_top_logprobs" not in plain
    top = meta_info(Answered("r", [5, 6], -1, 1, token_text=lambda t: f"<{t}>"), 1, "length", 0, generated)
    assert top["input_token_logprobs"] == [[None, 6, "<6>"]] and top["input_top_logprobs"] == [None]
    scored = meta_info(Answered("r", [5, 6], -1, 0, prompt_only=True), 1, "stop", 0, generated)
    assert scored["output_token_logprobs"] == [] and scored["input_token_logprobs"] == [[None, 6, None]]
    assert "input_token_logprobs" not in meta_info(Answered("r", [5, 6], -1, 0), 1, "length", 0)  # (none asked)


def test_a_chunk_before_the_last_has_no_finish_reason():
    """SGLang's meta_info.finish_reason is null until the request ends (clients
    test it for the last chunk); `{"type": null}` read as an end at the first."""
    running = meta_info(Answered("r", [5, 6], 0, 2), 1, None, 0)
    assert running["finish_reason"] is None
    assert meta_info(Answered("r", [5, 6], 0, 2), 2, "length", 0)["finish_reason"] == {"type": "length", "length": 2}
    assert meta_info(Answered("r", [5, 6], 0, 2), 2, "stop", 0)["finish_reason"] == {"type": "stop"}
    for matched in (151645, "\n\n"):  # (SGLang's: a stop token's id, EOS's too, or the stop string)
        finish = meta_info(Answered("r", [5, 6], 0, 2), 2, "stop", 0, matched=matched)["finish_reason"]
        assert finish == {"type": "stop", "matched": matched}


def test_a_prompt_alone_answers_no_output():
    """`max_new_tokens: 0` (SGLang's frontend scores choices so): the one token
    generated is dropped, the prompt's logprobs kept."""
    generated, prompt = [TokenLogprob(7, -0.5)], [None, TokenLogprob(6, -3.0)]
    meta = meta_info(Answered("r", [5, 6], 0, 0, prompt_only=True), 1, "stop", 0, generated, prompt)
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and meta["input_token_logprobs"] == [[None, 5, None], [-3.0, 6, None]]
    aborted = meta_info(Answered("r", [5, 6], 0, 0, prompt_only=True), 0, "abort", 0)  # (it stays an abort)
    assert aborted["finish_reason"] == {"type": "abort"}


def test_a_stream_that_fails_on_this_servers_side_ends_with_an_error_chunk_and_done():
    """An error of the server's own while formatting (here a token's text for its
    logprobs) cut the stream with no error and no [DONE]; now it is said in the
    stream, as the OpenAI streams do, and the request's events are closed."""
    closed = []

    async def events():
        try:
            yield TokenEvent("r", [7], "a", [TokenLogprob(7, -0.5, top=[])], False, None, time.time(), 0)
            yield TokenEvent("r", [8], "b", [TokenLogprob(8, -0.5, top=[])], False, None, time.time(), 0)
        finally:
            closed.append(True)

    def token_text(token_id):
        if token_id == 8:
            raise KeyError(token_id)
        return "a"

    async def run():
        answered = [Answered("r", [5, 6], -1, 0, token_text=token_text)]
        return [line async for line in stream([events()], answered, indexed=False)]

    lines = asyncio.run(run())
    assert json.loads(lines[0].removeprefix("data: "))["text"] == "a"
    assert json.loads(lines[1].removeprefix("data: "))["error"]["message"] == "internal error: KeyError"
    assert lines[2] == sse("[DONE]") and len(lines) == 3 and closed
