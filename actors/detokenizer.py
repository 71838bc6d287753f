"""Incremental detokenization that never splits a multi-byte character.

Each new token decodes a short window `ids[prefix_offset:]` and subtracts the text of
`ids[prefix_offset:read_offset]` decoded the same way, so tokenizers that strip or
merge at window edges (sentencepiece's leading space) still give the exact text. A
window whose text ends in U+FFFD (an incomplete UTF-8 sequence) emits nothing until
the next token completes the character; `flush` emits whatever is left at the end.
The concatenated deltas equal `tokenizer.decode(all_ids, clean_up_tokenization_spaces=False)`.

Spaces are never cleaned up after decoding (transformers' `clean_up_tokenization_spaces`,
which Llama 3's checkpoints set and transformers 4 applies: " ." as ".", " 's" as
"'s"), as vLLM's detokenizers never do. Applied to the windows, it made a window's
text shorter than its prefix's, and the punctuation it removed was lost for good: a
review's probe streamed "a b  c " for "a.b, c?". So a fast (Rust) tokenizer is
decoded by its backend directly: the same text,
without the wrapper's per-call Python (which was most of the cost: 12 us a call,
two calls a token, 1.8 ms of host time per decode step at batch 64). Where the
`tokenizers` library has `DecodeStream` (0.21 on), the same two-window algorithm
runs inside it, in one call a token: 1.4 us a token instead of 5.5 (a one-off
probe: random ids, the tiny preset's tokenizer; in `tandem bench engine --profile`
appending tokens went 0.41 -> 0.34 ms a decode step, docs/benchmarks.md). `flush` then decodes the whole output once.
A byte-fallback run (sentencepiece's `<0xE4>` tokens) that stops being valid UTF-8
turns characters it already gave into U+FFFD, which DecodeStream refuses: the
stream then goes on in windows, and its text may differ from a decode of the
whole output in that run (the characters sent stay sent).

Byte-level BPE tokenizers (GPT-2's scheme: Qwen2, Llama 3, the built-in presets)
need no window at all. Their decoder maps every token to bytes on its own (each
character of the token through GPT-2's byte <-> character table, or the token's
UTF-8 when a character is not in it, as an added token's may be) and decodes the
concatenation lossily. So `ByteLevelTables` lists each id's bytes once per
tokenizer, and a stream keeps only the bytes of a character not yet complete:
a token is one list index, one concatenation and one `bytes.decode` (0.1-0.16 us
a token against DecodeStream's 0.55-0.9, a one-off probe on the tiny and
qwen2.5-0.5b presets' tokenizers, corpus text and random ids). Python's lossy
UTF-8 decode replaces each maximal invalid subpart with one U+FFFD, as Rust's
`from_utf8_lossy` does, and a decode resumes cleanly after any replaced run or
complete character, so the deltas concatenate to the backend's decode exactly
(tests/test_detokenizer.py holds random id streams to it).

A decoder that strips a text's first space (sentencepiece's Metaspace, Llama 2's
Strip: Llama 2, Mistral 7B, Mixtral) would strip the output's first one too: "The
capital is" answered "Paris." where vLLM, SGLang and TGI answer " Paris.", and
prompt plus completion read "isParis". So the stream and the windows start from
the prompt's last tokens (`context_ids`, as vLLM primes its DecodeStream: the
shortest run of 4 to 24 whose text is complete), and only what follows them is
the output's. The byte path strips nothing and needs none.

A prompt of token ids may end inside a character (an output cut mid-emoji, sent
back to go on): the output's first text then starts with that character where the
output completes it. Where it does not, the character's U+FFFD is the prompt's
text, not the output's, and is left out (DecodeStream gives it: an output held to
a pattern began with a U+FFFD its pattern does not allow). The byte path starts
from the prompt's trailing bytes of the character, and the windows from the tokens
that hold them (`_cut_character_tokens`); the byte path gave each of the output's
continuation bytes as a U+FFFD, and the windows lost the character (a review's
probe).

The text is kept as the list of its deltas (`pieces`, with `piece_ends`: where each
ends), never concatenated as it grows: appending a delta to one string copies the
whole string every token, so a token cost 7.4 us at 100k characters of output
against 2.1 us at the start (a one-off probe). `text_between` joins only the pieces
a range of characters overlaps; `text` joins them all (at the end).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

WINDOW_CONTEXT = 5  # tokens before the new ones a window decodes with, when it starts mid-text
PROMPT_CONTEXT = (4, 24)  # the fewest and most of the prompt's last tokens a decode starts from


@dataclass(frozen=True)
class ByteLevelTables:
    """The bytes each token id decodes to, for a tokenizer whose decoder is
    ByteLevel alone: `with_special` and `without_special` (special tokens as b"",
    for skip_special_tokens)."""

    with_special: list[bytes]
    without_special: list[bytes]

    @classmethod
    def of(cls, tokenizer, vocab_size: int = 0) -> ByteLevelTables | None:
        """The tables, or None when the tokenizer decodes otherwise (another decoder,
        a slow tokenizer). They cover `vocab_size`
        ids (a model's, where it has more rows than its tokenizer has tokens: ids
        past the tokenizer's decode to nothing, as in the backend's decode)."""
        from tokenizers.decoders import ByteLevel

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder) is not ByteLevel:
            return None
        byte_of = byte_of_char()
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        with_special = []
        for token_id in range(max(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
            token = backend.id_to_token(token_id) or ""
            if all(char in byte_of for char in token):
                with_special.append(bytes(byte_of[char] for char in token))
            else:
                with_special.append(token.encode())
        without_special = [b"" if i in special else data for i, data in enumerate(with_special)]
        return cls(with_special, without_special)


def byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level token stands for (GPT-2's alphabet):
    a byte Latin-1 prints (not a space, not a control) as itself; the other 68, in
    order, as U+0100 onward."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(0x100 + n): byte for n, byte in enumerate(others)}


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 byte_level: ByteLevelTables | None = None, prompt_ids: list[int] = ()) -> None:
        """`byte_level`: the tokenizer's tables (`ByteLevelTables.of`, built once by
        the caller), for the byte path; without them, DecodeStream or windows,
        which start from `prompt_ids`' last tokens (`context_ids`)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pieces: list[str] = []
        self.piece_ends: list[int] = []
        self.num_chars = 0
        self._token_bytes = None
        self._stream = None
        if byte_level is not None:
            self._token_bytes = byte_level.without_special if skip_special_tokens else byte_level.with_special
            # the bytes of a character the next token may complete: at first, one the prompt ends inside
            _, self._incomplete = _decode_complete(b"".join(self._token_bytes[t] for t in prompt_ids[-8:]))
            self._cut_pending = bool(self._incomplete)
            return
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = backend.decode if backend is not None else functools.partial(
            tokenizer.decode, clean_up_tokenization_spaces=False)
        context = self.context_ids(prompt_ids)
        # The windows' and the stream's flush read them: the context's first, then the output's
        self.token_ids: list[int] = list(context)
        self._context_chars = len(self._decode(context))
        self.prefix_offset = 0
        cut = self._cut_character_tokens(context)
        self._cut_pending = cut > 0
        self.read_offset = len(context) - cut
        self._stream_sent = len(context)  # tokens whose text the stream gave (it holds back an incomplete character's)
        # (a prompt ending in U+FFFD, a cut character or its own: DecodeStream holds each back and gives them
        # with the output's first text; the windows start at the cut alone)
        if backend is not None and DecodeStream is not None and not self._cut_pending:
            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            try:
                for token_id in context:
                    self._stream.step(backend, token_id)
            except Exception:  # noqa: BLE001 - (a broken byte run in the context): windows only
                self._stream = None

    def context_ids(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last tokens a decode starts from: the fewest, from 4 on,
        whose text is some text (special tokens skipped may leave none, and a
        decoder would strip the output's first space again) with no U+FFFD (no
        character cut at the run's start), or the last 24."""
        fewest, most = PROMPT_CONTEXT
        prompt_ids = list(prompt_ids[-most:])
        for count in range(fewest, len(prompt_ids)):
            text = self._decode(prompt_ids[-count:])
            if text and "\ufffd" not in text:
                return prompt_ids[-count:]
        return prompt_ids

    def _cut_character_tokens(self, context: list[int]) -> int:
        """How many of the context's last tokens hold a character it ends inside:
        the fewest without which its text is its text less the last U+FFFD (one
        before them, a prompt's own or another broken run, ends the shorter texts
        too); the windows' output starts at them. A prompt's own U+FFFD at its
        end reads as one too: its U+FFFD, given again, is left out (`_emit`)."""
        text = self._decode(context)
        if not text.endswith("\ufffd"):
            return 0
        for count in range(1, min(4, len(context)) + 1):  # (a character is at most 4 bytes)
            if self._decode(context[:-count]) == text[:-1]:
                return count
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def text_between(self, start: int, end: int) -> str:
        return text_between(self.pieces, self.piece_ends, start, end)

    def _emit(self, delta: str) -> str:
        if delta and self._cut_pending:  # (the first text after a prompt cut inside a character)
            self._cut_pending = False
            if delta.startswith("\ufffd"):  # not completed: the prompt's U+FFFD, not the output's
                delta = delta[1:]
        if delta:
            self.num_chars += len(delta)
            self.pieces.append(delta)
            self.piece_ends.append(self.num_chars)
        return delta

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (possibly empty)."""
        if self._token_bytes is not None:
            data = self._incomplete + self._token_bytes[token_id]
            try:
                text, self._incomplete = data.decode(), b""
            except UnicodeDecodeError:
                text, self._incomplete = _decode_complete(data)
            return self._emit(text)
        self.token_ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, token_id) or ""
                if delta:
                    self._stream_sent = len(self.token_ids)
                return self._emit(delta)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception; windows from here
                # DecodeStream refuses a text that changed before its end: a byte-fallback
                # run that stops being valid UTF-8 turns the characters it sent already
                # into U+FFFD. Raised, it failed the step and every request on the worker.
                # The windows go on from the last token it gave text for: the ones it
                # held back (part of a character) were taken as sent, and their text lost.
                self._stream = None
                self.read_offset = self._stream_sent
                self.prefix_offset = max(self.read_offset - WINDOW_CONTEXT, 0)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end: emit the held-back tail (an incomplete character included)."""
        if self._token_bytes is not None:
            tail, self._incomplete = self._incomplete.decode(errors="replace"), b""
            return self._emit(tail)
        if self._stream is not None:
            delta = self._decode(self.token_ids)[self._context_chars + self.num_chars :]
            self._stream = None  # the stream's state ends here; later calls decode in windows
            self.read_offset = self.prefix_offset = len(self.token_ids)
            return self._emit(delta)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.token_ids[self.prefix_offset :])[len(prefix_text) :]
        self.read_offset = self.prefix_offset = len(self.token_ids)
        return self._emit(delta)


def _decode_complete(data: bytes) -> tuple[str, bytes]:
    """`data` decoded up to an incomplete character at its end (returned as bytes,
    for the next token to complete); invalid bytes elsewhere read as U+FFFD, one a
    maximal invalid subpart, as a lossy decode of the whole output reads them."""
    text = []
    while True:
        try:
            text.append(data.decode())
            return "".join(text), b""
        except UnicodeDecodeError as error:
            if error.end == len(data) and error.reason == "unexpected end of data":
                text.append(data[: error.start].decode())
                return "".join(text), data[error.start :]
            text.append(data[: error.end].decode(errors="replace"))
            data = data[error.end :]


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
