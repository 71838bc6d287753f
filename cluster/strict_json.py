"""Request bodies decoded as strict JSON: a lone surrogate is refused, and so
are NaN and Infinity (Python's decoder reads them; JSON has no such number).

JSON's `\\uXXXX` escapes can spell half of a UTF-16 pair on its own
(`"\\ud800"`), and Python's decoder turns it into a `str` that holds a lone
surrogate, which is not Unicode: the tokenizer then raises a TypeError, and
storing the text a UnicodeEncodeError, deep inside an endpoint (a 500). RFC 8259
(section 8.2) leaves such strings' behaviour unpredictable and I-JSON (RFC 7493)
forbids them; strict parsers, Rust's serde_json among them, refuse them. So does
Tandem, at the door, as invalid JSON: a 400 that names the field and the
character, before any endpoint sees the body.

`StrictJsonRoute` is the route class of the app and of every router it includes
(cluster/app.py, cluster/stored_endpoints.py): FastAPI then reads each body
through `StrictJsonRequest.json`, and its JSONDecodeError becomes the usual
`json_invalid` validation error (cluster/ingress_guard.py words it).
"""

from __future__ import annotations

import json
import math
import re

from fastapi import Request
from fastapi.routing import APIRoute

# What can make a lone surrogate: a \uD800-\uDFFF escape, or (json.loads decodes
# bytes with "surrogatepass") a surrogate's own UTF-8 bytes, ED A0..BF. A body
# without either, nearly every one, is decoded as plain json.loads does.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_IN_TEXT = re.compile(r"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})|[\ud800-\udfff]")


class _NotJsonConstant(ValueError):
    """NaN, Infinity or -Infinity: Python's decoder reads them, JSON has none."""


def _refuse_constant(name: str):
    raise _NotJsonConstant(name)


def _refuse_infinite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # (1e400: read as inf, no JSON once written again)
        raise _NotJsonConstant(text)
    return value


def loads(body: bytes):
    """The body's JSON value; raises json.JSONDecodeError for invalid JSON, a
    string holding a lone surrogate included, and NaN, Infinity and -Infinity,
    which Python's decoder takes (RFC 8259 has no such number), and a number
    past a double's range, which it reads as Infinity: let through, a
    field kept free-form (a Responses request's `reasoning`, a tool's `parameters`)
    came back in the response, which could then not be written as JSON (a 500
    after the answer was generated and stored)."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_float=_refuse_infinite)
    except _NotJsonConstant as exc:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        name = exc.args[0]
        problem = ("is not a JSON number (JSON has no NaN nor Infinity)" if name in ("NaN", "Infinity", "-Infinity")
                   else "is past a double's range (it would be read as Infinity, which JSON has not)")
        raise json.JSONDecodeError(f"{name} {problem}", text, max(text.find(name), 0)) from None
    encoding = json.detect_encoding(body)  # (UTF-16 and UTF-32 too, as json.loads reads them: no such bytes there)
    if encoding.startswith("utf-8") and not _MAY_HOLD_SURROGATE.search(body):
        return value
    where = _lone_surrogate_path(value)
    if where is None:  # only valid pairs, or escaped backslashes before a "u"
        return value
    text = body.decode(encoding, "surrogatepass")
    field = ".".join(_printable(part) for part in where)
    raise json.JSONDecodeError(f"{field or 'the body'} holds a lone surrogate (U+D800 to U+DFFF outside "
                               "a pair), which is not Unicode", text, _lone_surrogate_at(text))


def _printable(part) -> str:
    """A key or index as the error names it: a key's own surrogate as its escape."""
    return str(part).encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate_path(value) -> tuple | None:
    """The keys and indices to the first string (a key too) holding a
    surrogate; a decoded valid pair is one character, so any left is lone."""
    pending = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    return path + (key,)
            pending.extend((path + (key,), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend((path + (index,), child) for index, child in reversed(list(enumerate(item))))
    return None


def _lone_surrogate_at(text: str) -> int:
    """The character position of the first lone surrogate in the JSON text:
    an escape not preceded by an escaped backslash and not half of a high-low
    pair, or a raw surrogate character."""
    paired_until = -1
    for match in _SURROGATE_IN_TEXT.finditer(text):
        if match.group(1) is None:
            return match.start()  # a raw surrogate (from its UTF-8 bytes)
        backslashes = len(match.group(1))
        if backslashes % 2 == 0 or match.start() < paired_until:
            continue  # "\\ud800" is a backslash and text; or this is the low half of a pair
        escape_at = match.start() + backslashes - 1
        if int(match.group(2), 16) < 0xDC00 and re.match(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}", text[match.end():]):
            paired_until = match.end() + 6
            continue
        return escape_at
    return 0


class StrictJsonRequest(Request):
    """A request whose JSON body is decoded by `loads`."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """A route that hands its endpoint a StrictJsonRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
