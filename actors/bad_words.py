"""vLLM's `bad_words`: words a request's output must not contain, as token sequences.

A word is banned as the tokenizer writes it at the start of a text and, where that
differs, after a space: a BPE tokenizer folds the space into the word's first token,
so " word" is not "word"'s tokens behind a space token. The second spelling is kept
when it has as many tokens as the first and another first token (vLLM keeps the
same two). Before each draw, every sequence whose all-but-last tokens end the output
so far bans its last token; a one-token word is banned at every draw. As in vLLM:
only the output is matched, not the prompt, and a word the model spells with other
tokens (another split of the same text) is not caught. A request whose one-token
words (and stop tokens under min_new_tokens) ban every one of its allowed_token_ids
is refused; a draw that a longer word leaves without any allowed token takes some
token anyway rather than failing the batch.

Ids outside the model's vocabulary cannot be sampled, so a sequence holding one is
dropped rather than banned (a logit that does not exist cannot be indexed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BadWords:
    prefixes: tuple[list[int], ...]  # each sequence's all-but-last tokens
    lasts: tuple[int, ...]  # and its last token

    @property
    def always_banned(self) -> frozenset[int]:
        """The one-token words: banned at every draw."""
        return frozenset(last for prefix, last in zip(self.prefixes, self.lasts) if not prefix)

    @property
    def reads_output(self) -> bool:
        """Whether a ban depends on the tokens before the draw (a word of two tokens
        or more)."""
        return any(self.prefixes)

    def banned(self, output_ids: list[int], num_output: int) -> list[int]:
        """The tokens the draw after the first `num_output` of `output_ids` must not take."""
        banned = []
        for prefix, last in zip(self.prefixes, self.lasts):
            n = len(prefix)
            # The last token first: a long word costs a comparison a draw, not its length.
            if not n or (n <= num_output and output_ids[num_output - 1] == prefix[-1]
                         and output_ids[num_output - n : num_output] == prefix):
                banned.append(last)
        return banned


def encode_bad_words(tokenizer, words: tuple[str, ...], vocab_size: int) -> BadWords | None:
    """A request's bad words as token sequences; None when it has none."""
    if not words:
        return None
    sequences: dict[tuple[int, ...], None] = {}  # ordered, without repeats
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced) if len(spaced) == len(bare) and spaced[:1] != bare[:1] else (bare,):
            if ids and all(0 <= t < vocab_size for t in ids):
                sequences[ids] = None
    return BadWords(tuple(list(s[:-1]) for s in sequences), tuple(s[-1] for s in sequences))
