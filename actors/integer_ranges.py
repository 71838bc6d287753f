"""An integer range as a regular expression over its decimal text (JSON schema's
`minimum`, `maximum` and their exclusive forms on an `integer`; actors/json_schema.py).

The range is split by sign, then by number of digits, then digit by digit: numbers
of one length from x to y are x's first digit followed by the range from x's tail
to all nines, the digits between followed by any digits, and y's first digit
followed by zeros to y's tail (the split RE2's tools and `regex-range`-style
libraries make). No leading zeros, no "-0", as JSON writes integers.
"""

from __future__ import annotations


def integer_range_regex(low: int | None, high: int | None) -> str:
    """Every integer in [low, high] (None: unbounded), written as JSON writes it."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"empty range [{low}, {high}]")
    parts = []
    if low is None or low < 0:  # negatives: "-" and a magnitude in [max(1, -high), -low]
        if high is None or high < 0:
            parts.append("-" + _natural_range(1 if high is None else -high, None if low is None else -low))
        else:
            parts.append("-" + _natural_range(1, None if low is None else -low))
    if high is None or high >= 0:
        parts.append(_natural_range(max(low or 0, 0), high))
    return "(?:" + "|".join(parts) + ")"


def _natural_range(low: int, high: int | None) -> str:
    """The integers in [low, high] (0 <= low; high None: unbounded)."""
    if high is None:  # low's length up to all nines, then any longer number
        length = len(str(low))
        parts = _same_length(str(low), "9" * length) + [f"[1-9][0-9]{{{length},}}"]
    else:
        parts = []
        for length in range(len(str(low)), len(str(high)) + 1):
            first = max(low, 10 ** (length - 1) if length > 1 else 0)
            parts += _same_length(str(first), str(min(high, 10**length - 1)))
    return "(?:" + "|".join(parts) + ")"


def _same_length(x: str, y: str) -> list[str]:
    """Patterns for the numbers from x to y, both of the same number of digits."""
    if len(x) == 1:
        return [_digits(x, y)]
    if x[0] == y[0]:
        return [x[0] + p for p in _same_length(x[1:], y[1:])]
    rest = len(x) - 1
    parts, first_full, last_full = [], int(x[0]), int(y[0])
    if x[1:] != "0" * rest:
        parts += [x[0] + p for p in _same_length(x[1:], "9" * rest)]
        first_full += 1
    tail = []
    if y[1:] != "9" * rest:
        tail = [y[0] + p for p in _same_length("0" * rest, y[1:])]
        last_full -= 1
    if first_full <= last_full:
        parts.append(_digits(str(first_full), str(last_full)) + f"[0-9]{{{rest}}}")
    return parts + tail


def _digits(x: str, y: str) -> str:
    return x if x == y else f"[{x}-{y}]"
