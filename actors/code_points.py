"""Sets of code points as sorted ranges, and the UTF-8 bytes of a set: what a
character class of a pattern becomes (actors/regex_dfa.py reads each character as
its UTF-8 bytes; actors/json_string_text.py writes each as JSON writes it).

A range of code points is split so each part is a product of byte ranges, one a
byte of its UTF-8 form (the split RE2 and Rust's regex crate make); surrogates,
which UTF-8 cannot hold, left out.
"""

from __future__ import annotations

import functools

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same code points as sorted ranges, none touching another."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The code points `ranges` leave out, as sorted ranges."""
    out, next_low = [], 0
    for low, high in merged(ranges):
        if low > next_low:
            out.append((next_low, low - 1))
        next_low = high + 1
    if next_low <= MAX_CODE_POINT:
        out.append((next_low, MAX_CODE_POINT))
    return out


@functools.lru_cache(maxsize=1024)
def byte_set_sequences(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[frozenset[int], ...], ...]:
    """`utf8_sequences` as sets of bytes, made once for a class a pattern repeats
    (`[\\s\\S]{2000}`: one class, two thousand copies); shared sets let the subset
    construction look up each set's byte classes once."""
    return tuple(tuple(frozenset(range(low, high + 1)) for low, high in sequence)
                 for sequence in utf8_sequences(list(ranges)))


def utf8_sequences(ranges: list[tuple[int, int]]):
    """Each code point range as UTF-8 byte-range sequences: [(low, high) a byte]."""
    for low, high in ranges:
        for part_low, part_high in ((low, min(high, SURROGATES[0] - 1)), (max(low, SURROGATES[1] + 1), high)):
            for bound_low, bound_high in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT)):
                a, b = max(part_low, bound_low), min(part_high, bound_high)
                if a <= b:
                    yield from split_same_length(a, b)


def split_same_length(low: int, high: int):
    """[low, high] (code points of one UTF-8 length) as products of byte ranges."""
    length = len(chr(low).encode())
    for i in range(1, length):
        mask = (1 << (6 * i)) - 1
        if low & ~mask != high & ~mask:
            if low & mask:
                yield from split_same_length(low, low | mask)
                yield from split_same_length((low | mask) + 1, high)
                return
            if high & mask != mask:
                yield from split_same_length(low, (high & ~mask) - 1)
                yield from split_same_length(high & ~mask, high)
                return
    yield list(zip(chr(low).encode(), chr(high).encode()))
