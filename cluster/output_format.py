"""The APIs' ways of asking for structured output, as the one pattern the engine holds
an output to (`SamplingParams.regex`; actors/structured_output.py).

- OpenAI: `response_format` `{"type": "json_object"}` (any JSON object) or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
  `{"type": "text"}` is the default, no constraint.
- vLLM's extensions: `guided_json` (a schema, or its text), `guided_regex`,
  `guided_choice` (one of these strings), and their newer spelling
  `structured_outputs` `{"json" | "regex" | "choice" | "json_object": ...}`.
- SGLang's `sampling_params`: `regex`, `json_schema` (a schema's text).
- OpenAI's tools with `tool_choice` naming a function or "required"
  (cluster/tool_calls.py).
A request may ask in one way only; two are refused rather than one picked.
A JSON schema becomes a pattern through actors/json_schema.py, which refuses the
keywords it could not hold an output to. (Grammars, EBNF and tool calls are not
regular: they stay refused, cluster/api_models.py's `UNSUPPORTED`.)
"""

from __future__ import annotations

from actors.json_schema import schema_regex
from actors.json_text import free_json_regex
from actors.regex_dfa import RegexError, choice_regex

STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "json_object"}


def one_pattern(asked: dict[str, object]) -> str | None:
    """The pattern of the one way `asked` names (field name -> its pattern), or
    None when none is asked."""
    named = {name: pattern for name, pattern in asked.items() if pattern is not None}
    if len(named) > 1:
        raise RegexError(f"give one way of structuring the output, not {' and '.join(sorted(named))}")
    return next(iter(named.values()), None)


def response_format_regex(response_format: dict | None) -> str | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return free_json_regex()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RegexError("response_format json_schema needs json_schema.schema (the JSON schema)")
        return schema_regex(spec["schema"])
    raise RegexError(f"response_format type {kind!r} is not one of text, json_object, json_schema")


def structured_outputs_regex(spec: dict | None) -> str | None:
    if spec is None:
        return None
    unknown = sorted(set(spec) - STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise RegexError(f"structured_outputs: {', '.join(unknown)} not supported (supported: "
                         f"{', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))})")
    return one_pattern({
        "structured_outputs.json": None if spec.get("json") is None else schema_regex(spec["json"]),
        "structured_outputs.regex": spec.get("regex"),
        "structured_outputs.choice": None if spec.get("choice") is None else choice_regex(spec["choice"]),
        "structured_outputs.json_object": free_json_regex() if spec.get("json_object") else None,
    })


# An OpenAI-style body's fields that ask for a pattern, each with what makes it one.
OPENAI_FIELDS = {
    "response_format": response_format_regex,
    "guided_json": schema_regex,
    "guided_regex": lambda pattern: pattern,
    "guided_choice": choice_regex,
    "structured_outputs": structured_outputs_regex,
}


def openai_asks(body) -> dict[str, object]:
    """The fields of an OpenAI-style body (cluster/api_models.py) that ask for a
    pattern, as given (nothing compiled: cheap)."""
    asked = {name: getattr(body, name) for name in OPENAI_FIELDS if getattr(body, name) is not None}
    if (asked.get("response_format") or {}).get("type") == "text":
        del asked["response_format"]
    return asked


def openai_regex(body, **more: str | None) -> str | None:
    """The pattern an OpenAI-style body asks for; `more`: other fields' patterns (a
    chat's tool_choice, cluster/tool_calls.py)."""
    return one_pattern({**more, **{name: OPENAI_FIELDS[name](value) for name, value in openai_asks(body).items()}})


def sglang_regex(params) -> str | None:
    """The pattern SGLang's `sampling_params` (cluster/sglang_body.py) ask for."""
    return one_pattern({
        "regex": params.regex,
        "json_schema": None if params.json_schema is None else schema_regex(params.json_schema),
    })
