"""Repetition, frequency and presence penalties over a batch of logits rows.

The three penalties LLM servers take (vLLM's and SGLang's sampling parameters; the
last two are OpenAI's), applied to a row's logits before it is sampled, in this
order:
- repetition (HF's `repetition_penalty`, r > 0, 1 = off): every token that appears
  in the prompt or the output so far has its logit divided by r if positive,
  multiplied by r otherwise, once however often it appears (so r > 1 makes it less
  likely either way);
- frequency (f, OpenAI's range [-2, 2], 0 = off): minus f times the number of times
  the token appears in the output so far;
- presence (p, [-2, 2], 0 = off): minus p if it appears in the output at all.
The logprobs a request asks for stay those of the raw logits (as vLLM's default).

Cost: a penalised row's distinct token ids and their counts are kept from step to
step (`TokenCounts`) and go to the device each step, O(distinct tokens) of memory
copies a row, a few numpy calls; rows without penalties cost nothing.

Overlapped decode (actors/engine.py) launches a step before the host has read the
token the previous one sampled: a penalised row's counts then lack that one token,
which is on the device only. `penalise_` then counts it there (`uncounted`): it
looks the token up among the row's counted ids (a binary search) and moves its
logit to what counting it would have made it. So penalised requests no longer
pause the overlap, which matters for instruct checkpoints whose
generation_config.json sets a repetition penalty for every request.
On this machine's CPU, 64 penalised rows (100-token prompts, 100-200 tokens out,
the tiny preset) cost 1.0 ms more host time a step than 64 greedy ones (2.1 against
1.0 ms; a one-off probe with `benchmarks.host_step.decode_step_ms`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels import to_device


class TokenCounts:
    """A sequence's distinct token ids (prompt and output so far, sorted) and how
    often each occurs in the output: what its penalties read. Kept from step to
    step (`add_output` each new token: a binary search, and an insert for a new
    id), so a step costs O(1) numpy calls a row, never a pass over its tokens in
    Python (rebuilding them each step cost 0.1 us a token, 1.5 ms a step for 64
    rows of 250 tokens; a one-off probe)."""

    def __init__(self, prompt: Sequence[int] = ()) -> None:
        self.ids = np.unique(np.asarray(prompt, dtype=np.int64))
        self.counts = np.zeros(len(self.ids), dtype=np.int64)
        self.num_output = 0  # output tokens counted so far

    def add_output(self, token: int) -> None:
        ids = self.ids
        at = int(ids.searchsorted(token))
        if at < len(ids) and ids[at] == token:
            self.counts[at] += 1
        else:  # (np.insert costs 20 us a call; two concatenations 3)
            self.ids = np.concatenate((ids[:at], (token,), ids[at:]))
            self.counts = np.concatenate((self.counts[:at], (1,), self.counts[at:]))
        self.num_output += 1

    def with_outputs(self, tokens: Sequence[int]) -> "TokenCounts":
        """A copy that also counts `tokens` as output (a speculative draft row's view)."""
        copy = TokenCounts.__new__(TokenCounts)
        copy.ids, copy.counts, copy.num_output = self.ids, self.counts.copy(), self.num_output
        for token in tokens:
            copy.add_output(token)
        return copy


def penalise_(
    logits: torch.Tensor,
    rows: Sequence[int],
    tokens: Sequence[TokenCounts],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
    uncounted: torch.Tensor | None = None,
    uncounted_rows: Sequence[int] = (),
) -> None:
    """Penalise row `rows[i]` (ascending) of `logits` [B, V] (contiguous; in place) by
    `tokens[i]` (its prompt's tokens there only if its repetition penalty is on)
    and its three penalties. Only the entries of tokens that appeared are touched:
    one gather and one scatter of them, never a pass over the vocabulary.

    `uncounted` ([B] token ids on the logits' device) and `uncounted_rows` (indexes
    i into `rows`): row rows[i]'s token uncounted[rows[i]], which the host has not
    read, counts as one more output token. Looked up among the row's counted ids on
    the device: one already there (penalised above for its count c) loses one more
    frequency, and presence if c was 0; a new one gets all three from its raw logit."""
    if not rows:
        return
    vocab = logits.shape[1]
    lengths = [len(t.ids) for t in tokens]
    keys = (np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lengths)
            + np.concatenate([t.ids for t in tokens]))  # flat indexes into [B, V]
    counts = np.concatenate([t.counts for t in tokens])
    subtract = np.repeat(frequency, lengths) * counts + np.repeat(presence, lengths) * (counts > 0)
    factors = torch.from_numpy(np.stack([np.repeat(repetition, lengths), subtract, counts])).float()
    keys, factors = to_device(torch.from_numpy(keys), logits.device), to_device(factors, logits.device)
    flat = logits.view(-1)
    x = flat[keys].float()
    flat[keys] = _penalised(x, factors[0], factors[1]).to(logits.dtype)
    if not uncounted_rows:
        return
    columns = [[rows[i] for i in uncounted_rows]] + [[column[i] for i in uncounted_rows]
                                                     for column in (repetition, frequency, presence)]
    settings = to_device(torch.tensor(columns, dtype=torch.float64), logits.device)
    at = settings[0].long()
    last_keys = at * vocab + uncounted[at]
    seen = torch.zeros_like(last_keys, dtype=torch.bool)  # among the counted ids
    in_output = torch.zeros_like(seen)  # and counted in the output (not the prompt only)
    if len(keys):  # sorted (rows ascending, each row's ids sorted): a binary search each
        where = torch.searchsorted(keys, last_keys).clamp_(max=len(keys) - 1)
        seen = keys[where] == last_keys
        in_output = seen & (factors[2][where] > 0)
    x = flat[last_keys].float()
    repetition, frequency, presence = settings[1:].float()
    base = torch.where(seen, x, _penalised(x, repetition, 0.0))  # penalised above, or raw
    flat[last_keys] = (base - frequency - presence * ~in_output).to(logits.dtype)


def _penalised(x: torch.Tensor, repetition, subtract) -> torch.Tensor:
    """Repetition on logits `x` (divided if positive, multiplied if not), then minus `subtract`."""
    return torch.where(x > 0, x / repetition, x * repetition) - subtract


def reference_penalties(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], repetition: float,
                        frequency: float, presence: float) -> torch.Tensor:
    """One row [V], token by token: what `penalise_` must make of it (tests)."""
    row = logits.clone().float()
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row
