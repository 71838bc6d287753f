"""A step the model runner enqueued, and reading its tokens back: on CUDA the
sampled ids stay on the device (the next step's input when decode overlaps) and
the host's copies arrive asynchronously in pinned memory, read once the step's
event says they are there."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.request import Request, TokenLogprob


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host; from CUDA an asynchronous one into pinned memory (read it
    after the step's `ready` event)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass
class LaunchedStep:
    """A step enqueued on the device: the requests it samples for, in row order (a
    request verifying drafts has consecutive rows), and their tokens once the
    device has them. `token_ids` stays on the device: the next step's input,
    before the host has seen it."""

    requests: list[Request]
    started: float
    token_ids: torch.Tensor | None = None  # [rows] int64, on the device
    host: list[torch.Tensor] = field(default_factory=list)  # token ids[, chosen logprobs[, top ids, top logprobs]]
    ready: torch.cuda.Event | None = None  # recorded after the copies to `host` (CUDA)
    # A step launched ahead with rows that read their output (`Request.reads_output`):
    # its logits, the output index each row samples and its input ids, until the host
    # has read the tokens before and `ModelRunner.sample_deferred` samples it.
    unsampled: tuple[torch.Tensor, list[int], torch.Tensor] | None = None
    # Rows of such a step whose input token was followed by more than the row
    # expected (jump-forward's text, written when the host read it): their tokens
    # are dropped, and the run of steps launched ahead ends.
    stale_rows: frozenset[int] = frozenset()
    prompt_parts: list = field(default_factory=list)  # prompt logprobs computed (see `_prompt_logprobs`)

    def tokens(self) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """The token id of each row (`requests`' order) and, when any row asked for
        logprobs, each row's `TokenLogprob` (None for rows that did not); waits for
        the device. Plain lists, not a record a row: this runs for every request
        every step. Fills in the prompt logprobs the step computed."""
        if self.ready is not None and (self.requests or self.prompt_parts):
            self.ready.synchronize()
        for request, first, host in self.prompt_parts:
            chosen, ranks, *top = (t.tolist() for t in host)
            num_top = request.params.prompt_logprobs
            for i, logprob in enumerate(chosen):
                position = first + i + 1  # the prompt token it is the logprob of
                best = list(zip(top[0][i][:num_top], top[1][i][:num_top])) if top else []
                request.prompt_logprobs[position] = TokenLogprob(request.prompt_token_ids[position], logprob, best,
                                                                 ranks[i])
        if not self.requests:
            return [], None
        token_ids, *logprob_lists = (t.tolist() for t in self.host)
        if not logprob_lists:
            return token_ids, None
        chosen, top_ids, top_lps = (logprob_lists + [None, None])[:3]
        logprobs: list[TokenLogprob | None] = []
        for row, request in enumerate(self.requests):
            n = request.params.logprobs
            top = list(zip(top_ids[row][:n], top_lps[row][:n])) if n else []
            logprobs.append(None if n is None else TokenLogprob(token_ids[row], chosen[row], top))
        return token_ids, logprobs
