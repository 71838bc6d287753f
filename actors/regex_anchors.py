"""A regular expression's anchors and global flags, as text: what a pattern
matched whole can do without (`^` and `$` at its ends or its top-level
alternatives' ends), and the flags that must stay in front of any pattern it is
put after. Read by actors/regex_dfa.py (its automaton takes no anchor inside),
actors/json_schema.py (a string's `pattern` between its quotes) and
cluster/reasoning.py (a client's pattern after the reasoning)."""

from __future__ import annotations

import re


def unanchored(pattern: str) -> str:
    """`pattern` without the `^` (`\\A`) and `$` (`\\Z`) that begin and end it or
    each of its top-level alternatives (`^yes$|^no$`), an escaped `\\$` kept, its
    global flags (`(?s)`) left in front: matched whole, the same language, and
    one that can be put after another pattern (the reasoning before an answer,
    `split_flags`), where an anchor could not stand. (A text `removesuffix("$")`
    made `^[0-9]+\\$` a bad escape.)"""
    flags, pattern = split_flags(pattern)
    alternatives, start, depth, i = [], 0, 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 1  # the escaped character
        elif char == "[":  # a class: to its closing bracket (one first, or after ^, is a member)
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += 1 if pattern[i:i + 1] == "]" else 0
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif char in "()":
            depth += 1 if char == "(" else -1
        elif char == "|" and depth == 0:
            alternatives.append(pattern[start:i])
            start = i + 1
        i += 1
    alternatives.append(pattern[start:])
    return flags + "|".join(_without_anchors(a) for a in alternatives)


_GLOBAL_FLAGS = re.compile(r"(?:\(\?[aiLmsux]+\))+")


def split_flags(pattern: str) -> tuple[str, str]:
    """(the global flags a pattern begins with, such as `(?s)`, the rest): a
    pattern put after another has its flags go in front of both, where Python
    takes them (they hold for the whole pattern either way)."""
    flags = _GLOBAL_FLAGS.match(pattern)
    return (flags.group(), pattern[flags.end():]) if flags else ("", pattern)


def _without_anchors(alternative: str) -> str:
    alternative = alternative[2:] if alternative.startswith("\\A") else alternative.removeprefix("^")
    for anchor in ("$", "\\Z"):
        before = alternative[:-len(anchor)]
        if alternative.endswith(anchor) and (len(before) - len(before.rstrip("\\"))) % 2 == 0:
            return before  # (an even run of backslashes before it: the anchor is not escaped)
    return alternative
