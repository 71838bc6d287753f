"""A JSON schema, or "any JSON object", as a regular expression (actors/regex_dfa.py).

OpenAI's `response_format` (`json_schema`, `json_object`), vLLM's `guided_json` and
SGLang's `json_schema` ask for output that is JSON of a shape. A regular expression
cannot count brackets, so this writes the shape out as one, as outlines does:
- `object`: its `properties` in the order given, each required one present, the
  others optional; no property the schema does not name (outlines and OpenAI's
  strict mode generate none either). Without `properties`, an object whose values
  match `additionalProperties` (`{}` where it is false), or any JSON object where
  it says nothing; `required` names properties `properties` must list;
- `array` of `items`, `minItems`/`maxItems`; `string` with `minLength`/`maxLength`
  (in characters: no half of a surrogate pair as an escape), `enum`, `const`,
  `pattern` (as a Python regex of the value, matched whole, its `^` and `$`
  dropped; its characters written as JSON writes them: actors/json_string_text.py),
  `format` (`FORMATS`: date, time, date-time, uuid, ipv4, email), either with
  length bounds where its own lengths lie within them or its one part of varying
  length is a character repeated (`within`); `integer` with `minimum`,
  `maximum` and their exclusive forms (actors/integer_ranges.py); `number`, with
  whole bounds from 0 up; `boolean`, `null`; a list of types (each with the keywords
  that apply to it); `anyOf`; `oneOf` of options no value can match two of
  (different types, or enums of different values: the others are refused);
  `$ref` into `$defs`/`definitions` (not recursive);
- free JSON: `json_object` any object `FREE_DEPTH` levels of objects and arrays
  deep; a value a schema leaves free (`{}`, an object without `properties`, an
  array without `items`) `NESTED_FREE_DEPTH` levels (actors/json_text.py writes
  JSON's own text).
The text is laid out as `json.dumps` writes it: `", "` and `": "` between items,
nothing inside the brackets. One layout, not any whitespace (outlines' `[ ]?`,
xgrammar's any): a small model cannot pad the output with spaces, and the keys with
their quotes, colons and commas are then text nothing else could be, which
jump-forward writes without a model step (actors/structured_output.py).

A keyword that would constrain the value in a way the expression does not
(`multipleOf`, `uniqueItems`, `patternProperties`, `not`, another format, ...) is
refused with its name rather than ignored: the output would not be held to it.
Annotations (`title`, `description`, `default`, `examples`, `$schema`, ...) are
ignored. A schema must first be a valid one: it is checked against the JSON Schema
meta-schema its `$schema` names (2020-12 without one; drafts from 4 on; the
`jsonschema` package), so
`"required": "a"` or `"$defs": 5` is refused with where and why, as is an `enum` or
`const` whose values its own `type` does not allow (no output could be valid).
"""

from __future__ import annotations

import json
import math
import re
from urllib.parse import unquote

from actors.integer_ranges import integer_range_regex
from actors.json_text import (COLON, COUNTED_CHAR, INTEGER, NESTED_FREE_DEPTH, NUMBER, SCALARS, STRING, array_of,
                               free_json_regex, members_of, object_of)
from actors.json_string_text import json_string_text
from actors.json_values import KINDS, Shape, canonical, is_of_type, kinds_of_value, may_overlap
from actors.regex_anchors import unanchored
from actors.regex_dfa import RegexError, compile_regex

# A schema's pattern, and each of its parts, is at most this long: longer ones pass the
# automaton's bounds anyway (actors/regex_dfa.py: 40k characters of nested arrays did).
MAX_PATTERN_CHARS = 200_000
MAX_WRITTEN_CHARS = 20 * MAX_PATTERN_CHARS  # of all parts as written (nested ones counted at each level)
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict", "name"}
# Each month's days (February's 29 whatever the year: leap years are not checked)
_DATE = (r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-9]))")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_BYTE = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMATS = {  # a string's `format`, as the text between its quotes (RFC 3339's date and time; no leap-year check)
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"{_BYTE}(?:\.{_BYTE}){{3}}",
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+",  # the common subset of RFC 5322's addresses
}
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "pattern", "format"},
    "integer": {"type", *BOUNDS}, "number": {"type", *BOUNDS}, "boolean": {"type"}, "null": {"type"},
}


