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


def _inside_a_string(json_text: str) -> bool:
    """Whether a JSON text's end is inside one of its strings."""
    inside = escaped = False
    for char in json_text:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


class HermesStream:
    """An answer split as it streams: `feed` each new piece of text, `finish` at
    the end; each returns what may go out now, in order: text (str) and calls
    ((name, arguments) tuples)."""

    def __init__(self, tool_names: set[str], parallel: bool = True) -> None:
        self.tool_names, self.parallel = tool_names, parallel
        self.num_calls = 0
        self.pending = ""  # text not yet given out (outside a block, or a block's body)
        self.in_block = False
        self.text = TrimmedText()

    def feed(self, text: str) -> list:
        self.pending += text
        out: list = []
        while True:
            if self.in_block:
                end = self._block_end()
                if end < 0:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.in_block = False
                called = self._call(body)
                out += [called] if called else self.text.pieces(OPEN + body + CLOSE)
                continue
            start = self.pending.find(OPEN)
            if start < 0:
                keep = tag_start(self.pending, OPEN)
                out += self.text.pieces(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            out += self.text.pieces(self.pending[:start])
            self.pending, self.in_block = self.pending[start + len(OPEN):], True

    def _block_end(self) -> int:
        """Where the open block's body ends: its first close tag, except one inside
        a string of a body that begins as a JSON object, which the arguments hold
        (a strict call's pattern lets a string hold the tag; the call came back as
        text). -1: not yet come."""
        end = self.pending.find(CLOSE)
        if not self.pending.lstrip().startswith("{"):
            return end
        while end >= 0 and _inside_a_string(self.pending[:end]):
            end = self.pending.find(CLOSE, end + 1)
        return end

    def finish(self) -> list:
        """The rest: a tag's start is text after all, and so is a block left open,
        unless its body is a whole call (the model stopped, or a stop string cut
        the answer, before the close tag: vLLM reads it as a call too; it was
        answered as the call's markup, finish_reason "stop")."""
        rest, in_block = self.pending, self.in_block
        self.pending, self.in_block = "", False
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
