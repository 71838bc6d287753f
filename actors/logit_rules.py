"""A request's rules for its logits, as arrays made once, not at every draw.

Before each draw of a request that has any, the model runner bans every token
outside its `allowed_token_ids` (`kernels.logit_bias.keep_only_`), then adds its
`logit_bias` and minus infinity for the tokens this draw may not take: the stop
tokens while it is under `min_new_tokens`, and the tokens that would complete one of
its bad words (actors/bad_words.py) (`kernels.logit_bias.add_logit_bias_`; bans
that would leave a draw no token give way to the request's other rules there). A
request may name many tokens: a 2 MiB body holds about 100k logit_bias entries for
a 152k-token vocabulary. Rebuilt from Python pairs at every draw, 100k entries on
one row of a batch of 64 added about 45 ms to the host time of
`ModelRunner._process_logits` (a one-off probe, one thread: 65 ms a step against
20 with 8 entries a row), a step every request in the batch waits for; as arrays
made at the request's first draw, 0.6 ms.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitRules:
    allowed_ids: np.ndarray  # int64, sorted; empty: any token may be drawn
    bias_ids: np.ndarray  # int64
    bias_values: np.ndarray  # float64, the bias of each of bias_ids
    stop_ids: np.ndarray  # int64, sorted: banned while under min_new_tokens
    min_new_tokens: int

    @classmethod
    def of(cls, params: SamplingParams, stop_token_ids: Iterable[int]) -> LogitRules:
        bias = np.array(params.logit_bias, dtype=np.float64).reshape(-1, 2)  # ids < 2**53 are exact
        return cls(np.array(params.allowed_token_ids, dtype=np.int64), bias[:, 0].astype(np.int64), bias[:, 1],
                   np.array(sorted(stop_token_ids), dtype=np.int64), params.min_new_tokens)

    def additions(self, num_output: int, bad_word_ids: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, values) to add to the logits of the draw of output token
        `num_output`: the bias, then minus infinity for the stop tokens if that is
        under `min_new_tokens` and for `bad_word_ids` (a token named twice gets
        the sum: banned either way)."""
        banned = [self.stop_ids] if num_output < self.min_new_tokens else []
        if len(bad_word_ids):
            banned.append(np.asarray(bad_word_ids, dtype=np.int64))
        if not banned:
            return self.bias_ids, self.bias_values
        ids = np.concatenate([self.bias_ids, *banned])
        return ids, np.concatenate([self.bias_values, np.full(len(ids) - len(self.bias_ids), -np.inf)])
