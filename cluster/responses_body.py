"""OpenAI's Responses API request (`POST /v1/responses`), as the chat request it
asks for: the conversation's items become chat messages, its flat function tools
chat's tools, `text.format` a `response_format`, `max_output_tokens` the chat's
limit; then the chat path serves it (template, tools, structured output,
reasoning) and cluster/responses_format.py writes the answer as a response.

Items of `input` (a string is one user message):
- messages (`{"role", "content"}`, `type` "message" or left out), content a string
  or parts of text (`input_text`, `output_text`);
- an earlier turn's `function_call` (`call_id`, `name`, `arguments`), joined to the
  assistant message before it, as a chat assistant turn carries its calls, and
  its `function_call_output` (a `tool` message answering `call_id`); an assistant
  message right after a turn's calls is that turn's text too (a streamed answer
  whose model wrote text after a call has it in an item after the call, and the
  turn is then the chat message its unstreamed answer was, not a second assistant
  message between the calls and their outputs);
- `reasoning`: left out of the prompt (chat templates drop past reasoning too).
An item may carry its id (a client sending back an output item): one another
item has, in `input` or in what it goes on from, is OpenAI's 400.
`instructions` is a system message put first. A function tool's `strict` is true
unless it says false (OpenAI's default here, unlike chat's): its calls are then
held to its schema.

`previous_response_id` continues a stored response: its conversation's items
(cluster/response_store.py) come before `input`'s; its instructions do not.
`conversation` (an id, or `{"id": ...}`) goes on from a conversation object's
items instead, and adds this response's input and output to them
(cluster/stored_conversations.py); not with `previous_response_id`.
`truncation: "auto"` drops the conversation's oldest turns where it is longer
than a prompt may be (cluster/conversation_truncation.py). `store` (true unless
it says false) keeps the finished response. `background: true` answers at once
with the response queued, and serves it on (cluster/background_responses.py);
with `stream`, its events, which a broken stream resumes. `include: ["message.output_text.logprobs"]` (or
`top_logprobs`) gives the text's logprobs; `include`'s other values (OpenAI's)
are taken and add nothing.

Refused with a 400, since serving without them would answer another request:
`prompt` templates, tools other than functions (hosted ones: web search, files, computer
use), images and files. Fields that change nothing generated (`metadata`,
`service_tier`, `max_tool_calls`, which bounds calls to hosted tools only, ...)
are taken.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.api_models import REASONING_EFFORTS, ApiError, ChatBody
from cluster.request_body import RequestBody
from cluster.ingress_guard import problem
from cluster.responses_format import new_id

TEXT_PARTS = {"input_text", "output_text", "text"}
ROLES = {"user", "assistant", "system", "developer"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's values of `include`: all taken (a misspelt one is a 400, as there);
# only the logprobs add to an answer, the rest are of tools and inputs this
# server has not (reasoning is not encrypted: a reasoning item sent back is
# left out of the prompt).
IncludeValue = Literal[LOGPROBS_INCLUDE, "reasoning.encrypted_content", "web_search_call.action.sources",
                       "web_search_call.results", "code_interpreter_call.outputs",
                       "computer_call_output.output.image_url", "file_search_call.results",
                       "message.input_image.image_url"]
MAX_METADATA = 16  # OpenAI's bounds on `metadata` (responses and conversations alike)
MAX_KEY_CHARS, MAX_VALUE_CHARS = 64, 512


def bounded_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata`, checked against OpenAI's bounds (a ValueError, a 400, past them)."""
    if metadata is None:
        return metadata
    if len(metadata) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
            raise ValueError(f"keys of at most {MAX_KEY_CHARS} characters, values of at most {MAX_VALUE_CHARS}: "
                             f"not {key[:MAX_KEY_CHARS + 1]!r}")
    return metadata


ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class FunctionTool(BaseModel):
    """A Responses function tool: chat's `function` object, flat, strict by default."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool = True

    def as_chat(self) -> dict:
        function = {"name": self.name, "strict": self.strict,
                    **{k: v for k, v in (("description", self.description), ("parameters", self.parameters))
                       if v is not None}}
        return {"type": "function", "function": function}


class ResponsesBody(RequestBody):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"prompt": (None,)}

    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    previous_response_id: str | None = Field(None, min_length=1)  # ("": served as if left out, and echoed)
    conversation: str | dict | None = None  # an id, or {"id": ...} (cluster/stored_conversations.py)
    truncation: Literal["auto", "disabled"] | None = None  # auto: cluster/conversation_truncation.py
    background: bool = False  # answered at once, queued; served on (cluster/background_responses.py)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None  # {"effort": ...}: the chat template's `reasoning_effort`, where it reads one
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[IncludeValue] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extensions of the chat body's (vLLM's Responses takes them too).
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM's) or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata):
        return bounded_metadata(metadata)

    @field_validator("reasoning")
    @classmethod
    def _known_effort(cls, reasoning: dict | None) -> dict | None:
        effort = (reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}")
        return reasoning

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, tools):
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported: only function tools (this server hosts "
                                 "no search, files or computer use)")
        return tools

    def function_tools(self) -> list[dict]:
        """The tools as served (`strict` filled in), as a response echoes them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    @property
    def conversation_id(self) -> str | None:
        return self.conversation["id"] if isinstance(self.conversation, dict) else self.conversation

    @field_validator("conversation")
    @classmethod
    def _conversation_id(cls, conversation):
        conversation_id = conversation.get("id") if isinstance(conversation, dict) else conversation
        if conversation is not None and not (isinstance(conversation_id, str) and conversation_id):
            raise ValueError('a conversation\'s id, or {"id": ...}')  # ("" was served as if left out)
        return conversation

    @model_validator(mode="after")
    def _consistent(self):
        if self.conversation is not None and self.previous_response_id is not None:
            raise ValueError("previous_response_id and conversation: give one (a response on a conversation goes on "
                             "from all of it)")
        if self.background and self.store is False:
            raise ValueError("background: a background response is stored (it is read back by its id): "
                             "leave store true")
        return self

    @property
    def stores(self) -> bool:
        return self.store is not False  # (OpenAI's default: stored)

    def input_items(self) -> list[dict]:
        """`input` as a stored response keeps it (`stored_items`)."""
        return stored_items([{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input)

    def chat_body(self, history: list[dict] = (), history_name: str = "previous_response_id") -> ChatBody:
        """The chat request this asks for, going on from `history` (the items of
        the stored conversation it continues, `history_name`'s); 400s where the
        items or tools are not ones this server can serve."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        check_unique_ids(items, history)
        instructions = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        messages = instructions + item_messages([*((f"{history_name}'s item {k}", item)
                                                   for k, item in enumerate(history)),
                                                 *((f"input.{k}", item) for k, item in enumerate(items))])
        fields = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "parallel_tool_calls": self.parallel_tool_calls, "max_completion_tokens": self.max_output_tokens,
            "logprobs": self.wants_logprobs, "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "response_format": _response_format(self.text), "user": self.user,
            **{name: getattr(self, name) for name in ("temperature", "top_p", "seed", "top_k", "min_p",
                                                     "repetition_penalty", "stop") if getattr(self, name) is not None},
        }
        if self.tools:
            fields["tools"] = [tool.as_chat() for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = _tool_choice(self.tool_choice)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            fields["reasoning_effort"] = effort
        try:
            return ChatBody.model_validate(fields)
        except ValidationError as exc:
            raise ApiError(400, f"as a chat request: {'; '.join(map(problem, exc.errors()))}") from None


def stored_items(items: list[dict]) -> list[dict]:
    """Input items as a stored response or conversation keeps them: each with a
    type, an id and a status (`completed` unless the client said), a message's
    content as parts (as `input_items` lists them). (OpenAI's SDK types need the
    status of a message, a function call and its output: a message sent as parts,
    and every call and output, had none.)"""
    kept = []
    for item in items:
        kind = item.get("type", "message")
        item = {**item, "type": kind, "id": item["id"] if isinstance(item.get("id"), str) else
                new_id(ITEM_ID_PREFIXES.get(kind, "item")), "status": item.get("status") or "completed"}
        if kind == "message" and isinstance(item["content"], str):
            item = {**item, **_message_item(item["role"], item["content"]), "id": item["id"]}
        kept.append(item)
    return kept


def check_unique_ids(items: list, earlier: list[dict] = (), param: str = "input") -> None:
    """A 400, OpenAI's, for an item whose id another has, in `items` (as a
    client sent them: an id is optional) or in the `earlier` items they go on
    from: GET and DELETE by id would find only the first, and OpenAI refuses
    it too (a client that sends back an output item it was given, with its id,
    as new input)."""
    seen = {item.get("id") for item in earlier}
    for item in items:
        item_id = item.get("id") if isinstance(item, dict) else None
        if isinstance(item_id, str):
            if item_id in seen:
                raise ApiError(400, f"Duplicate item found with id {item_id}. Remove duplicate items from your input "
                                    "and try again.", param=param)
            seen.add(item_id)


def item_messages(labelled: list[tuple[str, dict]]) -> list[dict]:
    """The chat messages of items, each with where it came from (for a 400's
    message: "input.3"); 400s for items this server cannot serve."""
    messages = []
    for where, item in labelled:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise ApiError(400, f"{where}.role: one of {', '.join(sorted(ROLES))}, not {item.get('role')!r}")
            text = _text(item.get("content"), where)
            last = messages[-1] if messages else None
            if item["role"] == "assistant" and last is not None and last.get("tool_calls"):
                last["content"] = (last["content"] or "") + text  # (the turn's text after its calls)
            else:
                messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments",
                                                                                            where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind != "reasoning":  # (an unknown kind of any JSON type: its repr names it)
            raise ApiError(400, f"{where}: item type {kind!r} is not supported (supported: message, "
                                "function_call, function_call_output, reasoning)")
    return messages


def _message_item(role: str, text: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []} if role == "assistant" else \
        {"type": "input_text", "text": text}
    return {"type": "message", "id": new_id("msg"), "role": role, "content": [part], "status": "completed"}


def _text(content, where: str) -> str:
    """A message's text: a string, or its text parts joined (as chat's are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content: part type {kind!r} is not supported: the model reads text only")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: a string is required")
    return value


def _tool_choice(choice):
    """Chat's spelling of a Responses tool choice."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _response_format(text: dict | None) -> dict | None:
    """Chat's `response_format` for a Responses `text.format`."""
    spec = (text or {}).get("format")
    if spec is not None and not isinstance(spec, dict):
        raise ApiError(400, 'text.format: an object, {"type": "text" | "json_object" | "json_schema", ...}')
    if spec is None or spec.get("type") in ("text", "json_object"):
        return spec
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: spec[k] for k in ("name", "schema", "strict") if k in spec}}
    return spec  # (chat's check names the type it does not know)
