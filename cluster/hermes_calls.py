"""Tool calls a model writes in its own words, Hermes' format (Qwen2.5's, and the
built-in presets' chat template's, actors/tokenizer_builder.py): each call a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`
tags, anywhere in the answer, any number of them. This is what `tool_choice:
"auto"` (OpenAI's default with tools) answers from: the model chooses between text
and calls, and the answer is split after the fact, as vLLM's `hermes` parser does.

- A block becomes a call when its JSON is an object naming one of the request's
  tools, with an object (or no) `arguments` or `parameters`
  (`answer_parts.known_call`; and, under `parallel_tool_calls: false`, when no
  call came before it); any other block stays in the text, as written, so
  nothing the model wrote is lost and no client is handed a call to a function
  it does not have. A block left open when the answer ends is a call if its body
  is one (the model stopped, or a stop string cut it, before the close tag, as
  vLLM reads it), else text (cut by `max_tokens` mid-call).
- The text is the answer outside the call blocks with the whitespace at its two
  ends removed; null when nothing is left (OpenAI's `content` beside calls).
- Streamed (`HermesStream`), text goes out as it comes, less a tail that could be
  the start of a tag (and the whitespace that might end up at the text's end),
  and each call goes out whole, in one delta, when its block closes: the deltas
  put together are the same text and calls as the whole answer's.
- Held (`held_regex`, for tools marked `strict`, OpenAI's promise that a call's
  arguments match its schema): the answer is text in which a `<tool_call>` tag
  opens only a block laid out as the template writes one, naming one of the
  tools, its arguments held to that tool's pattern (xgrammar's structural tags
  do the like for vLLM and SGLang). The model still chooses text or calls; a
  call it starts is then a valid one, and the parse above reads it back.
"""

from __future__ import annotations

import json
import re

from cluster.answer_parts import ParsedCalls, TrimmedText, call_regex, known_call, tag_start, text_without_regex

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse(text: str, tool_names: set[str], parallel: bool = True) -> ParsedCalls:
    """A whole answer's text and calls (`parallel`: more than one may be made)."""
    stream = HermesStream(tool_names, parallel)
    return ParsedCalls.of(stream.feed(text) + stream.finish())


def block_call(body: str, tool_names: set[str]) -> tuple[str, str] | None:
    """The call a block's body holds, or None when it is not one of the tools'."""
    try:
        return known_call(json.loads(body), tool_names)
    except (ValueError, RecursionError):  # (RecursionError: nested past Python's limit: text, not a call)
        return None


