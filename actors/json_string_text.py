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

Each character the rewrite writes is one character of the value, so a schema's
`minLength` and `maxLength` beside a `pattern` (or a `format`, whose text is its
own) can be held where the pattern's parse says how: it needs nothing where every
value it matches has a length within them, and where its one part of varying
length is a character repeated, that repeat's bounds are narrowed (`within`;
pydantic's `constr(pattern=r"^[a-z0-9_]+$", min_length=3, max_length=32)`). Any
other pair needs two automata intersected, which a pattern's text cannot say.
"""

from __future__ import annotations

import math
import re

from actors.code_points import MAX_CODE_POINT, complement, merged
from actors.regex_dfa import CHARACTER_OPS, RegexError, character_ranges, parse_whole, sre

ESCAPED = {0x22: '\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x0C: "\\\\f", 0x0A: "\\\\n", 0x0D: "\\\\r", 0x09: "\\\\t"}
NOT_AS_THEMSELVES = merged([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])  # in a JSON string's text


def json_string_text(pattern: str, low: int = 0, high: int | None = None) -> str:
    """The pattern of the JSON texts (between the quotes) of the values `pattern`
    matches whole (read as actors/regex_dfa.py reads it: `parse_whole`), of `low`
    to `high` characters (a schema's minLength and maxLength: `within`)."""
    items, dotall = parse_whole(pattern)
    return _Writer(dotall).sequence(within(items, low, high))


def within(items: list, low: int, high: int | None) -> list:
    """`items` (a parsed pattern) held to values of `low` to `high` characters: as
    they are where every value they match has a length within (`^[A-Z]{3}$` of at
    most 10); else with the bounds of their one part of varying length narrowed,
    where that part is one character repeated (`^[a-z0-9_]+$` of 3 to 32 is
    `[a-z0-9_]{3,32}`, `^[A-Z][a-z]*$` of at most 20 is `[A-Z][a-z]{0,19}`).
    Anything else needs two automata intersected, which a pattern's text cannot
    say: RegexError, as where no value could have both."""
    fewest, most = _lengths(items)
    if fewest >= low and (high is None or most is not None and most <= high):
        return items
    items = _flattened(items)  # (`^([a-z]+)$`: its group's items are the sequence's)
    varying = [i for i, item in enumerate(items) if len(set(_lengths([item]))) > 1]
    if len(varying) == 1 and items[varying[0]][0] in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        op, (least, greatest, part) = items[varying[0]]
        if _lengths(part) == (1, 1):
            fixed = fewest - least
            least = max(least, low - fixed)
            greatest = min(math.inf if greatest == sre.MAXREPEAT else greatest,
                           math.inf if high is None else high - fixed)
            if least > greatest:
                raise RegexError("no value matches both the pattern and the minLength/maxLength")
            bounds = (least, sre.MAXREPEAT if greatest == math.inf else int(greatest), part)
            return items[:varying[0]] + [(op, bounds)] + items[varying[0] + 1:]
    if most is not None and (most < low or high is not None and fewest > high):
        raise RegexError("no value matches both the pattern and the minLength/maxLength")
    raise RegexError("minLength/maxLength with a pattern or format are held where the pattern's own lengths lie "
                     "within them, or where one part of it varies in length, a character repeated")


def _flattened(items) -> list:
    """A sequence with its groups' items in their place."""
    return [flat for op, av in items for flat in (_flattened(av[3]) if op is sre.SUBPATTERN else [(op, av)])]


def _lengths(items) -> tuple[int, int | None]:
    """The fewest and the most characters of a text `items` matches (None: no most)."""
    fewest, most = 0, 0
    for op, av in items:
        if op in CHARACTER_OPS:
            least, greatest = 1, 1
        elif op is sre.SUBPATTERN:
            least, greatest = _lengths(av[3])
        elif op is sre.BRANCH:
            options = [_lengths(option) for option in av[1]]
            least = min(a for a, _ in options)
            greatest = None if any(b is None for _, b in options) else max(b for _, b in options)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            times_low, times_high, part = av
            part_low, part_high = _lengths(part)
            least = times_low * part_low
            greatest = (0 if part_high == 0 else None if part_high is None or times_high == sre.MAXREPEAT
                        else times_high * part_high)
        else:
            raise RegexError(f"regex: {str(op).lower()} is not supported")  # (the automaton refused it first)
        fewest += least
        most = None if most is None or greatest is None else most + greatest
    return fewest, most


class _Writer:
    def __init__(self, dotall: bool) -> None:
        self.dotall = dotall

    def sequence(self, items) -> str:
        return "".join(self.item(op, av) for op, av in items)

    def item(self, op, av) -> str:
        if op in CHARACTER_OPS:
            return _characters(character_ranges(op, av, self.dotall, portable=True))
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
