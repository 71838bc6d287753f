"""The blocks a decode worker's line asks for, a shared prefix once (actors/line_asks.py)."""

from __future__ import annotations

from actors.line_asks import LineAsks


def _line(hashes_of: dict[str, list[bytes]]) -> LineAsks:
    """A line whose prompts are named by a string, their hashes looked up in `hashes_of`."""
    return LineAsks(lambda prompt: hashes_of[prompt])


def test_a_burst_sharing_a_prefix_asks_for_it_once():
    """8 handshakes of 34 blocks sharing their first 32: 272 blocks were counted
    where they take 34 + 7 x 2; with D holding the prefix for a request, 8 x 2."""
    prefix = [f"system-{i}".encode() for i in range(32)]
    line = _line({f"p{index}": prefix + [f"own-{index}".encode()] for index in range(8)})
    for index in range(8):
        line.add(f"r{index}", 34, f"p{index}")
    assert line.total(held=lambda block_hash: False) == 34 + 7 * 2
    assert line.total(held=set(prefix).__contains__) == 8 * 2
    assert line.total(held=set(prefix[:10]).__contains__) == 34 - 10 + 7 * 2


def test_only_a_leading_run_is_shared_and_a_handshake_that_leaves_asks_no_more():
    line = _line({"abc": [b"a", b"b", b"c"], "axc": [b"a", b"x", b"c"], "": []})
    line.add("first", 6, "abc")
    line.add("parted", 6, "axc")  # (no real chain: its third hash follows from its second)
    line.add("no-prefix", 1, "")
    assert line.total(held=lambda block_hash: False) == 6 + 5 + 1
    line.remove("first")
    assert line.total(held=lambda block_hash: False) == 6 + 1