class BlockBody:
    """An open block's body, read piece by piece until its close tag: the first
    one, except one inside a string of a body that begins as a JSON object, which
    the arguments hold (a strict call's pattern lets a string hold the tag; the
    call came back as text). Each character is read once: the body searched
    again from its start at each piece, and from there for each tag inside a
    string, took a 30 KB call streamed 4 characters an event with 8 tags in its
    arguments 23 s of the event loop (0.012 s parsed whole)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []  # the body read so far
        self.held = ""  # an end that may be the start of the close tag, not yet read
        self.is_object: bool | None = None  # whether the body begins as a JSON object (None: only space yet)
        self.inside = self.escaped = False  # where an object's reading is: in a string, after its backslash

    def feed(self, text: str) -> tuple[str, str] | None:
        """(the body, the text after its close tag) once the tag has come; else
        None, `text` kept."""
        text, self.held = self.held + text, ""
        if self.is_object is None:
            begun = text.lstrip()
            if not begun:
                self.pieces.append(text)
                return None
            self.is_object = begun.startswith("{")
        end = self._object_end(text) if self.is_object else self._text_end(text)
        if end is None:
            return None
        body = "".join(self.pieces) + text[:end]
        return body, text[end + len(CLOSE):]

    def so_far(self) -> str:
        return "".join(self.pieces) + self.held

    def _text_end(self, text: str) -> int | None:
        end = text.find(CLOSE)
        if end >= 0:
            return end
        self._hold_from(text, len(text) - tag_start(text, CLOSE))
        return None

    def _object_end(self, text: str) -> int | None:
        inside, escaped = self.inside, self.escaped
        for i, char in enumerate(text):
            if escaped:
                escaped = False
            elif inside:
                escaped, inside = char == "\\", char != '"'
            elif char == '"':
                inside = True
            elif char == "<":
                if text.startswith(CLOSE, i):
                    return i
                if CLOSE.startswith(text[i:]):  # the tag's start, maybe: read with the next piece
                    self.inside = self.escaped = False
                    self._hold_from(text, i)
                    return None
        self.inside, self.escaped = inside, escaped
        self._hold_from(text, len(text))
        return None

    def _hold_from(self, text: str, start: int) -> None:
        self.pieces.append(text[:start])
        self.held = text[start:]


class HermesStream:
    """An answer split as it streams: `feed` each new piece of text, `finish` at
    the end; each returns what may go out now, in order: text (str) and calls
    ((name, arguments) tuples)."""

    def __init__(self, tool_names: set[str], parallel: bool = True) -> None:
        self.tool_names, self.parallel = tool_names, parallel
        self.num_calls = 0
        self.pending = ""  # text outside a block not yet given out (the start of an open tag, maybe)
        self.block: BlockBody | None = None  # the open block
        self.text = TrimmedText()

    def feed(self, text: str) -> list:
        out: list = []
        while True:
            if self.block is not None:
                ended = self.block.feed(text)
                if ended is None:
                    return out
                (body, text), self.block = ended, None
                called = self._call(body)
                out += [called] if called else self.text.pieces(OPEN + body + CLOSE)
                continue
            pending, self.pending = self.pending + text, ""
            start = pending.find(OPEN)
            if start < 0:
                keep = tag_start(pending, OPEN)
                out += self.text.pieces(pending[:len(pending) - keep])
                self.pending = pending[len(pending) - keep:]
                return out
            out += self.text.pieces(pending[:start])
            text, self.block = pending[start + len(OPEN):], BlockBody()

    def finish(self) -> list:
        """The rest: a tag's start is text after all, and so is a block left open,
        unless its body is a whole call (the model stopped, or a stop string cut
        the answer, before the close tag: vLLM reads it as a call too; it was
        answered as the call's markup, finish_reason "stop")."""
        in_block = self.block is not None
        rest = self.block.so_far() if in_block else self.pending
        self.pending, self.block = "", None
        called = self._call(rest) if in_block else None
        if called is not None:
            return [called]
        return self.text.pieces((OPEN if in_block else "") + rest)

    def _call(self, body: str) -> tuple[str, str] | None:
        """The call a block's body makes, counted; None when it makes none (not a
        call, or one past the first without parallel calls)."""
        called = block_call(body, self.tool_names) if self.parallel or not self.num_calls else None
        self.num_calls += called is not None
        return called


def held_regex(arguments: dict[str, str], parallel: bool = True, content: str | None = None,
               text_never_begins: tuple[str, ...] = ()) -> str:
    """The pattern of an answer whose calls name the tools in `arguments` (a name:
    the pattern of its arguments, a JSON object), laid out as the chat template
    writes a call; one call at most unless `parallel`. Text around the calls, or,
    when the text is held to `content` (a response_format's pattern), calls alone
    or that text alone. (`text_never_begins`, Llama's and Mistral's, is not needed
    here: no call is text, wherever it stands.)"""
    assert arguments, "a held answer's calls need tools"
    block = re.escape(f"{OPEN}\n") + f"(?:{call_regex(arguments, 'arguments')})" + re.escape(f"\n{CLOSE}")
    if content is not None:
        return rf"(?:\s*(?:{block})){'+' if parallel else ''}\s*|(?:{content})"
    return f"{TEXT}(?:(?:{block}){TEXT}){'*' if parallel else '?'}"


TEXT = text_without_regex(OPEN)
