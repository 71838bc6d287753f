"""Draft tokens for speculative decoding by prompt lookup (n-gram matching).

A request's next tokens often repeat text already in its context: code being
edited, a document being quoted or summarised, a JSON answer naming fields of the
question, a model caught in a loop. Prompt lookup (vLLM's `ngram` method, SGLang's
NGRAM, the "prompt lookup decoding" of Saxena, 2023) proposes, after the last
`n` tokens, the tokens that followed their latest earlier occurrence; the engine
computes the drafts' KV in the next step as one chunk with the last token and
samples at every position, keeping the samples for as long as they agree with the
drafts (actors/engine.py). No second model, no training: a draft costs a dict
lookup, a rejected one a position of compute.

The index is built for the prompt (a slice a step: actors/speculation.py) and
grows by one entry per `n` with every token (`add`), so a proposal costs
O(max_n), not a scan of the context (vLLM scans with KMP each step; at 64
requests of 4k tokens a Python scan would cost more than the step it saves). Longer matches are tried first: they predict better.
Memory: an entry per n-gram length a token (a tuple key in a dict); at the
defaults (n from 2 to 4) about 1.9 MB for a 4k-token request (a one-off probe
with tracemalloc, distinct random ids), made only for requests that draft.
"""

from __future__ import annotations


class PromptLookup:
    """An n-gram index over one request's tokens, for `min_n <= n <= max_n`: each
    n-gram maps to the position after its latest occurrence that has a token after
    it. Not thread-safe; the engine's thread owns it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the request's tokens so far, a copy grown in place
        self._next: dict[tuple[int, ...], int] = {}

    def add(self, token_ids: list[int]) -> None:
        """Index tokens that follow those added before."""
        tokens = self.tokens
        begin = max(len(tokens), 1)
        tokens += token_ids
        for end in range(begin, len(tokens)):  # token `end` follows the n-grams ending before it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(tokens[end - n:end])] = end

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """`next_tokens` after `token_ids`, the whole token list (of which only the
        tail past what was added before is read)."""
        self.add(token_ids[len(self.tokens):])
        return self.next_tokens(num_tokens)

    def next_tokens(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the latest earlier occurrence of the
        longest suffix of the tokens (at least `min_n` long) seen before; [] if none.
        A match `p` tokens back says the text repeats with period `p`: past the
        end of what followed it, the drafts go on with that period (a loop)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                followers = tokens[start:start + num_tokens]
                period = len(tokens) - start
                return [followers[i % period] for i in range(num_tokens)]
        return []
