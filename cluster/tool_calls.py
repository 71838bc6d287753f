"""OpenAI's tool calls, by structured output: `tool_choice` naming a function, or
`"required"`, holds the answer to the tools' parameter schemas (as vLLM does for
these two, with any model), and the answer comes back as `message.tool_calls`.

- a named function: the output is its arguments, a JSON object of its
  `parameters` schema (an object with no properties when it has none);
- `"required"`: a JSON array of one or more `{"name": ..., "parameters": ...}`,
  each item one of the tools with its own schema (vLLM's shape); each item a call;
  one only under `parallel_tool_calls: false`;
- `"none"`: the tools are left out of the prompt and the answer is text;
- `"auto"` (OpenAI's default when tools are given) needs the model's own tool-call
  format parsed out of free text (Hermes' `<tool_call>` tags for Qwen2.5, others
  for Llama or Mistral), which Tandem does not do: refused, saying what to ask
  instead (vLLM refuses it too unless started with a parser).
The tools go to the chat template (`tools`), which renders them where it knows how
(Qwen2.5's does; the built-in presets' template ignores them). Earlier turns'
calls (`assistant` messages' `tool_calls`, with their arguments as the JSON text
OpenAI sends) reach the template with the arguments parsed, as templates expect.
The finish reason stays the output's (`stop`, or `length` when cut), as vLLM
answers a call it forced; a cut "required" answer that is no longer JSON comes
back as text.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.json_schema import schema_regex
from actors.sampling_params import InvalidRequestError

NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


def named_choice(tools: list[Tool] | None, tool_choice) -> FunctionSpec | None:
    """The function `tool_choice` names (None for "none" and "required"); 400s for
    a choice that cannot be served."""
    if tool_choice is None or tool_choice in ("none", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools")
        return None
    if tool_choice == "auto":
        if not tools:
            return None  # nothing to call: a text answer
        raise InvalidRequestError(
            "tool_choice 'auto' is not supported: Tandem does not parse a model's own tool-call format; name a "
            'function (tool_choice {"type": "function", "function": {"name": ...}}) or ask for \'required\'')
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be \'none\', \'required\' or {"type": "function", "function": {"name": ...}}')
    chosen = next((tool.function for tool in tools or () if tool.function.name == name), None)
    if chosen is None:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
    return chosen


def tool_regex(tools: list[Tool] | None, tool_choice, parallel: bool = True) -> str | None:
    """The pattern the answer is held to, or None (no tools, or tool_choice "none");
    `parallel` (OpenAI's parallel_tool_calls): a "required" answer may hold several
    calls, else one."""
    if tools and tool_choice is None:
        tool_choice = "auto"  # OpenAI's default with tools
    named = named_choice(tools, tool_choice)
    if named is not None:
        return schema_regex(named.parameters or NO_PARAMETERS)
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "required": ["name", "parameters"], "properties": {
        "name": {"const": tool.function.name}, "parameters": tool.function.parameters or NO_PARAMETERS}}
        for tool in tools]
    return schema_regex({"type": "array", "minItems": 1, "maxItems": None if parallel else 1,
                         "items": {"anyOf": calls}})


def tool_calls(text: str, tools: list[Tool] | None, tool_choice) -> list[dict] | None:
    """The answer as OpenAI's `tool_calls`, or None when it is text (no call asked
    for, or a "required" answer cut before its JSON closed)."""
    if not tools:
        return None
    named = named_choice(tools, tool_choice)
    if named is not None:
        return [call(named.name, text)]
    if tool_choice != "required":
        return None
    try:
        items = json.loads(text)
    except ValueError:
        return None
    return [call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def template_message(message: dict) -> dict:
    """A message for the chat template: an assistant's earlier calls with their
    arguments parsed (OpenAI sends them as JSON text; templates write them out)."""
    if not message.get("tool_calls"):
        return message
    parsed = []
    for each in message["tool_calls"]:
        function = dict(each.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # left as the client wrote it
        parsed.append({**each, "function": function})
    return {**message, "tool_calls": parsed}


class StreamedCalls:
    """A streamed chat choice's deltas when its answer is tool calls: a named
    function's arguments stream as they come (the first delta names the call, as
    OpenAI's do); a "required" answer is whole only at its end (a JSON array of
    calls), so its calls come in the last delta, or its text if it was cut."""

    def __init__(self, tools: list[Tool] | None, tool_choice) -> None:
        self.tools, self.tool_choice = tools, tool_choice
        self.named = named_choice(tools, tool_choice)
        self.pieces: list[str] = []
        self.started = False

    @classmethod
    def of(cls, tools: list[Tool] | None, tool_choice) -> StreamedCalls | None:
        """None when the answer is text."""
        if not tools or tool_choice in (None, "none", "auto"):
            return None
        return cls(tools, tool_choice)

    def delta(self, text: str, finished: bool) -> dict | None:
        """The delta's fields for this event (None: nothing to send yet)."""
        if self.named is not None:
            if not self.started:
                self.started = True
                return {"tool_calls": [{"index": 0, **call(self.named.name, text)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        self.pieces.append(text)
        if not finished:
            return None
        whole = "".join(self.pieces)
        calls = tool_calls(whole, self.tools, self.tool_choice)
        if calls is None:
            return {"content": whole}
        return {"tool_calls": [{"index": i, **each} for i, each in enumerate(calls)]}
