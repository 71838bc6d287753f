"""Tool calls in Llama 3.x's JSON format (the manifest's `tool_call_parser:
llama3_json`, vLLM's parser of that name): Llama 3.1 and 3.2 Instruct's chat
templates ask the model to answer a call as `{"name": ..., "parameters": {...}}`,
the whole answer, sometimes after Llama's `<|python_tag|>` token, several calls
separated by `;`.

- An answer that begins (whitespace and `<|python_tag|>` aside) with `{` is read
  as calls: JSON objects, `;` between them, each naming one of the request's tools
  with an object (or no) `parameters` (`arguments` is taken too). If one does not
  parse (cut by `max_tokens`) or is not one of the tools', the whole answer is
  text, as written. Under `parallel_tool_calls: false` the first call is the call
  and the rest of the answer its text.
- Any other answer is text, with the whitespace at its two ends removed.
- Streamed (`LlamaStream`), text goes out as it comes; an answer that begins with
  `{` can be judged only whole, so its calls (or its text) go out at its end.
- Held (`held_regex`, strict tools): the answer is text that begins neither with
  `{` nor with `<|python_tag|>`, or calls laid out as `json.dumps` writes them,
  `; ` between them, each of a tool's arguments pattern.
"""

from __future__ import annotations

import json
import re

from cluster.answer_parts import ParsedCalls, WholeCallsStream, calls_regex, known_call, text_not_beginning_regex

PYTHON_TAG = "<|python_tag|>"


def parse(text: str, tool_names: set[str], parallel: bool = True) -> ParsedCalls:
    """A whole answer's text and calls (`parallel`: more than one may be made)."""
    stream = LlamaStream(tool_names, parallel)
    return ParsedCalls.of(stream.feed(text) + stream.finish())


def read_calls(text: str, tool_names: set[str]) -> list[tuple[tuple[str, str], int]] | None:
    """Each call of a calls answer (`text` from its first `{`) with where it ends,
    or None when the answer is not calls of these tools."""
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        try:
            value, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return None
        called = known_call(value, tool_names)
        if called is None:
            return None
        calls.append((called, position))
        after = _past_space(text, position)
        if after == len(text):
            return calls
        if text[after] != ";":
            return None
        position = _past_space(text, after + 1)
        if position == len(text):  # a `;` after the last call, as Llama may write (vLLM reads it)
            return calls


def _past_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


class LlamaStream(WholeCallsStream):
    """An answer read as it streams (`WholeCallsStream`): calls begin with `{`,
    after Llama's Python tag if any."""

    def _begins(self, begun: str) -> str:
        begun = begun.removeprefix(PYTHON_TAG).lstrip()
        if begun.startswith("{"):
            return "calls"
        return "start" if PYTHON_TAG.startswith(begun) else "text"  # (the tag may be coming)

    def _calls(self, whole: str) -> list | None:
        start = whole.index("{")
        calls = read_calls(whole[start:], self.tool_names)
        if calls is None:
            return None
        if self.parallel or len(calls) == 1:
            return [called for called, _ in calls]
        first, end = calls[0]
        rest = whole[start + end:].lstrip().removeprefix(";")
        return [first, *self.text.pieces(rest)]


def held_regex(arguments: dict[str, str], parallel: bool = True, content: str | None = None,
               text_never_begins: tuple[str, ...] = ()) -> str:
    """The pattern of an answer whose calls name the tools in `arguments` (a name:
    the pattern of its arguments, a JSON object); one call at most unless
    `parallel`. Or text: any that does not begin as a call (after its leading
    whitespace, neither `{` nor the Python tag) nor with one of
    `text_never_begins` (a reasoning block's tag, which the pattern before this
    one holds), or the text of `content` (a response_format's pattern) when given."""
    assert arguments, "a held answer's calls need tools"
    calls = calls_regex(arguments, "parameters", "; ", parallel)
    text = text_not_beginning_regex(("{", PYTHON_TAG, *text_never_begins)) if content is None else f"(?:{content})"
    return f"(?:{re.escape(PYTHON_TAG)})?{calls}|{text}"
