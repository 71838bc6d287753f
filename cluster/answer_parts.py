"""A model's answer split into parts (text and tool calls: cluster/hermes_calls.py,
cluster/llama_calls.py; reasoning and answer: cluster/reasoning.py), what the
parsers share: each part given out piece by piece as it streams with the
whitespace at its two ends removed (`TrimmedText`: the pieces put together are the
part `.strip()`ped); the tail that may be the start of a tag held back
(`tag_start`); the pattern of text in which a tag does not occur
(`text_without_regex`, `unfinished_tag_regex`), for answers held to such a split; a call the model wrote,
checked against the request's tools (`known_call`), and the answer's text and
calls put together from a stream's pieces (`ParsedCalls`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import NamedTuple


class TrimmedText:
    """The leading whitespace dropped; whitespace held back until text follows it
    (dropped if none does)."""

    def __init__(self) -> None:
        self.started = False  # whether any text has gone out
        self.space = ""  # whitespace held back

    def add(self, text: str) -> str:
        """What of `text` (with what was held) may go out now ("" for nothing)."""
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.space += text
            return ""
        out, self.space = self.space + body, text[len(body):]
        self.started = True
        return out

    def pieces(self, text: str) -> list[str]:
        """`add`, as a stream's pieces: [] for nothing."""
        out = self.add(text)
        return [out] if out else []


def tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (shorter than
    the tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


# The whitespace `str.strip` removes, as a pattern's class (the parsers read an answer's start past it), not
# `\s`'s ASCII alone: an answer opening with a no-break space, then a strict tool's call, was free text to the
# pattern and a call to the parser, its arguments unchecked (Llama's and Mistral's formats).
STRIPPED_SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.lru_cache(maxsize=16)
def text_not_beginning_regex(prefixes: tuple[str, ...]) -> str:
    """Text whose start, after its leading whitespace, is none of `prefixes` (none
    of which begins with whitespace); an unfinished start of one is text. Built on
    the prefixes' trie: at each point a character no prefix goes on with, then
    anything; or one some go on with, and the same again for their rests (none
    where a prefix ends); or the end."""
    anything, space = r"[\s\S]", STRIPPED_SPACE

    def after(rests: list[str], first: bool) -> str:
        heads = sorted({rest[0] for rest in rests})
        others = "".join(re.escape(head) for head in heads)
        options = [f"[^{space if first else ''}{others}]{anything}*"]
        for head in heads:
            onward = [rest[1:] for rest in rests if rest[0] == head]
            if "" not in onward:
                options.append(f"{re.escape(head)}{after(onward, False)}")
        return f"(?:{'|'.join(options)})?"

    return rf"[{space}]*{after(list(prefixes), True)}"


def text_without_regex(tag: str) -> str:
    """Any text in which `tag` does not occur (its first character must not occur
    again in it, as `<` does not in `<tool_call>`): runs of other characters, each
    run after a `<` not starting with the rest of the tag."""
    assert tag[0] not in tag[1:]
    first = re.escape(tag[0])
    return f"[^{first}]*(?:{first}{unfinished_tag_regex(tag, f'[^{first}]', first)})*"


def unfinished_tag_regex(tag: str, anything: str, never: str = "") -> str:
    """What may follow a `tag[0]` that does not open the tag: `anything`s (a class
    of one character, never `never`) that do not begin with `tag[1:]`, an
    unfinished start of it included. Built from the tag's last character back: a
    character other than the tag's next, then anything; or the tag's next, then
    the same again for the rest (the last one would finish the tag)."""
    rest = ""
    for k in range(len(tag) - 1, 0, -1):
        char = re.escape(tag[k])
        taken = f"|{char}{rest}" if k < len(tag) - 1 else ""
        rest = f"(?:[^{never}{char}]{anything}*{taken})?"
    return rest


class WholeCallsStream:
    """An answer whose calls, if it makes any, are the whole answer (Llama 3's JSON
    objects, Mistral's arrays), read as it streams: `feed` each new piece of text,
    `finish` at the end; each returns what may go out now: text (str) and calls
    ((name, arguments) tuples). Text goes out as it comes; an answer that begins as
    calls can be judged only whole, at its end. A format says how its calls begin
    (`_begins`) and reads them (`_calls`)."""

    def __init__(self, tool_names: set[str], parallel: bool = True) -> None:
        self.tool_names, self.parallel = tool_names, parallel
        self.kind = "start"  # "start": not yet known; "calls": held to the end; "text"
        self.pending: list[str] = []  # pieces not yet given out (joined at the end: a string grown a piece at a
        self.text = TrimmedText()  # time was copied whole each time, 1 s of event loop for a 200 KB call)

    def _begins(self, begun: str) -> str:
        """The kind of an answer that begins with `begun` (its leading whitespace
        gone): "calls", "text", or "start" while it cannot tell yet."""
        raise NotImplementedError

    def _calls(self, whole: str) -> list | None:
        """A calls answer's pieces, or None when it is text after all."""
        raise NotImplementedError

    def feed(self, text: str) -> list:
        if self.kind == "start" and not self.pending and not text.strip():
            return []  # (leading whitespace: dropped, as the text's and the calls' readers drop it; held and
            # joined at each piece, a model's run of blank lines took time quadratic in its length)
        self.pending.append(text)
        if self.kind == "start":
            self.pending = ["".join(self.pending)]  # (short: a call's or a text's first characters)
            self.kind = self._begins(self.pending[0].lstrip())
        if self.kind != "text":
            return []
        return self._text_now()

    def _text_now(self) -> list:
        """What of a text answer's pending text goes out now (all of it)."""
        return self.text.pieces(self._take())

    def finish(self) -> list:
        whole = self._take()
        calls = self._calls(whole) if self.kind == "calls" else None
        return self.text.pieces(whole) if calls is None else calls

    def _take(self) -> str:
        taken, self.pending = "".join(self.pending), []
        return taken


class ParsedCalls(NamedTuple):
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments as JSON text) each, in order

    @classmethod
    def of(cls, pieces: list) -> ParsedCalls:
        """From a stream's pieces: text (str) and calls ((name, arguments) tuples)."""
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        return cls(content or None, [piece for piece in pieces if isinstance(piece, tuple)])


