"""How sampled tokens become a request's output: each appended with its logprob and
time, then the ends checked in order (a stop token, a stop string, a pattern
matched with nothing more allowed, the length), then the text the request's
pattern fixes next written after it (jump-forward). A drafted decode's samples
are taken while its drafts confirm them (actors/speculation.py).

The engine owns the requests and calls in; the writer mutates a request's output
fields and, when one ends, hands it to the scheduler (`Scheduler.finish` frees
its blocks). Plain Python: no tensors, nothing that blocks.
"""

from __future__ import annotations

from actors.detokenizer import ByteLevelTables
from actors.request import FinishReason, Request, TokenLogprob
from actors.scheduler import Scheduler


class OutputWriter:
    def __init__(self, tokenizer, byte_level: ByteLevelTables | None, scheduler: Scheduler, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.byte_level = byte_level
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def take_drawn(self, request: Request, token_id: int, logprob: TokenLogprob | None, now: float) -> None:
        """A drawn token (this engine's, or P's first), then the text its pattern fixes after it."""
        self._append(request, token_id, logprob, now)
        self._jump_forward(request, now)

    def take_confirmed(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob | None] | None,
                       now: float) -> int:
        """A drafted decode's samples that stand: all but the last are the drafts they
        confirmed (their KV computed by the step), the last is the sample after them.
        Each is taken as a plain decode's token would be, until one ends the request or
        its pattern fixes the text after one: jump-forward writes that text there, as
        after a plain decode's token, and the samples after it are dropped (the drafter
        proposes none past such a token). Each draft is counted computed (its full
        blocks published) before the next token is taken, as a plain decode's token is
        by the step after it: counted after the loop, the drafts before a token that
        ended the request were never published (the next turn's prefix hit a block
        short). The number of drafts taken into the output."""
        for i, token_id in enumerate(token_ids):
            self._append(request, token_id, logprobs and logprobs[i], now)
            if request.is_finished:
                break
            if i < len(token_ids) - 1:  # a draft that stood (the last is the sample after them)
                self.scheduler.accept_drafts(request, 1)
            if self._jump_forward(request, now):  # (text that may end the request: its blocks gone then)
                break
        return min(i + 1, len(token_ids) - 1)

    def finish(self, request: Request, reason: FinishReason, text: str | None = None) -> None:
        """End a request: its final text (the whole detokenized output unless a stop
        string cut it) and its blocks back to the pool. The tail the detokenizer
        held back (an incomplete character, as U+FFFD) is checked for stop strings
        as each token's text is (an aborted request's aside: it stays aborted): it
        was not, and a stop string in it ended the request for its length, the
        stop string in its text."""
        tail = request.detokenizer.flush()
        if text is None and tail and request.stop_strings is not None and reason is not FinishReason.ABORT:
            dropped = request.stop_strings.feed(tail)
            if dropped is not None and len(request.output_token_ids) > request.params.min_new_tokens:
                text = request.detokenizer.text_between(0, request.detokenizer.num_chars - dropped)
                reason = FinishReason.STOP
                request.stop_matched = request.stop_strings.matched
        request.output_text = request.detokenizer.text if text is None else text
        request.finish_reason = reason
        self.scheduler.finish(request)

    def _jump_forward(self, request: Request, now: float) -> bool:
        """Append the text a request's pattern fixes next (a JSON key with its quotes
        and colon, the rest of a choice) as tokens no step samples: the next step
        computes their KV as one chunk and samples after them, as SGLang's
        jump-forward decoding does (SGLang re-tokenizes the text joined to the last
        tokens; here the fixed text is tokenized alone). Only for requests that jump
        forward (`Request.jumps_forward`), and not where the tokenizer would not give
        the text's bytes back. Whether it wrote any."""
        if request.is_finished or not request.jumps_forward:
            return False
        text = request.constraint.forced_text(request.output_token_ids)
        if not text:
            return False
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if b"".join(self.byte_level.without_special[t] for t in ids) != text.encode() or any(
                t in request.stop_token_ids for t in ids):  # (a stop id would end it short of a match)
            return False
        for token_id in ids:
            self._append(request, token_id, None, now)
            if request.is_finished:
                break
        return True

    def _append(self, request: Request, token_id: int, logprob: TokenLogprob | None, now: float) -> None:
        params = request.params
        output_ids = request.output_token_ids
        output_ids.append(token_id)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.first_token_s is None:
            request.first_token_s = now
        request.token_times_s.append(now)

        may_stop = len(output_ids) > params.min_new_tokens
        if may_stop and token_id in request.stop_token_ids:
            if params.include_stop_str_in_output:  # its text ends the output, as vLLM's (an end token's is none)
                request.detokenizer.add(token_id)
            request.stop_matched = token_id
            return self.finish(request, FinishReason.STOP)
        delta = request.detokenizer.add(token_id)
        if request.stop_strings is not None and delta:  # (fed before min_new_tokens too: a match may begin there)
            dropped = request.stop_strings.feed(delta)
            if dropped is not None and may_stop:
                cut = request.detokenizer.num_chars - dropped
                request.stop_matched = request.stop_strings.matched
                return self.finish(request, FinishReason.STOP, request.detokenizer.text_between(0, cut))
        if request.constraint is not None and request.constraint.is_complete(output_ids):
            return self.finish(request, FinishReason.STOP)  # the pattern is matched and allows no more
        if len(output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            return self.finish(request, FinishReason.LENGTH)
