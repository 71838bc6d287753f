"""OpenAI's tool calls. `tool_choice` naming a function, or `"required"`, holds the
answer to the tools' parameter schemas by structured output (as vLLM does for
these two, with any model); `"auto"` (OpenAI's default when tools are given) lets
the model choose, and its answer is parsed for calls in its own format
(`TOOL_CALL_FORMATS`: Hermes' by default, cluster/hermes_calls.py; Llama 3's JSON,
cluster/llama_calls.py; Mistral's, cluster/mistral_calls.py). Either way the calls come back as `message.tool_calls`.

- a named function: the output is its arguments, a JSON object of its
  `parameters` schema (an object with no properties when it has none);
- `"required"`: a JSON array of one or more `{"name": ..., "parameters": ...}`,
  each item one of the tools with its own schema (vLLM's shape); each item a call;
  one only under `parallel_tool_calls: false`;
- `"auto"`: free text, in which each `<tool_call>` block naming one of the tools
  is a call (Hermes' format: Qwen2.5's and Qwen3's, and the built-in presets'
  template tells the model so; `tool_call_parser: llama3_json` in the manifest for
  Llama 3.1 and 3.2 Instruct's format instead, `mistral` for Mistral's); the rest
  is the message's `content`. Models of other formats (DeepSeek's, gpt-oss's
  harmony) are not parsed: their calls stay text. When a tool is
  `strict` (OpenAI's promise that arguments match the schema; the OpenAI Agents
  SDK and `openai.pydantic_function_tool` set it), the answer is held so that any
  call the model starts is a well-formed one of the tools, arguments of its
  schema (every tool's then); with a `response_format` (or another way of
  holding the text: the OpenAI Agents SDK sends one beside the tools when an
  agent has an output type), the answer is calls alone or text of that format;
- `"none"`: the tools are left out of the prompt and the answer is text.
The tools go to the chat template (`tools`), which renders them where it knows how
(Qwen2.5's and the built-in presets' do). Earlier turns' calls (`assistant`
messages' `tool_calls`, with their arguments as the JSON text OpenAI sends) reach
the template with the arguments parsed, as templates expect. The finish reason
stays the output's (`stop`, or `length` when cut), as vLLM answers a call it
forced by name, except that an "auto" or "required" answer that called a tool
ends with `tool_calls`, as OpenAI's does; a cut "required" answer that is no
longer JSON comes back as text.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from typing import Literal, NamedTuple
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, field_validator

from actors.json_schema import check_json_schema, definition_key, schema_regex
from actors.json_text import NESTED_FREE_DEPTH, free_json_regex
from actors.sampling_params import InvalidRequestError
from cluster import hermes_calls, llama_calls, mistral_calls
from cluster.answer_parts import ParsedCalls, known_call

NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolCallFormat(NamedTuple):
    """How a model writes the calls it chooses to make (tool_choice "auto"): a
    whole answer's parse, its stream (`feed`, `finish`) and the pattern that holds
    it for strict tools, each given the tools' names and whether calls may be
    several; the parse and stream of an answer so held, where a format reads
    it otherwise (Mistral's: only the layout the pattern admits); and the ids its
    calls get, which the next turn sends back through the chat template."""

    parse: Callable[[str, set[str], bool], ParsedCalls]
    stream: Callable[[set[str], bool], object]
    held_regex: Callable[[dict[str, str], bool, str | None, tuple[str, ...]], str]
    held_parse: Callable[[str, set[str], bool], ParsedCalls] | None = None
    held_stream: Callable[[set[str], bool], object] | None = None
    call_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's form
    # Whether a request with tools decodes special tokens: the calls' tag is one, which tells them from the
    # text before them (vLLM's Mistral parser turns skip_special_tokens off so)
    reads_special_tokens: bool = False

    def parse_of(self, held: bool) -> Callable[[str, set[str], bool], ParsedCalls]:
        return self.held_parse if held and self.held_parse else self.parse

    def stream_of(self, held: bool) -> Callable[[set[str], bool], object]:
        return self.held_stream if held and self.held_stream else self.stream


# The manifest's `tool_call_parser`: the served model's format (its chat template's).
TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat(hermes_calls.parse, hermes_calls.HermesStream, hermes_calls.held_regex),
    "llama3_json": ToolCallFormat(llama_calls.parse, llama_calls.LlamaStream, llama_calls.held_regex),
    # Mistral's templates refuse a call id that is not 9 letters and digits (vLLM makes such ids too)
    "mistral": ToolCallFormat(mistral_calls.parse, mistral_calls.MistralStream, mistral_calls.held_regex,
                              mistral_calls.parse_held, mistral_calls.HeldMistralStream,
                              lambda: "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9)),
                              reads_special_tokens=True),
}
HERMES = TOOL_CALL_FORMATS["hermes"]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict | None) -> dict | None:
        """Arguments are a JSON object (OpenAI's tools, and every template's calls)."""
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f"a function's parameters are a JSON schema of an object, not of type "
                             f"{parameters['type']!r}")
        return parameters


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict | None = "{}"  # OpenAI sends the JSON text (null, or "": no arguments, as vLLM reads them)


class PastCall(BaseModel):
    """An assistant's earlier call, as OpenAI's `tool_calls` items come back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


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
        return None  # the model's choice, parsed after (cluster/hermes_calls.py)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None  # (not an object: a 400, was a 500)
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}')
    chosen = next((tool.function for tool in tools or () if tool.function.name == name), None)
    if chosen is None:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
    return chosen


