"""JSON text as regular expressions (actors/regex_dfa.py): its scalars and strings,
and objects and arrays laid out as `json.dumps` writes them (`", "` and `": "`
between items, nothing inside the brackets), for a JSON schema's pattern
(actors/json_schema.py) and for "any JSON" (`free_json_regex`: `json_object`, and a
value a schema leaves free).
"""

from __future__ import annotations

FREE_DEPTH = 3  # levels of objects and arrays any JSON object (`json_object`) may use
NESTED_FREE_DEPTH = 2  # and a value a schema leaves free (each copy costs automaton states)
COMMA, COLON = ", ", ": "  # json.dumps' separators, exactly
# A \u escape of a character outside the surrogates, and a surrogate pair's two: a
# lone half is no Unicode text (Rust's serde_json refuses it, as does this server's own
# door, cluster/strict_json.py, and a tool call whose arguments held one came back as text).
_ESCAPE = r"\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})"
_PAIR_ESCAPE = r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
# One character of a string whose length is bounded: a pair as escapes is left out (it
# would cost each counted character automaton states; the character itself is allowed).
COUNTED_CHAR = rf'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|{_ESCAPE})'
STRING_CHAR = rf'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|{_ESCAPE}|{_PAIR_ESCAPE})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
SCALARS = {"integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)", "null": "null", "string": STRING}


def free_json_regex(depth: int = FREE_DEPTH, top: str = "object") -> str:
    """Any JSON `top` ("object", "array" or "value") with at most `depth` levels of
    objects and arrays, the outermost included."""
    inner = "(?:" + "|".join(SCALARS.values()) + ")"
    for _ in range(depth - 1):
        inner = f"(?:{inner}|{object_of(inner)}|{array_of(inner, 0, None)})"
    containers = {"object": object_of(inner), "array": array_of(inner, 0, None)}
    return containers[top] if top in containers else f"(?:{inner}|{containers['object']}|{containers['array']})"


def members_of(members: list[tuple[str, bool]]) -> str:
    """Object members in order, the required ones present, the others optional,
    commas between. Written from the left, each member once: `seen` is the
    pattern of the members so far when at least one is written. Until a required
    one comes, nothing may precede a member, so it is the first written or
    follows what was (`(?:seen, m)` or `m`); after one, it only follows. One
    alternative per member that may come first, each repeating the rest, grew
    with the square of the members: 22 optional ones (a pydantic model of
    `Optional` fields) passed the automaton's bounds."""
    seen, may_be_empty = None, True
    for member, is_required in members:
        if seen is None:
            seen = member
        elif not may_be_empty:
            seen = f"{seen}{COMMA}{member}" if is_required else f"{seen}(?:{COMMA}{member})?"
        else:
            seen = f"(?:{seen}{COMMA})?{member}" if is_required else f"(?:{seen}(?:{COMMA}{member})?|{member})"
        may_be_empty = may_be_empty and not is_required
    if seen is None:
        return ""
    return f"(?:{seen})?" if may_be_empty else seen


def object_of(value: str) -> str:
    """Any object whose members' values match `value`."""
    member = f"{STRING}{COLON}{value}"
    return f"\\{{(?:{member}(?:{COMMA}{member})*)?\\}}"


def array_of(item: str, low: int, high: int | None) -> str:
    if high == 0:
        return "\\[\\]"
    rest = f"(?:{COMMA}{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    body = f"{item}{rest}"
    return f"\\[{body if low else f'(?:{body})?'}\\]"
