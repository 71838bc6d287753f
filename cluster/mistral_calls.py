"""Tool calls in Mistral's format (the manifest's `tool_call_parser: mistral`,
vLLM's parser of that name): Mistral 7B v0.3, Nemo and Small 3.1 Instruct answer
a call as `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`,
the whole answer.

- An answer that begins (whitespace aside) with `[TOOL_CALLS]`, or with the array
  itself (`[TOOL_CALLS]` is a special token of Mistral's tokenizers, which a text
  decoded without special tokens drops), is read as calls: one JSON array of
  objects, each naming one of the request's tools with an object (or no)
  `arguments`, then nothing but whitespace. Otherwise (cut by `max_tokens`, a
  tool the request does not have, a plain list) the whole answer is text, as
  written. Under `parallel_tool_calls: false` the first call is the call and the
  array's other items are its text.
- Any other answer is text, with the whitespace at its two ends removed.
- Streamed (`MistralStream`), text goes out as it comes; an answer that begins
  with `[` can be judged only whole, so its calls (or its text) go out at its end.
- Held (`held_regex`, strict tools): the answer is text that does not begin with
  `[`, or the tag (optional: a model may write it as its special token, which the
  text masks cannot) and calls laid out as `json.dumps` writes them. Mistral's
  newer `[TOOL_CALLS]name[ARGS]{...}` layout (tokenizer v11) is not read.
"""

from __future__ import annotations

import json
import re

from cluster.answer_parts import ParsedCalls, WholeCallsStream, known_call

TOOL_CALLS = "[TOOL_CALLS]"


def parse(text: str, tool_names: set[str], parallel: bool = True) -> ParsedCalls:
    """A whole answer's text and calls (`parallel`: more than one may be made)."""
    stream = MistralStream(tool_names, parallel)
    return ParsedCalls.of(stream.feed(text) + stream.finish())


def read_calls(text: str, tool_names: set[str]) -> list[tuple[str, str]] | None:
    """The calls of a calls answer (`text` from its array's `[`), or None when the
    answer is not one array of calls of these tools."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or text[end:].strip():
        return None
    calls = [known_call(item, tool_names) for item in value]
    return None if None in calls else calls


class MistralStream(WholeCallsStream):
    """An answer read as it streams (`WholeCallsStream`): calls begin with `[`,
    the tag's or the array's."""

    def _begins(self, begun: str) -> str:
        return "calls" if begun.startswith("[") else "text" if begun else "start"

    def _calls(self, whole: str) -> list | None:
        calls = read_calls(whole.lstrip().removeprefix(TOOL_CALLS).lstrip(), self.tool_names)
        if calls is None or self.parallel or len(calls) == 1:
            return calls
        rest = json.dumps([{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls[1:]],
                          ensure_ascii=False)
        return [calls[0], *self.text.pieces(rest)]


def held_regex(arguments: dict[str, str], parallel: bool = True) -> str:
    """The pattern of an answer whose calls name the tools in `arguments` (a name:
    the pattern of its arguments, a JSON object); one call at most unless
    `parallel`."""
    assert arguments, "a held answer's calls need tools"
    call = "|".join(re.escape(f'{{"name": {json.dumps(name)}, "arguments": ') + f"(?:{pattern})" + r"\}"
                    for name, pattern in arguments.items())
    calls = f"(?:{call})(?:, (?:{call}))*" if parallel else f"(?:{call})"
    return rf"(?:{re.escape(TOOL_CALLS)})?\[{calls}\]|{_TEXT}"


_TEXT = r"\s*(?:[^\s\[][\s\S]*)?"  # text whose first character, whitespace aside, is not `[`