def tool_regex(tools: list[Tool] | None, tool_choice, parallel: bool = True, fmt: ToolCallFormat = HERMES,
               content: str | None = None, text_never_begins: tuple[str, ...] = ()) -> str | None:
    """The pattern the answer is held to, or None (no tools, tool_choice "none", or
    "auto" without strict tools or `content`: the answer is free); `parallel`
    (OpenAI's parallel_tool_calls): the answer may hold several calls, else one.
    `content`, for "auto": the pattern its text is held to (response_format's):
    the answer is then calls or that text, the calls' arguments held to their
    schemas if a tool is strict, else any JSON object of two levels (a call of
    deeper arguments cannot be made then; `chooses_freely`). `text_never_begins`:
    where a reasoning block before the answer is held apart (cluster/reasoning.py),
    its tag, which the answer's free text must not begin with: a call after the
    reasoning would be such text, its arguments unchecked."""
    tool_choice = _effective(tools, tool_choice)
    named = named_choice(tools, tool_choice)
    if named is not None:
        return schema_regex(named.parameters or NO_PARAMETERS, _parameters_of(named.name))
    if tool_choice == "auto" and (_is_held(tools) or content is not None):
        held = _is_held(tools)
        return fmt.held_regex({tool.function.name: schema_regex(tool.function.parameters or NO_PARAMETERS,
                                                                _parameters_of(tool.function.name)) if held
                               else free_json_regex(NESTED_FREE_DEPTH) for tool in tools}, parallel, content,
                              text_never_begins)
    if tool_choice != "required":
        return None
    for tool in tools:  # (each alone first: a complaint about the array of calls would name none of them)
        check_json_schema(tool.function.parameters or NO_PARAMETERS, _parameters_of(tool.function.name))
    definitions, calls = {}, []
    for index, tool in enumerate(tools):
        parameters, own = _hoisted(tool.function.parameters or NO_PARAMETERS, f"tool{index}-")
        definitions.update(own)
        calls.append({"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"const": tool.function.name}, "parameters": parameters}})
    at_most_one = {} if parallel else {"maxItems": 1}
    return schema_regex({"type": "array", "minItems": 1, "items": {"anyOf": calls}, **at_most_one,
                         **({"$defs": definitions} if definitions else {})})


def _hoisted(parameters: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's parameters as one part of a larger schema (the array of calls
    `"required"` holds an answer to), and their definitions, renamed with
    `prefix` for that schema's `$defs`: a `$ref` points into its whole schema's
    root, where a tool's own `$defs` were not (a pydantic model's nested models
    are there), and the tool was refused."""
    own = {(section, name): schema for section in ("definitions", "$defs")
           for name, schema in (parameters.get(section) or {}).items()}
    if not own:
        return parameters, {}
    renamed = {key: f"{prefix}{key[0]}-{key[1]}" for key in own}

    def moved(value):
        if isinstance(value, list):
            return [moved(item) for item in value]
        if not isinstance(value, dict):
            return value
        key = definition_key(value.get("$ref"))
        out = {k: moved(v) for k, v in value.items()}
        if key in renamed:
            out["$ref"] = "#/$defs/" + quote(renamed[key].replace("~", "~0").replace("/", "~1"), safe="~")
        return out

    body = moved({k: v for k, v in parameters.items() if k not in ("definitions", "$defs")})
    return body, {renamed[key]: moved(schema) for key, schema in own.items()}


def _parameters_of(name: str) -> str:
    return f"tool {name!r}'s parameters"


class ChatAnswer(NamedTuple):
    content: str | None  # the message's text (null beside calls, as OpenAI's)
    calls: list[dict] | None  # OpenAI's `tool_calls`, or None when the answer is text
    finish_reason: str | None


def chat_answer(text: str | None, finish_reason: str | None, tools: list[Tool] | None, tool_choice,
                parallel: bool = True, fmt: ToolCallFormat = HERMES) -> ChatAnswer:
    """A chat choice's output as its message: text, or calls (a "required" answer
    cut before its JSON closed is text); None: no answer (a reasoning model's,
    cut while it reasoned: cluster/reasoning.py)."""
    if text is None:
        return ChatAnswer(None, None, finish_reason)
    tool_choice = _effective(tools, tool_choice)
    if tool_choice == "auto" and tools:  # (without tools: text as written, as the stream sends it)
        parsed = fmt.parse_of(_is_held(tools))(text, tool_names(tools), parallel)
        calls = [call(name, arguments, fmt) for name, arguments in parsed.calls] or None
        return ChatAnswer(parsed.content, calls, _calls_reason(finish_reason, calls))
    named = named_choice(tools, tool_choice) if tools else None
    if named is not None:
        return ChatAnswer(None, [call(named.name, text, fmt)], finish_reason)
    if not tools or tool_choice != "required":
        return ChatAnswer(text, None, finish_reason)
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return ChatAnswer(text, None, finish_reason)
    calls = [known_call(item, tool_names(tools)) for item in items] if isinstance(items, list) else [None]
    if not calls or None in calls:  # (held to the pattern, only a cut answer is not calls)
        return ChatAnswer(text, None, finish_reason)
    return ChatAnswer(None, [call(name, arguments, fmt) for name, arguments in calls],
                      _calls_reason(finish_reason, calls))


def chooses_freely(tools: list[Tool] | None, tool_choice) -> bool:
    """Whether the model chooses between calls and text (tool_choice "auto")."""
    return bool(tools) and _effective(tools, tool_choice) == "auto"


def _is_held(tools: list[Tool] | None) -> bool:
    """Whether an "auto" answer is held to the tools' schemas (`tool_regex`): a tool is strict."""
    return any(tool.function.strict for tool in tools or ())


