"""Response bodies and SSE chunks of SGLang's `/generate`.

One request answers `{"text", "output_ids", "meta_info"}`; a batch (or `n` > 1)
answers a list of them, prompt i's choice j at i * n + j, and streams chunks that
each carry their place in that list as `index` (SGLang's shapes). A streamed chunk
carries the request's whole text and ids so far, not a delta, and so its
meta_info: with `return_logprob`, the logprobs so far too (SGLang's default).

Logprobs in meta_info, as SGLang gives them: `output_token_logprobs` [logprob, id,
text] a generated token, `output_top_logprobs` the `top_logprobs_num` best of each
as [logprob, id, text]; with `logprob_start_len` >= 0 the prompt's from there,
`input_token_logprobs` (its logprob None for the prompt's first token) and
`input_top_logprobs`. The text is None unless the body asks for
`return_text_in_logprobs`: then each token's own decoding. SGLang's clients unpack
three (`logprob, token_id, text = entry`); two-element entries broke them.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cluster.openai_format import sse
from cluster.response_streams import Collected, merged

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Answered:
    """What one request's meta_info describes, besides what it generated."""

    rid: str
    prompt_ids: list[int]
    logprob_start_len: int  # -1: the prompt's last token alone, whose entry has no logprob (SGLang's default)
    top_logprobs_num: int
    token_text: Callable[[int], str] | None = None  # return_text_in_logprobs: a token id's text, else None
    prompt_only: bool = False  # max_new_tokens 0: the one token generated is dropped (`GenerateBody.prompts_only`)

    def entry(self, logprob: float | None, token_id: int) -> list:
        """One logprob entry: [logprob, id, text or None]."""
        return [logprob, token_id, self.token_text(token_id) if self.token_text else None]


def meta_info(answered: Answered, num_tokens: int, reason: str | None, num_cached: int,
              logprobs: list | None = None, prompt_logprobs: list | None = None,
              matched: int | str | None = None) -> dict:
    if answered.prompt_only:
        num_tokens, logprobs = 0, None if logprobs is None else []
        reason = "length" if reason in ("stop", "length") else reason  # (its one token's end; an abort stays one)
    # SGLang's finish_reason: null until the request ends (clients test it for the last chunk); one ended for
    # its length says how long, one that stopped what matched (a stop token's id, EOS's too, or a stop string)
    finish = None if reason is None else {"type": reason}
    if reason == "length":
        finish["length"] = num_tokens
    elif reason == "stop" and matched is not None:
        finish["matched"] = matched
    meta = {"id": answered.rid, "prompt_tokens": len(answered.prompt_ids), "completion_tokens": num_tokens,
            "cached_tokens": num_cached, "finish_reason": finish}
    top = answered.top_logprobs_num
    entry = answered.entry
    if logprobs is not None:
        meta["output_token_logprobs"] = [entry(lp.logprob, lp.token_id) for lp in logprobs]
        if top:
            meta["output_top_logprobs"] = [[entry(v, t) for t, v in lp.top[:top]] for lp in logprobs]
    if prompt_logprobs is not None:
        # From `logprob_start_len`, the first entry's logprob None whatever its position, as SGLang pads it (its
        # frontend's choice scores average the values that are not None: one more changed them)
        start = answered.logprob_start_len
        wanted = [None, *prompt_logprobs[start + 1:]] if start < len(prompt_logprobs) else []
        meta["input_token_logprobs"] = [entry(lp.logprob if lp else None, answered.prompt_ids[start + i])
                                        for i, lp in enumerate(wanted)]
        if top:
            meta["input_top_logprobs"] = [[entry(v, t) for t, v in lp.top[:top]] if lp else None for lp in wanted]
    elif logprobs is not None:  # logprob_start_len -1: SGLang starts at the prompt's last token, padded None
        # (its frontend's `select` reads them for its unconditional scores: a KeyError where they were left out)
        meta["input_token_logprobs"] = [entry(None, answered.prompt_ids[-1])]
        if top:
            meta["input_top_logprobs"] = [None]
    return meta


def result(out: Collected, answered: Answered) -> dict:
    """One request's whole answer."""
    meta = meta_info(answered, len(out.token_ids), out.finish_reason, out.num_cached_tokens, out.logprobs,
                     out.prompt_logprobs, out.stop_matched)
    if answered.prompt_only:
        return {"text": "", "output_ids": [], "meta_info": meta}
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


async def stream(streams: list, answered: list[Answered], indexed: bool):
    """Each request's chunks as its events come (`indexed`: each says which
    request, a batch's way), then `[DONE]`; a worker's error ends the stream with
    an error chunk (closing it aborts every request still running), and so does
    an error of this server's own on the way (logged here): it cut the stream,
    with no error and no `[DONE]`, as the OpenAI streams' did (cluster/completions.py)."""
    chunks = [CumulativeChunks() for _ in streams]
    logprobs: list[list | None] = [None] * len(streams)  # each request's so far, if it asked
    prompt_logprobs: list[list | None] = [None] * len(streams)
    async with contextlib.aclosing(merged(streams)) as events:
        try:
            async for k, event in events:
                if event.error:
                    yield sse({"error": {"message": event.error, "type": "worker_error", "param": None, "code": 500}})
                    break
                if not answered[k].prompt_only:
                    chunks[k].add(event.text, event.token_ids)
                if event.logprobs is not None:  # extended in place: a copy an event would be quadratic
                    logprobs[k] = logprobs[k] if logprobs[k] is not None else []
                    logprobs[k].extend(event.logprobs)
                prompt_logprobs[k] = prompt_logprobs[k] or event.prompt_logprobs
                reason = event.finish_reason if event.finished else None
                meta = meta_info(answered[k], chunks[k].num_tokens, reason, event.num_cached_tokens, logprobs[k],
                                 prompt_logprobs[k], event.stop_matched)
                yield chunks[k].sse(meta, k if indexed else None)
        except Exception as exc:  # noqa: BLE001 - said in the stream, logged here
            log.exception("request %s: its stream failed", answered[0].rid)
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "internal_error",
                                 "param": None, "code": 500}})
    yield sse("[DONE]")
