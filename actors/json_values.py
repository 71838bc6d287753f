"""What JSON values a schema's parts may match, coarsely, for a `oneOf` whose
options no value may match two of (actors/json_schema.py): JSON's kinds of value
(an integer apart from a number with a fraction), an enum's or const's values as
canonical JSON text, and whether two such shapes may meet.
"""

from __future__ import annotations

from typing import NamedTuple


JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
              "integer": int, "number": (int, float)}


def is_of_type(value, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # (a bool is an int to Python, not to JSON)
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, JSON_TYPES[kind])


# The kinds of JSON value, an integer apart from a number with a fraction: a type's kinds.
KINDS = {"null": frozenset({"null"}), "boolean": frozenset({"boolean"}), "string": frozenset({"string"}),
         "object": frozenset({"object"}), "array": frozenset({"array"}), "integer": frozenset({"integer"}),
         "number": frozenset({"integer", "fraction"})}


def kinds_of_value(value) -> frozenset:
    for kind in ("null", "boolean", "string", "object", "array", "integer"):
        if is_of_type(value, kind):
            return KINDS[kind]
    return frozenset({"fraction"})


class Shape(NamedTuple):
    """What values a schema may match, coarsely (actors/json_schema.py: `_Writer._shape`)."""

    kinds: frozenset  # the kinds of value (`KINDS`)
    values: frozenset | None = None  # an enum's or const's values as JSON text (`canonical`); None: any of its kinds


def may_overlap(first: Shape | None, second: Shape | None) -> bool:
    """Whether two shapes (None: any value) may match one value."""
    if first is None or second is None:
        return True
    if first.values is not None and second.values is not None:
        return bool(first.values & second.values)
    return bool(first.kinds & second.kinds)


def canonical(value):
    """`value` with its whole floats as integers, nested ones too: JSON Schema
    compares numbers by value (`1` and `1.0` are one value, which two oneOf
    options naming them both match)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    return value
