"""Response bodies and SSE chunks of SGLang's `/generate`.

One request answers `{"text", "output_ids", "meta_info"}`; a batch (or `n` > 1)
answers a list of them, prompt i's choice j at i * n + j, and streams chunks that
each carry their place in that list as `index` (SGLang's shapes). A streamed chunk
carries the request's whole text and ids so far, not a delta.
"""

from __future__ import annotations

import contextlib
import json

from cluster.openai_format import sse
from cluster.response_streams import Collected, merged


class CumulativeChunks:
    """SGLang's streamed `/generate` chunks each carry the whole text and output ids
    so far. Encoding them anew every event cost O(length) of JSON work an event,
    quadratic in the output: 36 us an event at 256 tokens, 234 us at 2048 (a
    one-off probe). This keeps both already encoded and appends each event's
    encoded delta, so an event costs a copy (6-8 us at those lengths); the bytes
    are the same as `sse` of the whole payload (JSON escapes each character alone,
    so the escaped text is the concatenation of its pieces' escapes)."""

    def __init__(self) -> None:
        self._text = ""  # JSON-escaped, without the quotes
        self._ids = ""  # comma-separated
        self.num_tokens = 0

    def add(self, text: str, token_ids: list[int]) -> None:
        if text:
            self._text += json.dumps(text)[1:-1]
        if token_ids:
            joined = ",".join(map(str, token_ids))
            self._ids = f"{self._ids},{joined}" if self._ids else joined
            self.num_tokens += len(token_ids)

    def sse(self, meta_info: dict, index: int | None = None) -> str:
        """`sse({"text": <all text>, "output_ids": <all ids>, "meta_info": meta_info})`,
        with `"index": index` last when one is given."""
        place = "" if index is None else f',"index":{index}'
        return ('data: {"text":"' + self._text + '","output_ids":[' + self._ids + '],"meta_info":'
                + json.dumps(meta_info, separators=(",", ":")) + place + "}\n\n")


def meta_info(rid: str, num_prompt: int, num_tokens: int, reason: str | None, num_cached: int,
              logprobs: list | None = None) -> dict:
    meta = {"id": rid, "prompt_tokens": num_prompt, "completion_tokens": num_tokens, "cached_tokens": num_cached,
            "finish_reason": {"type": reason}}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in logprobs]
    return meta


def result(out: Collected, prompt_ids: list[int], rid: str, logprob_start_len: int, top_logprobs_num: int) -> dict:
    """One request's whole answer. With the prompt's logprobs (SGLang's
    `logprob_start_len` >= 0): [logprob, id] a position from there (None for the
    prompt's first token), and the `top_logprobs_num` best of each."""
    meta = meta_info(rid, len(prompt_ids), len(out.token_ids), out.finish_reason, out.num_cached_tokens,
                     out.logprobs)
    if out.prompt_logprobs is not None:
        wanted = out.prompt_logprobs[logprob_start_len:]
        meta["input_token_logprobs"] = [[lp.logprob if lp else None, prompt_ids[logprob_start_len + i]]
                                        for i, lp in enumerate(wanted)]
        if top_logprobs_num:
            meta["input_top_logprobs"] = [[[v, t] for t, v in lp.top] if lp else None for lp in wanted]
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


async def stream(streams: list, num_prompt_tokens: list[int], rids: list[str], indexed: bool):
    """Each request's chunks as its events come (`indexed`: each says which
    request, a batch's way), then `[DONE]`; a worker's error ends the stream with
    an error chunk (closing it aborts every request still running)."""
    chunks = [CumulativeChunks() for _ in streams]
    async with contextlib.aclosing(merged(streams)) as events:
        async for k, event in events:
            if event.error:
                yield sse({"error": {"message": event.error, "type": "worker_error"}})
                break
            chunks[k].add(event.text, event.token_ids)
            reason = event.finish_reason if event.finished else None
            meta = meta_info(rids[k], num_prompt_tokens[k], chunks[k].num_tokens, reason, event.num_cached_tokens)
            yield chunks[k].sse(meta, k if indexed else None)
    yield sse("[DONE]")