def call_regex(arguments: dict[str, str], arguments_key: str) -> str:
    """A call of one of the tools in `arguments` (a name: the pattern of its
    arguments, a JSON object) as `json.dumps` writes `{"name": ..., arguments_key:
    ...}`. Tools of one pattern share a branch (those whose arguments are any JSON
    object: the automaton does not grow with their number)."""
    names_of: dict[str, list[str]] = {}
    for name, pattern in arguments.items():
        names_of.setdefault(pattern, []).append(name)
    key = re.escape(f', "{arguments_key}": ')
    return "|".join(r'\{"name": (?:' + "|".join(re.escape(json.dumps(name)) for name in names)
                    + f"){key}(?:{pattern})\\}}" for pattern, names in names_of.items())


def calls_regex(arguments: dict[str, str], arguments_key: str, separator: str, parallel: bool) -> str:
    """Calls of the tools in `arguments` (`call_regex`): one, or, if `parallel`,
    several with `separator` (a pattern) between."""
    call = call_regex(arguments, arguments_key)
    return f"(?:{call})(?:{separator}(?:{call}))*" if parallel else f"(?:{call})"


# What a call's object may hold without its arguments: a call of no arguments, with an id
# or type some models write.
NO_ARGUMENTS_KEYS = {"name", "id", "type"}


def known_call(value, tool_names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call the model wrote as a JSON value,
    or None unless it is an object naming one of the tools, with an object as
    its "arguments" or "parameters" (templates write the one, Llama the other;
    other keys beside them are let be, as vLLM lets them), or with neither and
    nothing but `NO_ARGUMENTS_KEYS`. A name that is not a string (the model's
    `["f"]`) is no call: looked up, it raised TypeError, a 500 or a cut
    stream. Arguments under another key (`"args"`) were read as none: a call
    made with `{}`."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in tool_names:
        return None
    if "arguments" in value and "parameters" in value:
        return None
    if "arguments" not in value and "parameters" not in value and not value.keys() <= NO_ARGUMENTS_KEYS:
        return None
    arguments = arguments_text(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else (value["name"], arguments)


def arguments_text(arguments) -> str | None:
    """A call's arguments as JSON text; None unless an object written back as
    JSON a client can read: nested a little under Python's limit (`json.loads`
    read it and `json.dumps` raised RecursionError), with no NaN nor Infinity
    (Python's decoder reads them and 1e999, JSON has none), and no lone
    surrogate (`"\\ud83d"`, which is not Unicode: the whole answer's JSON
    could not be encoded, a 500, while the stream's escaped it)."""
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (RecursionError, ValueError):  # (UnicodeEncodeError is a ValueError)
        return None
    return text
