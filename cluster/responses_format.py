"""A chat answer written as an OpenAI Responses API response (cluster/responses_body.py
says how the request became a chat one): the message's reasoning, text and calls
as output items (`reasoning`, `message` with one `output_text` part, a
`function_call` per call), the usage in the Responses names, and `status`
"incomplete" where the answer was cut: by its limit (`incomplete_details.reason`
"max_output_tokens"), or by `/abort_request` ("abort", SGLang's name for that
finish; the chat answer's finish reason is null then).

Streamed, the chat chunks become the Responses events, each an SSE `event:` line
and its JSON with a `sequence_number`: `response.created` (a background one's
`queued`, then `response.queued`, as it waits to be admitted), `response.in_progress`,
then for each item `response.output_item.added`, its part's
`response.content_part.added`, the deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`), their
`.done`s and `response.output_item.done`, and last `response.completed` (or
`response.incomplete`) holding the whole response, the same one a request without
`stream` gets; a worker's failure mid-stream ends it with `response.failed`. No
`[DONE]` line: the Responses stream ends with its last event.

Text the model wrote after a call streams as a message item after that call
(text in the same chunk as a call is put before it: a chat delta does not say
which came first); unstreamed, an answer's text is one message before its calls,
as chat's message holds it. Sent back as input, either is the same chat turn
(cluster/responses_body.py joins text after a turn's calls to it).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid

CUT = "length"  # the chat finish reason of an answer its token limit cut
ABORTED = None  # the chat finish reason of an answer /abort_request ended (OpenAI's null)


FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")  # a stream's last, with its response


def is_final_event(event: str) -> bool:
    """Whether a streamed event (`ResponseEvents._event`'s text) is its stream's last."""
    return event.startswith(tuple(f"event: {kind}\n" for kind in FINAL_EVENTS))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def usage(chat_usage: dict | None) -> dict | None:
    """Chat's usage in the Responses names."""
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat_usage.get("completion_tokens_details", {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def ending(finish_reason: str | None) -> tuple[str, str | None]:
    """A finished chat answer's status as a response, and why it is incomplete (None where it is not)."""
    if finish_reason == CUT:
        return "incomplete", "max_output_tokens"
    if finish_reason == ABORTED:
        return "incomplete", "abort"
    return "completed", None


def response(body, response_id: str, model: str, created: int, status: str, output: list[dict],
             chat_usage: dict | None = None, error: dict | None = None, incomplete: str | None = None) -> dict:
    """The response object: the answer, and the request's settings as OpenAI
    echoes them; `incomplete`: why an incomplete one is (`ending`)."""
    text = body.text or {"format": {"type": "text"}}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": usage(chat_usage), "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete is not None else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning or {"effort": None, "summary": None}, "store": body.stores,
        "temperature": body.temperature, "top_p": body.top_p, "text": text,
        "tool_choice": body.tool_choice or "auto", "tools": body.function_tools(),
        "truncation": body.truncation or "disabled", "user": body.user, "metadata": body.metadata or {},
        "background": body.background,
        "conversation": None if body.conversation_id is None else {"id": body.conversation_id},
    }


def whole(body, completion: dict, response_id: str | None = None, created: int | None = None) -> dict:
    """A chat completion (one choice) as the response (a new id, unless it has
    one: a background response's); where it was cut, its last item is
    incomplete (the ones before it were written whole)."""
    choice = completion["choices"][0]
    message = choice["message"]
    status, incomplete = ending(choice["finish_reason"])
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        logprobs = ((choice.get("logprobs") or {}).get("content") or []) if body.wants_logprobs else None
        output.append(message_item(new_id("msg"), message.get("content") or "", "completed", logprobs))
    output += [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
               for c in calls]
    output[-1]["status"] = status
    return response(body, response_id or new_id("resp"), completion["model"], created or completion["created"],
                    status, output, completion["usage"], incomplete=incomplete)


class ResponseEvents:
    """The Responses events of one streamed chat choice's chunks (`stream`);
    `keep`, given the final response, stores it and answers it as stored
    (cluster/stored_responses.py), before the last event."""

    def __init__(self, body, model: str, keep=None, response_id: str | None = None, created: int | None = None) -> None:
        self.body, self.model, self.keep = body, model, keep
        self.created_sent = False  # `response.created` went out (`queued_events`: a background response's)
        self.response_id, self.created = response_id or new_id("resp"), created or int(time.time())
        self.sequence = 0
        self.items: list[dict] = []  # the output so far; the last is open while `open` is True
        self.open = False
        self.calls: dict[int, int] = {}  # a chat call's index -> its item's output index
        self.logprobs: list = []  # the open message's, and any that came before its text
        self.finish_reason: str | None = None
        self.chat_usage: dict | None = None

    async def stream(self, chunks):
        """SSE events for `chunks`, the chat stream's payloads (chunk dicts, an
        `{"error": ...}` payload, "[DONE]")."""
        if not self.created_sent:
            yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        async with contextlib.aclosing(chunks):  # (a client that leaves ends its request)
            async for chunk in chunks:
                if chunk == "[DONE]":
                    break
                if "error" in chunk:
                    error = {"code": "server_error", "message": chunk["error"].get("message", "")}
                    for event in self._close("incomplete"):
                        yield event
                    yield self._event("response.failed", response=await self._final("failed", error))
                    return
                self.chat_usage = chunk.get("usage") or self.chat_usage
                for choice in chunk.get("choices", ()):
                    for event in self._choice(choice):
                        yield event
        status, incomplete = ending(self.finish_reason)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            for event in self._text("message", ""):  # (an empty answer is an empty message, as unstreamed)
                yield event
        for event in self._close(status):
            yield event
        yield self._event(f"response.{status}", response=await self._final(status, incomplete=incomplete))

    async def refused(self, error: dict):
        """The events of a response refused as it was to start (a background
        one's: its POST has answered already): created, then its failure. The
        failure alone, at sequence 0, broke the OpenAI SDK's stream helper
        ("Expected to have received response.created before response.failed")."""
        if not self.created_sent:
            yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.failed", response=await self._final("failed", error))

    def queued_events(self) -> list[str]:
        """A background response's first events, sent as its POST answers, before
        it is admitted: `response.created` and `response.queued`, the response
        `queued` (as OpenAI opens a background stream); `stream` or `refused`
        go on from them."""
        self.created_sent = True
        return [self._event(kind, response=self._response("queued"))
                for kind in ("response.created", "response.queued")]

    async def _final(self, status: str, error: dict | None = None, incomplete: str | None = None) -> dict:
        final = self._response(status, error, incomplete)
        return final if self.keep is None else await self.keep(final)

    def _choice(self, choice: dict):
        delta = choice.get("delta") or {}
        if self.body.wants_logprobs:
            self.logprobs += (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            yield from self._call(call)
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _text(self, kind: str, text: str):
        """Text of a reasoning or message item, opening one where the open item is another."""
        if not (self.open and self.items[-1]["type"] == kind):
            yield from self._close("completed")
            item = (message_item(new_id("msg"), "", "in_progress", [] if self.body.wants_logprobs else None)
                    if kind == "message"
                    else reasoning_item(new_id("rs"), "", "in_progress"))
            part = item["content"].pop()  # (the item is announced without its part, then the part)
            yield from self._add(item)
            item["content"].append(part)
            yield self._event("response.content_part.added", **self._where(), content_index=0, part=part)
        item = self.items[-1]
        if not text:
            return
        item["content"][0]["text"] += text
        if kind == "message":
            logprobs, self.logprobs = self.logprobs, []
            yield self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                              logprobs=logprobs)
            if self.body.wants_logprobs:
                item["content"][0]["logprobs"] += logprobs
        else:
            yield self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def _call(self, call: dict):
        function = call.get("function") or {}
        if call["index"] not in self.calls:
            yield from self._close("completed")
            self.calls[call["index"]] = len(self.items)
            yield from self._add(call_item(new_id("fc"), call["id"], function["name"], "", "in_progress"))
        arguments = function.get("arguments")
        if arguments:
            item = self.items[self.calls[call["index"]]]
            item["arguments"] += arguments
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.calls[call["index"]], delta=arguments)

    def _add(self, item: dict):
        self.items.append(item)
        self.open = True
        yield self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _close(self, status: str):
        """The open item's `.done` events."""
        if not self.open:
            return
        self.open = False
        item = self.items[-1]
        item["status"] = status
        where = self._where()
        if item["type"] == "function_call":
            yield self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                if self.body.wants_logprobs:  # (with those of tokens whose text never came)
                    part["logprobs"] += self.logprobs
                    self.logprobs = []
                yield self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=part.get("logprobs", []))
            else:
                yield self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield self._event("response.content_part.done", **where, content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _response(self, status: str, error: dict | None = None, incomplete: str | None = None) -> dict:
        running = status in ("queued", "in_progress")
        return response(self.body, self.response_id, self.model, self.created, status, [] if running else self.items,
                        None if running else self.chat_usage, error, incomplete)

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
