"""Response bodies and SSE chunks in the OpenAI shapes (SGLang's: cluster/sglang_format.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import time

from fastapi.responses import StreamingResponse


def sse_response(lines) -> StreamingResponse:
    """An HTTP answer streaming `lines` (SSE text) as they come."""
    return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_stream(payloads):
    """`payloads` (an async generator of chunks) as SSE lines; closed with them (a
    client that leaves ends its requests)."""
    async with contextlib.aclosing(payloads):
        async for payload in payloads:
            yield sse(payload)


def usage(num_prompt: int, num_completion: int, num_cached: int = 0, num_reasoning: int | None = None) -> dict:
    """OpenAI's usage; `num_reasoning` (a reasoning parser's count of the completion's
    reasoning tokens) as `completion_tokens_details.reasoning_tokens`."""
    counts = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
    if num_reasoning is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": num_reasoning}
    return counts


def completion_logprobs(tokenizer, logprobs, text_offset: int = 0) -> dict | None:
    """A completion choice's logprobs, OpenAI's legacy shape: per token its text,
    logprob, best alternatives (`_top_logprobs`) and text_offset, where its text
    starts in the choice's text: the offsets run over the token texts, from
    `text_offset` (the length of the token texts a stream's earlier chunks gave),
    as vLLM counts them (a character whose bytes span two tokens counts in each; a
    stop string cut from the text still counts)."""
    if logprobs is None:
        return None
    tokens = [tokenizer.decode([lp.token_id]) for lp in logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],  # None: an echoed prompt's first token
        "top_logprobs": [None if lp.logprob is None else _top_logprobs(tokenizer, text, lp)
                         for text, lp in zip(tokens, logprobs)],
        "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=text_offset)) if tokens else [],
    }


def _top_logprobs(tokenizer, text: str, logprob) -> dict[str, float]:
    """The chosen token (its `text`) and the n best, by text: the legacy API always
    gives the chosen token's logprob there too, so up to n + 1 entries (vLLM's
    likewise). Where two tokens decode to one text, the chosen one's stays."""
    top = {text: logprob.logprob}
    for token_id, value in logprob.top:
        top.setdefault(tokenizer.decode([token_id]), value)
    return top


def chat_logprobs(tokenizer, logprobs, token_bytes: list[bytes] | None = None) -> dict | None:
    """OpenAI's chat `logprobs.content`: each token's text, logprob, bytes and the n
    best. `token_bytes`: each token id's own bytes (a byte-level tokenizer's,
    actors/detokenizer.py `ByteLevelTables`), so that a token holding part of a
    character (an emoji, a CJK character split in two) gives its bytes, from which
    a client rebuilds the text, not the replacement character's (239, 191, 189)
    its text alone decodes to; without them, its text's."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        own = token_bytes is not None and token_id < len(token_bytes)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes[token_id] if own else text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def prompt_logprobs(tokenizer, logprobs, num_top: int) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each
    token, by id, its logprob, rank and text, and so for the `num_top` best.
    None for a request aborted before its prompt's came, and None for each
    token one aborted mid-prefill had not reached (a 500 had answered either)."""
    def described(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    if logprobs is None:
        return None
    entries = [None]
    for lp in logprobs[1:]:
        if lp is None:
            entries.append(None)
            continue
        entry = {lp.token_id: described(lp.token_id, lp.logprob, lp.rank)}
        for rank, (token_id, logprob) in enumerate(lp.top[:num_top], 1):
            entry.setdefault(token_id, described(token_id, logprob, rank))
        entries.append(entry)
    return entries


def completion_body(request_id, model, choices: list[tuple], usage_dict, chat: bool,
                    prompt_logprobs: list | None = None, tool_calls: list | None = None,
                    reasoning: list | None = None, *, created: int, stop_reasons: list | None = None) -> dict:
    """A whole response; `choices`: (text, finish reason, logprobs) each, in index
    order; `prompt_logprobs`: each choice's (`prompt_logprobs`), where vLLM puts them:
    on each completion choice, once on a chat response (its choices share a prompt);
    `tool_calls`: each chat choice's, or None where it answered with text
    (cluster/tool_calls.py); a chat choice's text is its message's content (null
    beside calls, or the text around them); `reasoning`: each chat choice's
    `reasoning_content` where the server parses reasoning (cluster/reasoning.py);
    `created`: when the request came (`created_now`), as on each of its chunks;
    `stop_reasons`: each choice's vLLM `stop_reason` (`stop_reason`)."""
    if chat:
        calls = tool_calls or [None] * len(choices)
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": i, "message": _message(text, calls[i]), "finish_reason": reason,
                             "logprobs": logprobs}
                            for i, (text, reason, logprobs) in enumerate(choices)],
                "usage": usage_dict}
        for choice, thought in zip(body["choices"], reasoning or ()):
            choice["message"]["reasoning_content"] = thought
        for choice, matched in zip(body["choices"], stop_reasons or ()):
            choice["stop_reason"] = matched
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs[0]
        return body
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs}
                        for i, (text, reason, logprobs) in enumerate(choices)],
            "usage": usage_dict}
    for choice, entries in zip(body["choices"], prompt_logprobs or ()):
        choice["prompt_logprobs"] = entries
    for choice, matched in zip(body["choices"], stop_reasons or ()):
        choice["stop_reason"] = matched
    return body


def _message(text: str | None, tool_calls: list | None) -> dict:
    if tool_calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text, "tool_calls": tool_calls}


def completion_chunk(request_id, model, text, finish_reason, logprobs, chat: bool, first: bool = False,
                     index: int = 0, delta: dict | None = None, *, created: int,
                     stop_reason: int | str | None = None) -> dict:
    """One streamed event of a choice; `delta`: a chat delta's fields in place of
    {"content": text} (a tool call's, cluster/tool_calls.py); `created`: the
    request's, the same on every chunk (OpenAI's: "each chunk has the same
    timestamp"; each read the clock, and a stream that crossed a second changed it);
    `stop_reason`: the last chunk's vLLM `stop_reason` (`stop_reason`)."""
    if chat:
        delta = {"content": text} if delta is None else dict(delta)
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def stop_reason(finish_reason: str | None, matched: int | str | None, stop_token_ids,
                eos_token_ids=()) -> int | str | None:
    """vLLM's `stop_reason` of a choice the engine ended for "stop" (read as tool
    calls after or not): the stop string, or the id of the request's own stop
    token, that ended it; None for the model's end token (listed among the stop
    tokens too), and for any other end (`matched`: `TokenEvent.stop_matched`)."""
    if finish_reason != "stop" or matched is None:
        return None
    if isinstance(matched, str):
        return matched
    return matched if matched in stop_token_ids and matched not in eos_token_ids else None


def created_now() -> int:
    """A completion's `created`: the Unix time in whole seconds."""
    return int(time.time())


def finish_reason(event_reason: str | None) -> str | None:
    """Engine reasons to OpenAI's: length and stop pass through; abort/error -> None."""
    return event_reason if event_reason in ("length", "stop") else None
