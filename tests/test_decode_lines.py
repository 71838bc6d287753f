"""The wait in a decode worker's line (cluster/decode_lines.py), predicted from the
reservations it granted while handshakes waited."""

from __future__ import annotations

import pytest

from cluster.decode_lines import DecodeLines


def test_the_decode_lines_wait_from_the_grant_rate():
    lines = DecodeLines(max_wait_s=10.0)
    lines.observe("d0", num_granted=0, num_waiting=3, now_s=0.0)
    assert lines.wait_s("d0", has_room=False) is None  # one reading: no rate, no prediction
    for second in range(1, 9):  # 4 grants a second, then 1 a second from t=5
        lines.observe("d0", num_granted=4 * min(second, 5) + max(second - 5, 0), num_waiting=3, now_s=float(second))
    assert lines.grant_rate("d0") == pytest.approx((23 - 12) / (8 - 3))  # over the last 5 s only
    assert lines.wait_s("d0", has_room=False) == pytest.approx(4 / 2.2)
    assert lines.wait_s("d0", has_room=True) == pytest.approx(4 / 2.2)  # room, but others wait ahead
    lines.observe("d0", num_granted=23, num_waiting=3, now_s=14.0)
    assert lines.wait_s("d0", has_room=False) == 10.0  # nothing granted while handshakes wait: stuck
    lines.observe("d0", num_granted=2, num_waiting=0, now_s=15.0)  # a new worker under the id: start again
    assert lines.grant_rate("d0") is None and lines.wait_s("d0", has_room=True) == 0.0


def test_grants_between_readings_without_a_line_say_nothing_of_how_fast_d_frees_room():
    """10 grants a second while nobody waited (requests arriving at a D with
    room): no rate, so no prediction for a burst's request past D's room;
    then a second with a line, 3 grants in it: the rate is 3 a second; then
    one without, 1 grant in it: 2 a second over the two."""
    lines = DecodeLines(max_wait_s=10.0)
    for second in range(4):
        lines.observe("d0", num_granted=10 * second, num_waiting=0, now_s=float(second))
    assert lines.grant_rate("d0") is None and lines.wait_s("d0", has_room=False, joined=20) is None
    lines.observe("d0", num_granted=30, num_waiting=5, now_s=4.0)
    assert lines.grant_rate("d0") is None  # a line read, but no span after it yet
    lines.observe("d0", num_granted=33, num_waiting=2, now_s=5.0)
    assert lines.grant_rate("d0") == pytest.approx(3.0)
    assert lines.wait_s("d0", has_room=False, joined=1) == pytest.approx((2 + 1 + 1) / 3)
    lines.observe("d0", num_granted=34, num_waiting=0, now_s=6.0)  # the line gone, 1 grant: still counted
    assert lines.grant_rate("d0") == pytest.approx((34 - 30) / 2)


def test_a_decode_worker_that_granted_nothing_and_has_no_room_means_the_whole_wait():
    """The line was read, then emptied with no grant (its handshakes aborted or
    refused): a rate of zero. A request without room was predicted no wait at
    all (one grant in the span gave it two seconds), admitted, and then waited
    out its handshake on a D that frees nothing."""
    lines = DecodeLines(max_wait_s=10.0)
    lines.observe("d0", num_granted=10, num_waiting=3, now_s=0.0)
    lines.observe("d0", num_granted=10, num_waiting=0, now_s=2.0)
    assert lines.grant_rate("d0") == 0.0
    assert lines.wait_s("d0", has_room=False) == 10.0
    assert lines.wait_s("d0", has_room=True) == 0.0  # with room and nobody ahead: no wait