def tool_names(tools: list[Tool] | None) -> set[str]:
    return {tool.function.name for tool in tools or ()}


def _effective(tools: list[Tool] | None, tool_choice):
    """The tool choice asked for: OpenAI's default is "auto" when tools are given."""
    return "auto" if tools and tool_choice is None else tool_choice


def _calls_reason(finish_reason: str | None, calls) -> str | None:
    """An answer of calls that ended by itself ends for "tool_calls" (OpenAI's and
    vLLM's reason, for tool_choice "auto" and "required"; a named function's
    answer, which can only be its call, ends for "stop", as OpenAI's does)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def call(name: str, arguments: str, fmt: ToolCallFormat) -> dict:
    return {"id": fmt.call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def template_call(call: PastCall) -> dict:
    """An earlier call for the chat template, its arguments parsed (OpenAI sends
    them as JSON text; templates write them out). None or an empty text is no
    arguments: `{}` (a template wrote `"arguments": }` into the prompt)."""
    arguments = call.function.arguments
    if arguments is None or isinstance(arguments, str) and not arguments.strip():
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (RecursionError: nested past Python's limit, e.g. "[" * 50000)
            pass  # left as the client wrote it
    return {**call.model_dump(exclude_none=True), "function": {"name": call.function.name, "arguments": arguments}}


class StreamedCalls:
    """A streamed chat choice's deltas when its answer may be tool calls: a named
    function's arguments stream as they come (the first delta names the call, as
    OpenAI's do); a "required" answer is whole only at its end (a JSON array of
    calls), so its calls come in the last delta, or its text if it was cut; an
    "auto" answer's text streams as it comes and each call whole once the model
    has written it (cluster/hermes_calls.py, cluster/llama_calls.py)."""

    def __init__(self, tools: list[Tool], tool_choice, parallel: bool = True, fmt: ToolCallFormat = HERMES) -> None:
        self.tools, self.tool_choice, self.parallel, self.fmt = tools, tool_choice, parallel, fmt
        self.named = named_choice(tools, tool_choice)
        self.pieces: list[str] = []
        self.started = False
        self.auto = fmt.stream_of(_is_held(tools))(tool_names(tools), parallel) if tool_choice == "auto" else None
        self.num_calls = 0

    @classmethod
    def of(cls, tools: list[Tool] | None, tool_choice, parallel: bool = True,
           fmt: ToolCallFormat = HERMES) -> StreamedCalls | None:
        """None when the answer is text."""
        tool_choice = _effective(tools, tool_choice)
        if not tools or tool_choice == "none":
            return None
        return cls(tools, tool_choice, parallel, fmt)

    def delta(self, text: str, finished: bool) -> dict | None:
        """The delta's fields for this event (None: nothing to send yet)."""
        if self.auto is not None:
            return self._auto_delta(self.auto.feed(text) + (self.auto.finish() if finished else []))
        if self.named is not None:
            if not self.started:
                self.started = True
                return {"tool_calls": [{"index": 0, **call(self.named.name, text, self.fmt)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        self.pieces.append(text)
        if not finished:
            return None
        answer = chat_answer("".join(self.pieces), None, self.tools, self.tool_choice, self.parallel, self.fmt)
        if answer.calls is None:
            return {"content": answer.content}
        self.num_calls = len(answer.calls)
        return {"tool_calls": [{"index": i, **each} for i, each in enumerate(answer.calls)]}

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason, given its output's."""
        return reason if self.named is not None else _calls_reason(reason, self.num_calls)

    def _auto_delta(self, pieces: list) -> dict:
        delta: dict = {}
        text = "".join(piece for piece in pieces if isinstance(piece, str))
        if text:
            delta["content"] = text
        calls = [piece for piece in pieces if isinstance(piece, tuple)]
        if calls:
            delta["tool_calls"] = [{"index": self.num_calls + i, **call(name, arguments, self.fmt)}
                                   for i, (name, arguments) in enumerate(calls)]
            self.num_calls += len(calls)
        return delta
