"""Tool calls in Mistral's formats (the manifest's `tool_call_parser: mistral`,
vLLM's parser of that name), in either of its two layouts:
- an array (Mistral 7B v0.3, Nemo, Small 3.1 Instruct: tokenizers before v11):
  `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`;
- named (tokenizer v11 on: Small 3.2, Magistral, Devstral): each call
  `[TOOL_CALLS]name[ARGS]{...}`, the arguments a JSON object after the name.
`[TOOL_CALLS]` and `[ARGS]` are special tokens of Mistral's tokenizers, which a
text decoded without special tokens (the default) drops: the array alone, or
`name{...}` after `name{...}`, is read the same.

- An answer that begins (whitespace aside) with `[`, or with one of the
  request's tool names and then `{` or `[ARGS]`, is read as calls, the whole
  answer; one with text before `[TOOL_CALLS]` (kept: a request with tools
  decodes special tokens for this format, as vLLM's does, `ToolCallFormat.
  reads_special_tokens`) is that text, then what follows the tag read so
  (Small 3.2, Magistral and Devstral often write a sentence first; their
  calls were answered as text): one array of objects each naming one of the tools with an object (or
  no) `arguments`; or named calls of the tools, each its arguments object, with
  only whitespace or `[TOOL_CALLS]` between and after. Otherwise (cut by
  `max_tokens`, a tool the request does not have, a plain list) the whole answer
  is text, as written. Under `parallel_tool_calls: false` the first call is the
  call and what follows it is its text.
- Any other answer is text, with the whitespace at its two ends removed.
- Streamed (`MistralStream`), text goes out as it comes (a tag's first
  characters held back until they are told apart); an answer that begins as
  calls, or the rest of one from its tag, can be judged only whole, so its
  calls (or its text) go out at its end (one that begins with a tool name's
  first letters waits until it can tell).
- Held (`held_regex`, strict tools): the answer is text that does not begin
  with `[`, or the tag (optional: a model may write it as its special token,
  which the text masks cannot) and calls in the array layout as `json.dumps`
  writes them; such an answer is read by `parse_held` / `HeldMistralStream`,
  for which text that begins with a tool's name is text (a pattern that kept
  text from beginning so would cost the automaton states a letter of every
  name, hundreds of them). Call ids (`[CALL_ID]`) are not read.
"""

from __future__ import annotations

import json
import re

from cluster.answer_parts import (ParsedCalls, WholeCallsStream, arguments_text, calls_regex, known_call, tag_start,
                                  text_not_beginning_regex)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"  # tokenizer v11 on: between a call's name and its arguments


def parse(text: str, tool_names: set[str], parallel: bool = True) -> ParsedCalls:
    """A whole answer's text and calls (`parallel`: more than one may be made)."""
    stream = MistralStream(tool_names, parallel)
    return ParsedCalls.of(stream.feed(text) + stream.finish())


def parse_held(text: str, tool_names: set[str], parallel: bool = True) -> ParsedCalls:
    """`parse` for an answer held to `held_regex`: the array layout alone."""
    stream = HeldMistralStream(tool_names, parallel)
    return ParsedCalls.of(stream.feed(text) + stream.finish())


def _read_array(text: str, tool_names: set[str]) -> list[tuple[str, str]] | None:
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or not value or text[end:].strip():
        return None
    calls = [known_call(item, tool_names) for item in value]
    return None if None in calls else calls


def _read_named(text: str, tool_names: set[str]) -> list[tuple[str, str, int]] | None:
    """Named calls, each (name, arguments, where its text ends), or None."""
    calls, at = [], 0
    while True:
        name = next((n for n in tool_names if text.startswith(n, at) and _opens_arguments(text, at + len(n))), None)
        if name is None:
            return None
        at += len(name)
        at += len(ARGS) if text.startswith(ARGS, at) else 0
        try:
            arguments, at = json.JSONDecoder().raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        arguments = arguments_text(arguments)
        if arguments is None:
            return None
        calls.append((name, arguments, at))
        at = _after_space(text, at)
        if at == len(text):
            return calls
        if text.startswith(TOOL_CALLS, at):
            at = _after_space(text, at + len(TOOL_CALLS))


def _opens_arguments(text: str, at: int) -> bool:
    return text.startswith("{", at) or text.startswith(ARGS, at)


def _after_space(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip())


class MistralStream(WholeCallsStream):
    """An answer read as it streams (`WholeCallsStream`): calls begin with `[`
    (the tag's or the array's) or with a tool's name and its arguments, or
    follow text at their tag (`_text_now`)."""

    def _text_now(self) -> list:
        """The text up to the calls' tag, whose calls, from it, are held to the
        end (read as text there if they are none); a tag's first characters at
        the end held back until the next piece tells."""
        text = self._take()
        at = text.find(TOOL_CALLS)
        if at >= 0:
            self.kind, self.pending = "calls", [text[at:]]
            return self.text.pieces(text[:at])
        keep = tag_start(text, TOOL_CALLS)
        self.pending = [text[len(text) - keep:]] if keep else []
        return self.text.pieces(text[:len(text) - keep])

    def _begins(self, begun: str) -> str:
        if begun.startswith("["):
            return "calls"
        heads = [name + opener for name in self.tool_names for opener in ("{", ARGS)]
        if any(begun.startswith(head) for head in heads):
            return "calls"
        return "start" if not begun or any(head.startswith(begun) for head in heads) else "text"

    def _calls(self, whole: str) -> list | None:
        body = whole.lstrip().removeprefix(TOOL_CALLS).lstrip()
        is_array = body.startswith("[") and not body.startswith(ARGS)
        if is_array:
            named, calls = None, _read_array(body, self.tool_names)
        else:
            named = self._read_named(body)
            calls = None if named is None else [(name, arguments) for name, arguments, _ in named]
        if calls is None or self.parallel or len(calls) == 1:
            return calls
        if is_array:
            rest = json.dumps([{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls[1:]],
                              ensure_ascii=False)
        else:
            rest = body[named[0][2]:]  # after the first call's text
        return [calls[0], *self.text.pieces(rest)]

    def _read_named(self, body: str) -> list[tuple[str, str, int]] | None:
        return _read_named(body, self.tool_names)


class HeldMistralStream(MistralStream):
    """A held answer (strict tools) as it streams: `held_regex` admits calls in
    the array layout alone, so text that begins with a tool's name is text
    (were it read as a named call, its arguments would be unchecked), and so is
    a tag after text (the pattern's text could write it, unchecked calls)."""

    _text_now = WholeCallsStream._text_now

    def _begins(self, begun: str) -> str:
        return "calls" if begun.startswith("[") else "text" if begun else "start"

    def _read_named(self, body: str) -> None:
        return None


def held_regex(arguments: dict[str, str], parallel: bool = True, content: str | None = None,
               text_never_begins: tuple[str, ...] = ()) -> str:
    """The pattern of an answer whose calls name the tools in `arguments` (a name:
    the pattern of its arguments, a JSON object); one call at most unless
    `parallel`. Calls in the array layout only: a held answer is read by
    `parse_held`. Or text: any whose first character, whitespace aside, is not
    `[` and that does not begin with one of `text_never_begins` (a reasoning
    block's tag, which the pattern before this one holds), or the text of
    `content` (a response_format's pattern) when given."""
    assert arguments, "a held answer's calls need tools"
    calls = calls_regex(arguments, "arguments", ", ", parallel)
    text = text_not_beginning_regex(("[", *text_never_begins)) if content is None else f"(?:{content})"
    return rf"(?:{re.escape(TOOL_CALLS)})?\[{calls}\]|{text}"