def schema_regex(schema, what: str = "json_schema") -> str:
    """The pattern of the JSON text `schema` describes; RegexError (a 400) if it
    is not a schema this can hold an output to. `what` names the schema in the
    meta-schema's complaints (a tool's parameters, say)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema, parse_constant=_not_json, parse_float=_finite)
        except ValueError as exc:
            raise RegexError(f"json_schema is not valid JSON: {exc}") from None
    check_json_schema(schema, what)
    try:
        return _Writer(schema).value(schema, path="")
    except RecursionError:
        raise RegexError("json_schema is nested too deeply") from None


def check_json_schema(schema, what: str = "json_schema") -> None:
    """RegexError (a 400) saying where and why, if `schema` is not a JSON object
    that keeps to the meta-schema of its draft."""
    if not isinstance(schema, dict):
        raise RegexError(f"{what} must be a JSON object (a schema)")
    problem = _meta_schema_problem(schema)
    if problem is not None:
        raise RegexError(f"{what} is not a valid JSON schema: {problem}")


def _meta_schema_problem(schema: dict) -> str | None:
    """Where and why `schema` breaks the meta-schema of its draft, or None."""
    from jsonschema import exceptions, validators

    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        return "$schema must be a string, the URI of a draft"
    draft = validators.validator_for(schema, default=validators.Draft202012Validator)
    supported = (validators.Draft4Validator, validators.Draft6Validator, validators.Draft7Validator,
                 validators.Draft201909Validator, validators.Draft202012Validator)
    if draft not in supported:  # (draft 3: `required` a boolean, `type` a list of schemas)
        return f"$schema {declared!r}: drafts 4, 6, 7, 2019-09 and 2020-12 are supported"
    try:
        error = exceptions.best_match(draft(draft.META_SCHEMA).iter_errors(schema))
    except RecursionError:
        return "it is nested too deeply"
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    message = " or ".join(e.message for e in error.context) or error.message  # (anyOf's: each option's reason)
    message = message if len(message) <= 300 else message[:300] + "..."
    return f"at {where}: {message}" if where else message


def definition_key(ref) -> tuple[str, str] | None:
    """The definition a `$ref` points at: `$defs` or `definitions`, and the name
    there, its JSON pointer's escapes decoded (`~1` a "/", `~0` a "~", after the
    URI's `%xx`: `a~1b` names `a/b`); None for any other reference. (By name
    alone, `#/definitions/x` read `$defs`' x where a schema had both.)"""
    match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
    if match is None:
        return None
    return match.group(1), unquote(match.group(2)).replace("~1", "/").replace("~0", "~")


def _literal(value, where: str) -> str:
    """The pattern of exactly `value`'s JSON text (a const's, an enum's); a number
    past a double's range, read as Infinity, is no JSON and is refused."""
    try:
        return re.escape(_json_text(value, allow_nan=False))
    except ValueError:
        raise RegexError(f"json_schema: {where} holds a number that is not finite (JSON has no NaN nor "
                         "Infinity)") from None


def _json_text(value, **options) -> str:
    """`value`'s JSON text as `json.dumps` writes it, its characters as they are;
    but where a string holds a lone surrogate (JSON's `"\\ud800"`, no character
    UTF-8 can write), escaped to ASCII: written raw, its code point was dropped,
    and the value (an enum's option, a property's name) could not be written."""
    text = json.dumps(value, ensure_ascii=False, **options)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True, **options)
    return text


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


