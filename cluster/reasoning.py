"""A reasoning model's thinking, apart from its answer (the manifest's
`reasoning_parser: think`): Qwen3, QwQ and DeepSeek-R1 write their reasoning first,
between `<think>` and `</think>`, and the answer after. OpenAI-style clients read
the answer in `content` and the reasoning in `reasoning_content` (DeepSeek's API
field, which vLLM's and SGLang's reasoning parsers fill too), streamed as
`reasoning_content` deltas before the answer's.

- An answer that starts with `<think>` (whitespace aside) reasons until
  `</think>`; one whose prompt already opened the block (DeepSeek-R1's template
  ends with `<think>\n`; `opened`) reasons from its first token. Any other answer
  has no reasoning (Qwen3 asked for none, `chat_template_kwargs: {"enable_thinking":
  false}`, writes its answer alone).
- An answer cut inside its reasoning (`max_tokens`) is reasoning only: content
  null. Either part comes with the whitespace at its two ends removed.
- The tool calls, and the text `auto` parses them from, are the answer's
  (cluster/tool_calls.py reads `content`).
- Held to a pattern (structured output, a tool call), the answer still reasons
  first: `held_regex` lets the pattern begin only after the reasoning, as vLLM and
  SGLang start their grammars at the reasoning's end (unless the pattern itself
  begins with the block: then it says what the reasoning is to be).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from actors.regex_anchors import split_flags, unanchored
from actors.regex_dfa import DEAD, START, compile_regex
from cluster.answer_parts import TrimmedText, tag_start, text_without_regex

OPEN, CLOSE = "<think>", "</think>"
_REASONING = text_without_regex(CLOSE)


class Reasoning(NamedTuple):
    """How a chat answer starts, where the manifest names a reasoning parser."""

    opened: bool  # the prompt opened the block: the answer reasons from its first token

    @classmethod
    def of(cls, prompt: str) -> Reasoning:
        return cls(prompt.rstrip().endswith(OPEN))


class Thought(NamedTuple):
    reasoning: str | None
    content: str | None


def split(text: str, opened: bool = False) -> Thought:
    """A whole answer's reasoning and content."""
    stream = ReasoningStream(opened)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    content = "".join(piece for kind, piece in pieces if kind == "content")
    return Thought(reasoning or None, content or None)


def num_reasoning_tokens(tokenizer, token_ids: list[int], opened: bool = False) -> int:
    """How many of an answer's tokens are its reasoning, `</think>` included (the
    usage's `completion_tokens_details.reasoning_tokens`, as OpenAI counts a
    reasoning model's hidden tokens): every token of an answer cut inside its
    reasoning, none of one that does not reason. The first token whose text
    completes the closing tag, found by halving (a prefix's text holds the tag
    from that token on), so a long answer is decoded about log2(n) times."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731  (the tags may be special)
    text = decode(token_ids)
    if not opened and not text.lstrip().startswith(OPEN):
        return 0
    if CLOSE not in text:
        return len(token_ids)
    low, high = 0, len(token_ids)  # the first token_ids[:m] that holds the tag has low <= m <= high
    while low < high:
        middle = (low + high) // 2
        if CLOSE in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return high


class ReasoningStream:
    """An answer split as it streams: `feed` each new piece of text, `finish` at
    the end; each returns what may go out now, in order, as ("reasoning", text) and
    ("content", text) pairs."""

    def __init__(self, opened: bool = False) -> None:
        self.part = "reasoning" if opened else "start"  # "start": not yet known whether it reasons
        self.pending = ""
        self.texts = {"reasoning": TrimmedText(), "content": TrimmedText()}

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.part == "start" and not self.pending and not text.strip():
            return []  # (leading whitespace: dropped, as each part's text drops it; held and stripped at each
            # piece, a model's run of blank lines took time quadratic in its length)
        self.pending += text
        out: list[tuple[str, str]] = []
        if self.part == "start":
            begun = self.pending.lstrip()
            if begun.startswith(OPEN):
                self.part, self.pending = "reasoning", begun[len(OPEN):]
            elif OPEN.startswith(begun):
                return out  # the tag may be coming
            else:
                self.part = "content"
        if self.part == "reasoning":
            end = self.pending.find(CLOSE)
            if end < 0:
                keep = tag_start(self.pending, CLOSE)
                out += self._give("reasoning", self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            out += self._give("reasoning", self.pending[:end])
            self.part, self.pending = "content", self.pending[end + len(CLOSE):]
        out += self._give("content", self.pending)
        self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The rest: a tag's start held back is text of the part it was in."""
        part = "content" if self.part == "start" else self.part
        rest, self.pending = self.pending, ""
        return self._give(part, rest)

    def _give(self, part: str, text: str) -> list[tuple[str, str]]:
        out = self.texts[part].add(text)
        return [(part, out)] if out else []


def held_regex(pattern: str, opened: bool = False, written: bool = False) -> str:
    """`pattern` after the reasoning: an optional `<think>` block (the block's
    rest, when the prompt opened it), then the pattern. A pattern the client
    wrote (`written`) that may itself begin with `<think>` says what the reasoning
    is to be: it is kept as written. Not one this server made (strict tools, a schema):
    Llama's and Mistral's strict tools let free text begin with `<`, and kept as
    written, a call after the reasoning was free text, its arguments unchecked.
    Its anchors (`^...$`, as most are written) go: after the reasoning they
    could not stand, and the pattern, refused so, is matched whole all the same."""
    block = f"{_REASONING}{re.escape(CLOSE)}\\s*"
    flags, answer = split_flags(unanchored(pattern))  # (flags in front: `(?s)` mid-pattern is an error)
    if opened:
        return f"{flags}{block}(?:{answer})"
    if written and compile_regex(pattern).walk(START, OPEN.encode()) != DEAD:
        return pattern
    return f"{flags}(?:{re.escape(OPEN)}{block})?(?:{answer})"


class ReasoningDeltas:
    """A streamed chat choice's deltas with its reasoning split off: the reasoning
    as `reasoning_content`, the answer's as `answer` writes them (tool calls:
    cluster/tool_calls.py `StreamedCalls`), or as `content` where it is None."""

    def __init__(self, reasoning: Reasoning, answer=None) -> None:
        self.stream = ReasoningStream(reasoning.opened)
        self.answer = answer
        self.answered = False  # some of the answer's text has come (`delta`)

    def delta(self, text: str, finished: bool) -> dict:
        """The delta's fields for this event ({}: none yet; the chunk still carries
        the tokens' logprobs). `answer` sees the text once the answer has some: fed
        the empty text of each event before, a named function's call went out with
        the first chunk, ahead of the reasoning, and stood, arguments "", in an
        answer cut while it reasoned or empty after it, which whole has no call."""
        pieces = self.stream.feed(text) + (self.stream.finish() if finished else [])
        delta: dict = {}
        thinking = "".join(piece for part, piece in pieces if part == "reasoning")
        if thinking:
            delta["reasoning_content"] = thinking
        content = "".join(piece for part, piece in pieces if part == "content")
        if self.answer is not None:
            self.answered = self.answered or bool(content)
            if self.answered:
                delta.update(self.answer.delta(content, finished) or {})
        elif content:
            delta["content"] = content
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.answer is None else self.answer.finish_reason(reason)
