"""A JSON schema string's `pattern`, rewritten as a pattern of the string's JSON text.

A schema's `pattern` speaks of the string's value; the output is its JSON text,
where a quote, a backslash and the control characters are written escaped. Written
between the quotes as it stands, a pattern that allows any of them (`^\\S+$`,
`^.{1,50}$`, `[^@]+@[^@]+`: most that use `.`, `\\S` or a negated class) would let
the output end its string early or write JSON a parser refuses, so such patterns
were refused. Here each character a pattern allows is written as `json.dumps`
writes it: those seven as `\\"`, `\\\\`, `\\b`, `\\f`, `\\n`, `\\r`, `\\t`, the
other control characters as `\\u00XX` (lower-case hex), every other character as
itself. The output's value then matches the pattern whenever its text matches the
rewrite, and every value the pattern matches has one text the rewrite matches: the
one `json.dumps(value, ensure_ascii=False)` writes.

The rewrite is read from Python's parse of the pattern (as actors/regex_dfa.py
reads it), which has already been checked to be one the automaton takes: groups,
alternatives and repeats are written back as they were, character sets as
classes of code points (`\\U` escapes), the pattern's own flags (`(?s)`) resolved
into the sets they change.
"""

from __future__ import annotations

import re

from actors.code_points import MAX_CODE_POINT, complement, merged
from actors.regex_dfa import RegexError, class_ranges, parse_whole, sre

ESCAPED = {0x22: '\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x0C: "\\\\f", 0x0A: "\\\\n", 0x0D: "\\\\r", 0x09: "\\\\t"}
NOT_AS_THEMSELVES = merged([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])  # in a JSON string's text


def json_string_text(pattern: str) -> str:
    """The pattern of the JSON texts (between the quotes) of the values `pattern`
    matches whole (read as actors/regex_dfa.py reads it: `parse_whole`)."""
    items, dotall = parse_whole(pattern)
    return _Writer(dotall).sequence(items)


class _Writer:
    def __init__(self, dotall: bool) -> None:
        self.dotall = dotall

    def sequence(self, items) -> str:
        return "".join(self.item(op, av) for op, av in items)

    def item(self, op, av) -> str:
        if op is sre.LITERAL:
            return _characters([(av, av)])
        if op is sre.NOT_LITERAL:
            return _characters(complement([(av, av)]))
        if op is sre.ANY:
            return _characters([(0, MAX_CODE_POINT)] if self.dotall else complement([(10, 10)]))
        if op is sre.IN:
            return _characters(class_ranges(av))
        if op is sre.SUBPATTERN:
            return f"(?:{self.sequence(av[3])})"
        if op is sre.BRANCH:
            return "(?:" + "|".join(self.sequence(items) for items in av[1]) + ")"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, items = av
            return f"(?:{self.sequence(items)}){{{low},{'' if high == sre.MAXREPEAT else high}}}"
        raise RegexError(f"regex: {str(op).lower()} is not supported")  # (the automaton refused it first)


def _characters(ranges: list[tuple[int, int]]) -> str:
    """One character of `ranges` as JSON writes it."""
    themselves = _intersection(ranges, complement(NOT_AS_THEMSELVES))
    others = [c for low, high in _intersection(ranges, NOT_AS_THEMSELVES) for c in range(low, high + 1)]
    escaped = [ESCAPED[c] for c in others if c in ESCAPED]
    hex_codes = [f"{c:02x}" for c in others if c not in ESCAPED]
    escaped += [f"\\\\u00(?:{'|'.join(hex_codes)})"] if hex_codes else []
    if not escaped and len(themselves) == 1 and themselves[0][0] == themselves[0][1]:
        return re.escape(chr(themselves[0][0]))
    parts = (["[" + "".join(_range_text(low, high) for low, high in themselves) + "]"] if themselves else []) + escaped
    if not parts:
        return f"[^\\x00-\\U{MAX_CODE_POINT:08x}]"  # (no character: the automaton has no way on)
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _range_text(low: int, high: int) -> str:
    return f"\\U{low:08x}" if low == high else f"\\U{low:08x}-\\U{high:08x}"


def _intersection(ranges: list[tuple[int, int]], others: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return merged([(max(a, c), min(b, d)) for a, b in ranges for c, d in others if max(a, c) <= min(b, d)])
