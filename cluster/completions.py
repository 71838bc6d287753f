"""OpenAI's completions and chat completions, answered: one request per prompt and
choice, admitted before any response starts, then read to a whole body or turned
into chunks as their tokens come (tool calls and reasoning split off a chat's
text). The ingress (cluster/app.py) checks a body and gives its params and
prompt ids; /generate starts its requests here too (`start_choices`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid

from actors.detokenizer import ByteLevelTables
from actors.request import TokenLogprob
from cluster import openai_format as fmt
from cluster.api_models import ApiError, ChatBody, choice_params
from cluster.client_call import current_call
from cluster.reasoning import Reasoning, ReasoningDeltas, Thought, num_reasoning_tokens, split
from cluster.response_streams import collect, merged, prepend
from cluster.tool_calls import StreamedCalls, chat_answer

log = logging.getLogger("tandem.scheduler")


def _failed(task: asyncio.Future) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


class Completions:
    def __init__(self, service, tokenizer, model_name: str, tool_format) -> None:
        self.service = service  # the GlobalScheduler: generate(prompt_ids, params, request_id)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.tool_format = tool_format  # how the model writes tool calls (cluster/tool_calls.py)
        tables = ByteLevelTables.of(tokenizer)  # each token's own bytes, for chat logprobs (None: not byte-level)
        self.token_bytes = tables.with_special if tables is not None else None

    async def answer(self, body, prompts: list, params, prompt_ids: list[list[int]], chat: bool,
                     reasoning: Reasoning | None = None, stream_as=None, rid: str | None = None):
        """One request per prompt and choice (`n`), choice k being prompt k // n's
        choice k % n, as OpenAI numbers them (see `start_choices`); `params` and
        `prompt_ids`: the body's, checked; `reasoning`: a chat answer's reasoning
        is split off (cluster/reasoning.py); `stream_as`: what a stream's chunk
        payloads become as the answer (OpenAI's chunks as SSE by default); `rid`:
        the name `/abort_request` knows its requests by (the completion's id
        unless given: a response's id)."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = fmt.created_now()  # (once: every chunk and the body say when the request came)
        per_choice, n = choice_params(params, body.n), body.n
        streams = await self.start_choices([(prompt_ids[k // n], per_choice[k % n],
                                             f"{request_id}-{k}" if k else request_id, rid or request_id)
                                            for k in range(len(prompts) * n)], n)
        num_prompt = sum(len(ids) for ids in prompt_ids)
        echoed = prompts if body.truncate_prompt_tokens is None else prompt_ids  # a truncated prompt: its ids' text
        echo = [(lambda out, k=k: self._echoed(echoed[k // n], prompt_ids[k // n], out, body.prompt_only,
                                               body.logprobs))
                for k in range(len(streams))] if not chat and body.echo else None
        if body.stream:
            writers = [self._chat_deltas(body, reasoning) for _ in streams] if chat else None
            chunks = self._chunks(streams, request_id, created, chat, num_prompt, body.include_usage, echo, writers,
                                  tuple(body.stop_token_ids or ()), reasoning, n)
            return stream_as(chunks) if stream_as is not None else fmt.sse_response(fmt.sse_stream(chunks))
        results = await self.collect_all(streams)
        if echo is not None:
            results = [echo[k](out) for k, out in enumerate(results)]
        as_logprobs = functools.partial(fmt.chat_logprobs, token_bytes=self.token_bytes) if chat \
            else fmt.completion_logprobs
        texts, reasons = [out.text for out in results], [fmt.finish_reason(out.finish_reason) for out in results]
        calls = thoughts = None
        if chat:  # a message's reasoning (cluster/reasoning.py), text and calls (cluster/tool_calls.py)
            thoughts = [split(text, reasoning.opened) if reasoning else Thought(None, text) for text in texts]
            answers = [chat_answer(thought.content, reason, body.tools, body.tool_choice,
                                   body.parallel_tool_calls, self.tool_format)
                       for thought, reason in zip(thoughts, reasons)]
            texts, calls, reasons = zip(*answers)
        choices = [(text, reason, as_logprobs(self.tokenizer, out.logprobs))
                   for text, reason, out in zip(texts, reasons, results)]
        num_cached = sum(out.num_cached_tokens for out in results[::n])  # (each prompt once, as num_prompt)
        usage = fmt.usage(num_prompt, sum(len(out.token_ids) for out in results), num_cached,
                          self._reasoning_tokens(reasoning, [out.token_ids for out in results]))
        prompt_logprobs = None if body.prompt_logprobs is None else [
            fmt.prompt_logprobs(self.tokenizer, out.prompt_logprobs, body.prompt_logprobs)
            for out in (results[:1] if chat else results)]  # a chat's choices share their prompt
        stop_ids, eos = tuple(body.stop_token_ids or ()), self.service.eos_token_ids
        stop_reasons = [fmt.stop_reason(out.finish_reason, out.stop_matched, stop_ids, eos) for out in results]
        return fmt.completion_body(request_id, self.model_name, choices, usage, chat, prompt_logprobs, calls,
                                   [t.reasoning for t in thoughts] if reasoning else None, created=created,
                                   stop_reasons=stop_reasons)

    def _chat_deltas(self, body: ChatBody, reasoning: Reasoning | None):
        """What writes a streamed chat choice's deltas where they are not its text
        as it comes: tool calls, reasoning (None: the text)."""
        calls = StreamedCalls.of(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_format)
        return ReasoningDeltas(reasoning, calls) if reasoning is not None else calls

    async def start_choices(self, requests: list[tuple], n: int) -> list:
        """`_start` (prompt ids, params, request id[, client rid: what
        `/abort_request` knows it by]) each, request k being a prompt's choice
        k % n. Each prompt's first choice is admitted first; its others start once
        it is routed, on its pair (`GlobalScheduler._plan`), planned with its prefix
        in prefill there (`PoolView.cached_tokens`): P computes the prompt once, the
        others waiting for its blocks (`Scheduler._waits_for_prefix`), and sends it
        to D once, the others borrowing its blocks on their way
        (actors/arriving_blocks.py). Started after the first's first token, as SGLang
        starts them after a prefill of the prompt alone, they waited for that token's
        way back and a handshake more (all four choices' first tokens 20 ms later on
        the tiny model: docs/benchmarks.md, session 61). vLLM starts all at once, and
        under P/D computes and sends the prompt n times (vllm-project/vllm#39647).
        All are admitted before any response starts; the first refused or failed
        ends the call at once, those started closed with it (no waiting for the
        others' first tokens), and those that never started count as withdrawn (or
        cancelled, where the client left), as the closed ones do: an n=3 call
        refused at its first choice counted one request."""
        keys = range(len(requests))
        call = current_call()  # (one record for all of them, where no HTTP call opened one)
        loop = asyncio.get_running_loop()
        begun: set[int] = set()  # the requests whose `_start` ran: each counts its own outcome

        async def start(k: int, **how):
            begun.add(k)
            return await self._start(*requests[k], **how)

        routed = {k: loop.create_future() for k in keys if k % n == 0}  # each prompt's first choice
        starts = {k: asyncio.ensure_future(start(k, routed=routed[k])) for k in routed}
        try:
            for k, first_routed in routed.items():  # (a first refused, or failed unrouted, ends its `_start`)
                await asyncio.wait((first_routed, starts[k]), return_when=asyncio.FIRST_COMPLETED)
            if not any(_failed(task) for task in starts.values()):  # (each first routed: none refused or failed)
                pairs = {k: (first.result().prefill_id, first.result().decode_id) for k, first in routed.items()}
                starts.update((k, asyncio.ensure_future(start(k, pair=pairs[k - k % n]))) for k in keys if k % n)
            await asyncio.wait(starts.values(), return_when=asyncio.FIRST_EXCEPTION)
            for task in starts.values():  # (one failed: the call fails, the others need not reach a first token)
                task.cancel()
            results = dict(zip(starts, await asyncio.gather(*starts.values(), return_exceptions=True)))
        except BaseException:  # (cancelled: its client left while they started)
            for task in starts.values():
                task.cancel()
            await self._close_started(await asyncio.gather(*starts.values(), return_exceptions=True),
                                      len(requests) - len(begun), call.withdrawn)
            raise
        failures = [r for r in results.values() if isinstance(r, BaseException)]
        if failures:  # (the one that ended the call, not a CancelledError of those closed for it)
            await self._close_started(results.values(), len(requests) - len(begun), call.withdrawn)
            raise next((f for f in failures if not isinstance(f, asyncio.CancelledError)), failures[0])
        return [results[k] for k in keys]

    async def _close_started(self, started, num_never_started: int, withdrawn: bool) -> None:
        """A call's requests closed, those that failed aside, and those that never
        started counted as the closed ones count themselves: withdrawn where one of
        the call's was refused or failed, else cancelled (`ClientCall`)."""
        await asyncio.gather(*(s.aclose() for s in started if not isinstance(s, BaseException)))
        if num_never_started:
            self.service.metrics.inc("requests_total", "requests by outcome", num_never_started,
                                     outcome="withdrawn" if withdrawn else "cancelled")

    @staticmethod
    async def collect_all(streams) -> list:
        """Every request read to its end; if one fails (or the client leaves), the
        others stop too."""
        collecting = [asyncio.ensure_future(collect(s)) for s in streams]
        try:
            return await asyncio.gather(*collecting)
        finally:
            for task in collecting:
                task.cancel()

    def _echoed(self, prompt, prompt_ids: list[int], out, prompt_only: bool, num_top: int | None):
        """A completion (a `Collected`, or a streamed choice's first `TokenEvent`)
        with its prompt in front, OpenAI's echo: the prompt's text and, with
        logprobs, its tokens' (None for the first; `num_top` best each, however
        many prompt_logprobs asked for); prompt_only drops the one token generated."""
        prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
        if prompt_only:
            out = out._replace(text="", token_ids=[], finish_reason="length",
                               logprobs=[] if out.logprobs is not None else None)
        logprobs = out.logprobs
        if logprobs is not None:
            first = TokenLogprob(prompt_ids[0], None, [])
            prompt_logprobs = [dataclasses.replace(lp, top=lp.top[:num_top]) for lp in (out.prompt_logprobs or [])[1:]]
            logprobs = [first, *prompt_logprobs, *logprobs]
        return out._replace(text=prompt_text + out.text, logprobs=logprobs)

    async def _start(self, prompt_ids, params, request_id, client_rid="", routed=None, pair=None):
        """Admission happens here, before any response starts: rejections and
        early failures keep their HTTP status even for streaming requests
        (`routed`, `pair`: see `GlobalScheduler.generate`)."""
        events = self.service.generate(prompt_ids, params, request_id, client_rid, routed, pair)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "request produced no output", kind="internal_error") from None
        if first.error:
            await events.aclose()
            raise ApiError(503, f"request failed: {first.error}", kind="service_unavailable")
        return prepend(first, events)

    def _reasoning_tokens(self, reasoning: Reasoning | None, answers: list[list[int]]) -> int | None:
        """The answers' reasoning tokens, where the manifest names a reasoning parser."""
        if reasoning is None:
            return None
        return sum(num_reasoning_tokens(self.tokenizer, ids, reasoning.opened) for ids in answers)

    async def _chunks(self, streams, request_id, created: int, chat, num_prompt, include_usage, echo=None,
                      writers=None, stop_ids: tuple[int, ...] = (), reasoning: Reasoning | None = None, n: int = 1):
        """Every choice's events as they come, as chunk payloads (then "[DONE]"),
        each chunk naming its choice; `echo[k]` rewrites choice k's first event
        (see `_echoed`); `writers[k]`, where not None, writes choice k's deltas
        (`_chat_deltas`); `reasoning`: how a chat answer starts, for the usage's
        reasoning tokens; `n`: the choices of each prompt (choice k is prompt
        k // n's). An error of this server's own on the way ends the stream as a
        worker's error does (an error chunk, the usage, "[DONE]"): it was cut
        short, with neither."""
        num_tokens, first = 0, [True] * len(streams)
        cached = [0] * -(-len(streams) // n)  # each prompt's cached tokens, from its first choice (as num_prompt)
        answers: list[list[int]] = [[] for _ in streams]  # each choice's tokens, for its reasoning's count
        token_chars = [0] * len(streams)  # the length of each choice's token texts so far (its next text_offset)
        async with contextlib.aclosing(merged(streams)) as events:
            try:
                async for index, event in events:
                    if event.error:
                        yield {"error": {"message": event.error, "type": "worker_error", "param": None,
                                         "code": 500}}  # (a 500 body)
                        break
                    if first[index] and echo is not None:
                        event = echo[index](event)
                    num_tokens += len(event.token_ids)
                    if reasoning is not None and include_usage:
                        answers[index] += event.token_ids
                    if index % n == 0:
                        cached[index // n] = event.num_cached_tokens
                    reason = fmt.finish_reason(event.finish_reason) if event.finished else None
                    delta = None
                    writer = writers[index] if writers is not None else None
                    if writer is not None:
                        delta, reason = writer.delta(event.text, event.finished), writer.finish_reason(reason)
                        if delta is None and not first[index] and not event.logprobs:
                            continue
                        delta = delta or {}
                    # (a token's text may come later; a writer's held-back text comes with an abort's
                    # last event, which has no text and no finish reason of OpenAI's)
                    if event.text or reason or first[index] or event.logprobs or delta:
                        if chat:
                            logprobs = fmt.chat_logprobs(self.tokenizer, event.logprobs, self.token_bytes)
                        else:
                            logprobs = fmt.completion_logprobs(self.tokenizer, event.logprobs, token_chars[index])
                            token_chars[index] += sum(map(len, logprobs["tokens"])) if logprobs else 0
                        matched = fmt.stop_reason(event.finish_reason if reason else None, event.stop_matched,
                                                  stop_ids, self.service.eos_token_ids)
                        yield fmt.completion_chunk(request_id, self.model_name, event.text, reason, logprobs, chat,
                                                   first[index], index, delta, created=created, stop_reason=matched)
                        first[index] = False
            except Exception as exc:  # noqa: BLE001 - said in the stream, logged here
                log.exception("request %s: its stream failed", request_id)
                yield {"error": {"message": f"internal error: {type(exc).__name__}", "type": "internal_error",
                                 "param": None, "code": 500}}
        if include_usage:
            yield {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": self.model_name, "choices": [],
                   "usage": fmt.usage(num_prompt, num_tokens, sum(cached), self._reasoning_tokens(reasoning, answers))}
        yield "[DONE]"
