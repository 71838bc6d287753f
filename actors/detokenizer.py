"""Incremental detokenization that never splits a multi-byte character.

Each new token decodes a short window `ids[prefix_offset:]` and subtracts the text of
`ids[prefix_offset:read_offset]` decoded the same way, so tokenizers that strip or
merge at window edges (sentencepiece's leading space) still give the exact text. A
window whose text ends in U+FFFD (an incomplete UTF-8 sequence) emits nothing until
the next token completes the character; `flush` emits whatever is left at the end.
The concatenated deltas equal `tokenizer.decode(all_ids)`.

A fast (Rust) tokenizer whose wrapper adds nothing to its backend's decode (no
`clean_up_tokenization_spaces`) is decoded by the backend directly: the same text,
without the wrapper's per-call Python (which was most of the cost: 12 us a call,
two calls a token, 1.8 ms of host time per decode step at batch 64). Where the
`tokenizers` library has `DecodeStream` (0.21 on), the same two-window algorithm
runs inside it, in one call a token: 1.4 us a token instead of 5.5 (a one-off
probe: random ids, the tiny preset's tokenizer; in `tandem bench engine --profile`
appending tokens went 0.41 -> 0.34 ms a decode step, docs/benchmarks.md). `flush` then decodes the whole output once.

The text is kept as the list of its deltas (`pieces`, with `piece_ends`: where each
ends), never concatenated as it grows: appending a delta to one string copies the
whole string every token, so a token cost 7.4 us at 100k characters of output
against 2.1 us at the start (a one-off probe). `text_between` joins only the pieces
a range of characters overlaps; `text` joins them all (at the end).
"""

from __future__ import annotations

import bisect

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pieces: list[str] = []
        self.piece_ends: list[int] = []
        self.num_chars = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_ids = backend.decode
            if DecodeStream is not None:
                self._backend = backend
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._decode_ids = tokenizer.decode

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def text_between(self, start: int, end: int) -> str:
        return text_between(self.pieces, self.piece_ends, start, end)

    def _emit(self, delta: str) -> str:
        if delta:
            self.num_chars += len(delta)
            self.pieces.append(delta)
            self.piece_ends.append(self.num_chars)
        return delta

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        if self._stream is not None:
            return self._emit(self._stream.step(self._backend, token_id) or "")
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end: emit the held-back tail (an incomplete character included)."""
        if self._stream is not None:
            delta = self._decode(self.token_ids)[self.num_chars :]
            self._stream = None  # the stream's state ends here; later calls decode in windows
            self.read_offset = self.prefix_offset = len(self.token_ids)
            return self._emit(delta)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :]
        self.read_offset = self.prefix_offset = len(self.token_ids)
        return self._emit(delta)


def text_between(pieces: list[str], piece_ends: list[int], start: int, end: int) -> str:
    """Characters [start, end) of "".join(pieces), joining only the pieces that
    overlap them (`piece_ends[i]`: where piece i ends in the text)."""
    if start >= end:
        return ""
    if piece_ends and end == piece_ends[-1] and start == (piece_ends[-2] if len(piece_ends) > 1 else 0):
        return pieces[-1]  # a stream's usual read: the one piece since its last (0.16 us against 0.8)
    first = bisect.bisect_right(piece_ends, start)  # the piece holding character `start`
    last = bisect.bisect_left(piece_ends, end)  # the piece holding character end - 1
    begins_at = piece_ends[first - 1] if first else 0
    return "".join(pieces[first : last + 1])[start - begins_at : end - begins_at]
