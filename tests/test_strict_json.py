"""cluster/strict_json.py: bodies decode as json.loads decodes them, except that
a string holding a lone surrogate is invalid JSON, with the field and the
character it is at."""

from __future__ import annotations

import json

import pytest

from cluster.strict_json import loads


@pytest.mark.parametrize("body, value", [
    (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001F600"}),  # a pair: one character
    (b'{"a": "\\\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash, then text
    (b'{"a": "\\\\\\\\ud800"}', {"a": "\\\\ud800"}),  # two of them
    ('{"a": "\u00e9\u4e2d"}'.encode(), {"a": "\u00e9\u4e2d"}),  # UTF-8, no escapes
    (b'[1, {"b": null}]', [1, {"b": None}]),
])
def test_valid_json_decodes_as_json_loads_does(body, value):
    assert loads(body) == value == json.loads(body)


@pytest.mark.parametrize("body, field, at", [
    (b'{"a": "\\ud800"}', "a", 7),
    (b'{"a": "x\\udc00y"}', "a", 8),  # a low half alone
    (b'{"a": "\\ud83d\\ude00", "b": {"c": [1, "\\uDBFF"]}}', "b.c.1", 38),  # after a valid pair
    (b'{"a": "\\\\\\ud800"}', "a", 9),  # an escaped backslash, then an escape
    (b'{"a": "\\ud800\\ud800\\udc00"}', "a", 7),  # a high half, then a pair
    (b'{"k\\udfff": 1}', "k\\udfff", 3),  # in a key: named by its escape
    (b'"\\ud800"', "the body", 1),
    (b'{"a": "' + bytes([0xED, 0xA0, 0x80]) + b'"}', "a", 7),  # a surrogate's UTF-8 bytes
])
def test_a_lone_surrogate_is_invalid_json_at_its_field_and_character(body, field, at):
    with pytest.raises(json.JSONDecodeError) as refused:
        loads(body)
    assert refused.value.msg.startswith(f"{field} holds a lone surrogate")
    assert refused.value.pos == at
    refused.value.msg.encode("utf-8")  # the message itself is Unicode: it goes back as JSON


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_lone_surrogate_is_refused_in_a_body_in_utf_16_or_32_too(encoding):
    """json.loads reads them, and the lone surrogate's escape, its bytes NUL
    between, did not show to the quick look for one: it was let through."""
    with pytest.raises(json.JSONDecodeError, match="^a holds a lone surrogate"):
        loads('{"a": "\\ud800"}'.encode(encoding))
    assert loads('{"a": "\\ud83d\\ude00"}'.encode(encoding)) == {"a": "\U0001F600"}


@pytest.mark.parametrize("body, name", [
    (b'{"a": NaN}', "NaN"), (b'{"a": [1, -Infinity]}', "-Infinity"),
    (b'{"a": {"b": 1e400}}', "1e400"),  # (past a double's range: read as inf, no JSON once written again)
])
def test_numbers_json_does_not_have_are_invalid_json(body, name):
    with pytest.raises(json.JSONDecodeError, match=f"^{name} is "):
        loads(body)
