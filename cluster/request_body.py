"""What every HTTP request body shares (cluster/api_models.py's OpenAI bodies,
cluster/sglang_body.py's /generate, cluster/responses_body.py's Responses): fields
it does not support refused unless "off", and its JSON types held as JSON has
them (null as a field's default, no number from a boolean or a string); a token
id and a logit_bias object as JSON writes them."""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict, model_validator

class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # Fields SGLang, vLLM or OpenAI take that change what is generated, which Tandem
    # does not implement: a request that sets one (to anything but the values that
    # mean "off") is refused instead of being served as if it had not.
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}
    UNSUPPORTED_WHY: ClassVar[dict[str, str]] = {}  # what to do instead, where the refusal should say

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, off in cls.UNSUPPORTED.items():
                if name in data and data[name] not in off:
                    why = cls.UNSUPPORTED_WHY.get(name)
                    raise ValueError(f"{name} is not supported" + (f": {why}" if why else ""))
            return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}  # "off": as if left out
        return data

    @model_validator(mode="before")
    @classmethod
    def _json_types(cls, data):
        """null in a field that has a default and takes no null is its default
        (OpenAI's fields are nullable, and its SDK sends null for an argument
        given as None: `"n": null` was a 400); a number is never a boolean nor
        a string, and a boolean never a number nor a string (pydantic's lax
        mode served `"max_tokens": true` as 1, `"temperature": "0.5"` as 0.5 and
        `"stream": "yes"` or `1` as a stream; OpenAI refuses them)."""
        if not isinstance(data, dict):
            return data
        types_of = _json_types_of(cls)
        out = {}
        for key, value in data.items():
            if key not in types_of:
                out[key] = value
                continue
            kinds, defaults_null = types_of[key]
            if value is None and defaults_null:
                continue
            if isinstance(value, (bool, int, float, str)):
                numbers = kinds & {int, float}
                if isinstance(value, bool) and numbers and bool not in kinds:
                    raise ValueError(f"{key} must be a number, not {str(value).lower()}")
                if not isinstance(value, (bool, str)) and bool in kinds and not numbers:
                    raise ValueError(f"{key} must be true or false, not a number")
                if isinstance(value, str) and (numbers or bool in kinds) and str not in kinds:
                    raise ValueError(f"{key} must be {'a number' if numbers else 'true or false'}, not a string")
            out[key] = value
        return out


@functools.cache
def _json_types_of(cls) -> dict[str, tuple[set[type], bool]]:
    """Each field of a body class: the JSON scalar types it takes, and whether a
    null in it is its default (it has one, and takes no null). Read once a class,
    not for every request's every key."""
    return {name: (_scalar_kinds(field.annotation), not field.is_required() and not _takes_null(field.annotation))
            for name, field in cls.model_fields.items()}


def _takes_null(annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _takes_null(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_takes_null(arg) for arg in typing.get_args(annotation))
    return annotation is None or annotation is type(None)


def _scalar_kinds(annotation) -> set[type]:
    """The JSON scalar types (bool, int, float, str) a field's annotation takes
    (a Literal of strings takes str)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _scalar_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in typing.get_args(annotation)}
    return {annotation} & {bool, int, float, str}


# A token id as JSON writes one: an integer, never a bool or a string of digits
# (pydantic's lax mode took [true] for the prompt [1]).
TokenId = Annotated[int, Strict()]


def _token_id_key(key):
    """A logit_bias key: a token id, which JSON writes as a string of digits. Read
    as Python reads an int, "1_0" was token 10, " 5" and "+7" ids too."""
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    raise ValueError(f"a logit_bias key must be a token id (digits), got {key!r}")


def _token_biases(value):
    """A logit_bias object, its keys read as token ids: two keys naming one
    token ("5" and "05") are refused (one overwrote the other unsaid)."""
    if not isinstance(value, dict):
        return value  # (pydantic says what it must be)
    biases = {}
    for key, bias in value.items():
        token = _token_id_key(key)
        if token in biases:
            raise ValueError(f"logit_bias names token {token} twice")
        biases[token] = bias
    return biases


# token id (a string of digits in JSON) -> added to its logit: a number, never a bool or a string
LogitBias = Annotated[dict[int, Annotated[float, Strict()]], BeforeValidator(_token_biases)]