class _Writer:
    def __init__(self, root: dict) -> None:
        for name in ("definitions", "$defs"):  # (draft 7's meta-schema does not know `$defs`: any value passed)
            if not isinstance(root.get(name, {}), dict):
                raise RegexError(f"json_schema: {name} must be an object of schemas")
        self.definitions = {(section, name): schema for section in ("definitions", "$defs")
                            for name, schema in root.get(section, {}).items()}
        self.resolving: list[tuple[str, str]] = []
        self.written = 0  # characters of every part's pattern so far (a part's are counted in each above it too)

    def value(self, schema, path: str) -> str:
        """The pattern of the values `schema` (at `path`) describes, each part
        checked against `MAX_PATTERN_CHARS` as it is written, and all parts
        together against `MAX_WRITTEN_CHARS`: an array or a map writes its item's
        pattern twice, and an 800-byte schema nesting arrays 25 deep wrote
        patterns of gigabytes (a worker killed for its memory); an object of
        3000 properties each a reference to one large definition joined them
        all before its own length was read (2 GB for a 127 KB schema)."""
        pattern = self._value(schema, path)
        self.written += len(pattern)
        if len(pattern) > MAX_PATTERN_CHARS or self.written > MAX_WRITTEN_CHARS:
            raise RegexError(f"json_schema is too large: the pattern of {path or 'the schema'} passes "
                             f"{MAX_PATTERN_CHARS} characters (nest fewer arrays, maps or references)")
        return pattern

    def _value(self, schema, path: str) -> str:
        where = path or "the schema"
        if schema is True or schema == {}:
            return free_json_regex(NESTED_FREE_DEPTH, "value")
        if not isinstance(schema, dict):
            raise RegexError(f"json_schema: {where} must be a schema (an object)")
        if path and "$id" in schema and ("$defs" in schema or "definitions" in schema):
            # (its references name its own definitions, `#` being it: read as the root's, a string was an integer)
            raise RegexError(f"json_schema: {where}: a subschema with its own $id and definitions (an embedded "
                             "resource) is not supported; move its definitions to the root")
        if "$ref" in schema:
            return self._reference(schema, where, path)
        for name in ("anyOf", "oneOf"):
            if name in schema:
                options = schema[name]
                if not isinstance(options, list) or not options:
                    raise RegexError(f"json_schema: {where}.{name} must be a non-empty list")
                self._only(schema, {name}, where)
                if name == "oneOf":
                    self._one_of_disjoint(options, where)
                return "(?:" + "|".join(self.value(s, f"{path}.{name}[{i}]") for i, s in enumerate(options)) + ")"
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise RegexError(f"json_schema: {where}.allOf is supported with one schema only")
            self._only(schema, {"allOf"}, where)
            return self.value(parts[0], f"{path}.allOf[0]")
        if "const" in schema:
            self._only(schema, {"const", "type"}, where)
            self._typed(schema, [schema["const"]], f"{where}.const")
            return _literal(schema["const"], f"{where}.const")
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise RegexError(f"json_schema: {where}.enum must be a non-empty list")
            self._only(schema, {"enum", "type"}, where)
            self._typed(schema, values, f"{where}.enum")
            return "(?:" + "|".join(_literal(v, f"{where}.enum") for v in values) + ")"
        kind = schema.get("type")
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                self._only(schema, set(), where)
                return free_json_regex(NESTED_FREE_DEPTH, "value")
        if isinstance(kind, list):  # each type with the keywords that apply to it
            if not kind or any(k not in KEYWORDS for k in kind):
                raise RegexError(f"json_schema: {where}.type must list JSON types, got {kind!r}")
            self._only(schema, set().union(*(KEYWORDS[k] for k in kind)), where)
            return "(?:" + "|".join(self.value({name: value for name, value in schema.items()
                                                if name in KEYWORDS[k] or name in ANNOTATIONS} | {"type": k}, path)
                                    for k in kind) + ")"
        if kind not in KEYWORDS:
            raise RegexError(f"json_schema: {where}.type {kind!r} is not a JSON type")
        self._only(schema, KEYWORDS[kind], where)
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        if kind == "string":
            return self._string(schema, where)
        if kind == "integer":
            return self._integer(schema, where)
        if kind == "number":
            return self._number(schema, where)
        return SCALARS[kind]

    def _one_of_disjoint(self, options: list, where: str) -> None:
        """oneOf is written as anyOf, which is exact only where no value matches two
        options: their JSON types differ (an integer is a number too), or they are
        enums or consts of different values. Other oneOf are refused: a value the
        options share would be written, and it matches none of oneOf."""
        shapes = [self._shape(option) for option in options]
        for i, first in enumerate(shapes):
            for j in range(i + 1, len(shapes)):
                if may_overlap(first, shapes[j]):
                    raise RegexError(f"json_schema: {where}.oneOf options {i} and {j} may both match a value, "
                                     "which oneOf forbids and the expression cannot: use anyOf, or options of "
                                     "different types")

    def _shape(self, schema, seen: frozenset = frozenset()) -> Shape | None:
        """What values a schema may match, coarsely; None for any value (unknown)."""
        if not isinstance(schema, dict) or not schema:
            return None
        if "$ref" in schema:
            key = definition_key(schema["$ref"])
            if key in seen or key not in self.definitions:
                return None
            return self._shape(self.definitions[key], seen | {key})
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list):
                return None
            return Shape(frozenset().union(*(kinds_of_value(v) for v in values)),
                          frozenset(json.dumps(canonical(v), sort_keys=True) for v in values))
        for name in ("anyOf", "oneOf"):
            if isinstance(schema.get(name), list):
                shapes = [self._shape(option, seen) for option in schema[name]]
                if any(shape is None for shape in shapes):
                    return None
                return Shape(frozenset().union(*(shape.kinds for shape in shapes)))
        kind = schema.get("type")
        if kind is None:  # (`properties` or `items` alone hold objects or arrays, and let every other value by)
            return None
        kinds = kind if isinstance(kind, list) else [kind]
        return Shape(frozenset().union(*(KINDS.get(k, frozenset(KINDS)) for k in kinds)))

    @staticmethod
    def _typed(schema: dict, values: list, where: str) -> None:
        """Every value of an enum or const is of the schema's `type`, where it has one."""
        kinds = schema.get("type")
        if kinds is None:
            return
        kinds = kinds if isinstance(kinds, list) else [kinds]
        for value in values:
            if not any(is_of_type(value, kind) for kind in kinds):
                raise RegexError(f"json_schema: {where} value {json.dumps(value)[:80]} is not of type "
                                 f"{' or '.join(kinds)}: no output could match the schema")

    def _bounds(self, schema: dict, where: str) -> tuple[float | None, float | None]:
        """(lowest, highest) allowed: minimum/maximum, or their exclusive forms."""
        for name in BOUNDS:
            value = schema.get(name, 0)  # (an int is finite: math.isfinite(10**400) raises OverflowError)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                                   and not math.isfinite(value)):
                boolean = " (draft 4's true/false form is not supported: give the bound itself)" * isinstance(value, bool)
                raise RegexError(f"json_schema: {where}.{name} must be a finite number{boolean}")
        if "minimum" in schema and "exclusiveMinimum" in schema or "maximum" in schema and "exclusiveMaximum" in schema:
            raise RegexError(f"json_schema: {where}: give minimum or exclusiveMinimum (maximum or "
                             "exclusiveMaximum), not both")
        return (schema.get("minimum", schema.get("exclusiveMinimum")),
                schema.get("maximum", schema.get("exclusiveMaximum")))

    def _integer(self, schema: dict, where: str) -> str:
        low, high = self._bounds(schema, where)
        if low is None and high is None:
            return INTEGER
        low = None if low is None else math.floor(low) + 1 if "exclusiveMinimum" in schema else math.ceil(low)
        high = None if high is None else math.ceil(high) - 1 if "exclusiveMaximum" in schema else math.floor(high)
        if low is not None and high is not None and low > high:
            raise RegexError(f"json_schema: {where} allows no integer (minimum above maximum)")
        return integer_range_regex(low, high)

    def _number(self, schema: dict, where: str) -> str:
        """Bounded numbers: whole bounds from 0 up only (a price, a score, a rating),
        written without an exponent: [a, b] as an integer part in [a, b - 1] and
        any fraction, or b and a fraction of zeros."""
        low, high = self._bounds(schema, where)
        if low is None and high is None:
            return NUMBER
        if ("exclusiveMinimum" in schema or "exclusiveMaximum" in schema or low is None or low < 0
                or low != int(low) or high is not None and (high != int(high) or high < low)):
            raise RegexError(f"json_schema: {where}: a number's bounds are supported as whole minimum (>= 0) and "
                             "maximum only; exclusive or fractional bounds, or none below, are not")
        fraction = r"(?:\.[0-9]+)?"
        if high is None:
            return integer_range_regex(int(low), None) + fraction
        below = [integer_range_regex(int(low), int(high) - 1) + fraction] if high > low else []
        return "(?:" + "|".join(below + [f"{int(high)}(?:\\.0+)?"]) + ")"

    def _only(self, schema: dict, allowed: set[str], where: str) -> None:
        unknown = sorted(set(schema) - allowed - ANNOTATIONS)
        if unknown:
            raise RegexError(f"json_schema: {where} uses {', '.join(unknown)}, which Tandem cannot hold an output to")

    def _reference(self, schema: dict, where: str, path: str) -> str:
        ref = schema["$ref"]
        key = definition_key(ref)
        if key not in self.definitions:
            raise RegexError(f"json_schema: {where}.$ref {ref!r} is not a definition of this schema")
        self._only(schema, {"$ref"}, where)
        if key in self.resolving:
            raise RegexError(f"json_schema: {key[1]!r} refers to itself; recursive schemas are not supported")
        self.resolving.append(key)
        try:
            return self.value(self.definitions[key], f"{path}.{key[0]}.{key[1]}")
        finally:
            self.resolving.pop()

    def _object(self, schema: dict, path: str) -> str:
        """An object of its `properties` (`_members`), or without them, one whose
        members' values match `additionalProperties` (none where it is false),
        any object where nothing bounds it. Without `properties` these were any
        object whatever `additionalProperties` and `required` said."""
        properties = schema.get("properties")
        if properties is None:
            if schema.get("required"):
                raise RegexError(f"json_schema: {path or 'the schema'}: required properties "
                                 f"{sorted(schema['required'])} are not in properties")
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return "\\{\\}"
            if extra is True or extra == {}:
                return free_json_regex(NESTED_FREE_DEPTH, "object")
            return object_of(self.value(extra, f"{path}.additionalProperties"))
        if not isinstance(properties, dict):
            raise RegexError(f"json_schema: {path or 'the schema'}.properties must be an object")
        required = set(schema.get("required", []))
        missing = required - set(properties)
        if missing:
            raise RegexError(f"json_schema: required properties {sorted(missing)} are not in properties")
        members = [(f'"{re.escape(_json_text(name)[1:-1])}"{COLON}'
                    f"{self.value(sub, f'{path}.{name}')}", name in required)
                   for name, sub in properties.items()]
        return "\\{" + members_of(members) + "\\}"

    def _array(self, schema: dict, path: str) -> str:
        low, high = _count_bounds(schema, "minItems", "maxItems", path or "the schema")
        items = schema.get("items", True)
        return array_of(self.value(items, f"{path}[]"), low, high)

    def _string(self, schema: dict, where: str) -> str:
        low, high = _count_bounds(schema, "minLength", "maxLength", where)
        if "format" in schema:
            if "pattern" in schema:
                raise RegexError(f"json_schema: {where}: format with pattern is not supported")
            if schema["format"] not in FORMATS:
                raise RegexError(f"json_schema: {where}.format {schema['format']!r} is not supported (supported: "
                                 f"{', '.join(FORMATS)})")
            return f'"{_held_to(FORMATS[schema["format"]], low, high, where)}"'  # (its text: no escapes)
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise RegexError(f"json_schema: {where}.pattern must be a string")
            pattern = unanchored(pattern)  # (matched whole between the quotes, where no anchor could stand)
            if pattern:  # (`^$`: the empty value)
                compile_regex(pattern)  # RegexError unless the automaton takes it (the reason why)
            return f'"{_held_to(pattern, low, high, where)}"'  # written anew from its parse, as JSON writes it
        if (low, high) == (0, None):
            return STRING
        return f'"{COUNTED_CHAR}{{{low},{"" if high is None else high}}}"'


def _held_to(pattern: str, low: int, high: int | None, where: str) -> str:
    """`json_string_text` of a string's pattern or format, its refusals saying where."""
    try:
        return json_string_text(pattern, low, high)
    except RegexError as exc:
        raise RegexError(f"json_schema: {where}: {exc}") from None


def _count_bounds(schema: dict, low_name: str, high_name: str, where: str) -> tuple[int, int | None]:
    """(at least, at most) of a count a schema bounds (items, characters)."""
    low, high = schema.get(low_name, 0), schema.get(high_name)
    if not isinstance(low, int) or low < 0 or high is not None and (not isinstance(high, int) or high < low):
        raise RegexError(f"json_schema: {where} has bad {low_name}/{high_name}")
    return low, high
