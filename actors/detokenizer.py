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
"""

from __future__ import annotations

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
        self.text = ""
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

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit the held-back tail (an incomplete character included)."""
        if self._stream is not None:
            delta = self._decode(self.token_ids)[len(self.text):]
            self._stream = None  # the stream's state ends here; later calls decode in windows
            self.read_offset = self.prefix_offset = len(self.token_ids)
            self.text += delta
            return delta
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :]
        self.read_offset = self.prefix_offset = len(self.token_ids)
        self.text += delta
        return delta
