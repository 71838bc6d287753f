"""HTTP request bodies: OpenAI completions and chat, and vLLM's tokenize (SGLang's
/generate: cluster/sglang_body.py; what every body shares: cluster/request_body.py).

Each body turns into (prompt, SamplingParams) through `sampling()`; range
checks live in `SamplingParams` (one place), shape checks here (and the output
length's least, which errors name as the client sent it). Anything the server
does not support (best_of, and the fields other servers take that change what is
generated: constrained output, tools, ...) is refused with a clear 400 rather than
silently ignored. Other unknown fields of a body are ignored (clients send their
own extras); an unknown key in SGLang's `sampling_params` object is refused, as
SGLang refuses it (a misspelt `max_tokens` there would otherwise be served as the
default length).

The sampling fields a model may have defaults for (temperature, top_p, top_k,
min_p, repetition_penalty: actors/sampling_defaults.py) are None when omitted, so
the model's default fills exactly those the request left out.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import InvalidRequestError, SamplingParams
from cluster.output_format import openai_asks, openai_regex, response_format_regex
from cluster.reasoning import OPEN as REASONING_OPEN
from cluster.reasoning import Reasoning, held_regex
from cluster.request_body import LogitBias, RequestBody, TokenId
from cluster.tool_calls import HERMES, PastCall, Tool, ToolCallFormat, chooses_freely, template_call, tool_regex


class ApiError(Exception):
    """An error the client can fix: HTTP status, OpenAI-style type, message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers=None, **extra) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict:
        """OpenAI's error body: `param` always there, null where no field is to blame (as OpenAI and vLLM send it)."""
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.status, **self.extra}}


def stop_tuple(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


MAX_CHOICES = 16  # OpenAI's `n` (and SGLang's), at most
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's
MAX_BATCH_REQUESTS = 64  # prompts x n in one completions or /generate call


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One request's params per choice: a seeded request's choices draw from seed,
    seed + 1, ... (reproducible and different); unseeded ones each from their own."""
    if n == 1:
        return [params]
    return [params.with_seed(None if params.seed is None else (params.seed + i) % 2**63) for i in range(n)]


class StreamOptions(BaseModel):
    """A stream's options: `include_usage`, a last chunk with the usage (OpenAI's).
    A key it does not know is refused (a misspelt one was served as if left
    out), and so is vLLM's `continuous_usage_stats: true` (usage in every
    chunk), which Tandem does not send. OpenAI's `include_obfuscation` pads
    chunks against length side channels; Tandem adds no padding, which is what
    `false` asks for and what `true` may be served as (it changes no content)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Strict()] | None = None
    include_obfuscation: Annotated[bool, Strict()] | None = None
    continuous_usage_stats: Annotated[bool, Strict()] | None = None

    @field_validator("continuous_usage_stats")
    @classmethod
    def _not_continuous(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("continuous_usage_stats is not supported: the usage comes in the last chunk "
                             "(include_usage)")
        return value


class _OpenAIBody(RequestBody):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "functions": (None, []), "function_call": (None, "none"),  # (the legacy spelling of tools)
        # vLLM's extensions that change the output
        "guided_grammar": (None,), "use_beam_search": (None, False), "logits_processors": (None, []),
        "guided_whitespace_pattern": (None,),  # (the JSON's whitespace is json.dumps' here: actors/json_text.py)
    }

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # (0: completions' echo alone; else at least 1)
    temperature: float | None = None  # None: the model's default
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own request (see cluster/app.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM-style)
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM-style): -1 (vLLM's) or 0 is off
    min_p: float | None = None  # extension (vLLM-style)
    ignore_eos: bool = False  # extension
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None  # extension (vLLM-style)
    min_tokens: int = 0  # extension (vLLM-style)
    include_stop_str_in_output: bool = False  # extension (vLLM-style)
    skip_special_tokens: bool = True  # extension (vLLM-style)
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)  # extension (vLLM-style): only these
    bad_words: list[str] | None = None  # extension (vLLM-style): words the output must not contain
    # Structured output (cluster/output_format.py): OpenAI's, then vLLM's extensions
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    structured_outputs: dict | None = None
    # extension (vLLM's): keep the prompt's last k tokens (left truncation); -1: as many as the limits allow
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # extension (vLLM's): each prompt token's logprob and rank, and its n best (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true")
        return self

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self):
        if self.stream_options is not None and not self.stream:  # (as OpenAI and vLLM refuse it)
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 (the prompt's last tokens kept) or -1 (as many as "
                             "the limits allow)")
        return value

    @property
    def asks_structure(self) -> bool:
        """Whether the output is to follow a pattern (whose automaton `sampling` compiles)."""
        return bool(openai_asks(self))

    def output_regex(self) -> str | None:
        """The pattern the body asks its output to match (cluster/output_format.py)."""
        return openai_regex(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int | None, default_max: int, logprobs: int | None,
                  defaults: SamplingDefaults, regex: str | None, max_tokens_name: str = "max_tokens") -> SamplingParams:
        """`max_tokens_name`: the field the client gave `max_tokens` in, for errors."""
        max_new_tokens = max_tokens if max_tokens is not None else max(default_max, self.min_tokens)
        if 0 < max_new_tokens < self.min_tokens:  # said in this body's names (a bad max_tokens: SamplingParams)
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= {max_tokens_name} "
                                      f"({max_new_tokens})")
        model = defaults.fill(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty)
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            max_new_tokens_is_default=max_tokens is None,
            **{**model, "top_k": max(model["top_k"], 0)},  # (-1: off, as 0)
            stop=stop_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            min_new_tokens=self.min_tokens,
            logit_bias=tuple((self.logit_bias or {}).items()),
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            bad_words=tuple(self.bad_words or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_logprobs,
            regex=regex,
        )


class CompletionBody(_OpenAIBody):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_OpenAIBody.UNSUPPORTED, "suffix": (None, ""), "tools": (None, []),
                                               "tool_choice": (None, "none"),
                                               "return_tokens_as_token_ids": (None, False)}  # (chat refuses it too)

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]  # one prompt, or a batch of them
    add_special_tokens: bool = True  # extension (vLLM's): a text prompt gets the tokenizer's BOS
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported_echo(self):
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (the prompt's text and logprobs alone)")
        if self.max_tokens == 0 and self.min_tokens:  # (its one token, generated and dropped, read as the bound)
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens (0)")
        if len(self.prompts()) * self.n > MAX_BATCH_REQUESTS:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} is more than {MAX_BATCH_REQUESTS} requests")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: a string or a list of token ids is one prompt."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt) or [[]]  # an empty list: one empty prompt (refused as such)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt's text and logprobs, no completion (how
        evaluation harnesses score a text: one token is generated and dropped)."""
        return self.echo and self.max_tokens == 0

    def sampling(self, default_max: int, defaults: SamplingDefaults) -> SamplingParams:
        params = self._sampling(1 if self.prompt_only else self.max_tokens, default_max, self.logprobs, defaults,
                                self.output_regex())
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs, as many best as asked
            params = dataclasses.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = ""
    tool_calls: list[PastCall] | None = None  # an assistant's earlier calls (cluster/tool_calls.py)
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None
    # An assistant's earlier reasoning, as this server answers it (vLLM's `reasoning` too): Qwen3's template
    # writes it back as a <think> block for the turns of a tool loop (it was dropped, the prompt not vLLM's)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        """Parts other than text (an image, audio, a file) are refused: the models
        read text only, and answering without the part would answer another
        question. An assistant's `refusal` part (OpenAI's, a refused turn sent
        back) is text: `_refusals_are_the_assistants`."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind not in ("text", "refusal"):
                raise ValueError(f"content part type {kind!r} is not supported: the model reads text only")
            if not isinstance(part.get(kind), str):
                raise ValueError(f"a {kind} content part needs its {kind} as a string")
        return content

    @model_validator(mode="after")
    def _refusals_are_the_assistants(self):
        if self.role != "assistant" and isinstance(self.content, list) and any(
                part["type"] == "refusal" for part in self.content):
            raise ValueError(f"a refusal content part is an assistant's, not a {self.role} message's")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # as vLLM joins a text-only model's parts (a refusal's as text)
            return "\n".join(part[part["type"]] for part in self.content)
        return self.content or ""


def template_messages(messages: list[ChatMessage], developer_as_system: bool = False) -> list[dict]:
    """Messages as a chat template takes them (an assistant's earlier calls with
    their arguments parsed, cluster/tool_calls.py; its reasoning as
    `reasoning_content`, the name templates read); `developer_as_system`: a
    `developer` message as a `system` one, for a template that has no such role
    (`knows_developer_role`)."""
    role = {"developer": "system"} if developer_as_system else {}
    return [{"role": role.get(m.role, m.role), "content": m.text(),
             **({} if m.tool_calls is None else {"tool_calls": [template_call(c) for c in m.tool_calls]}),
             **{k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name),
                                  ("reasoning_content", m.reasoning_content if m.reasoning_content is not None
                                   else m.reasoning)) if v is not None}}
            for m in messages]


def knows_developer_role(chat_template) -> bool:
    """Whether a chat template names the `developer` role. Qwen2.5's and Qwen3's
    do not: they dropped such a message, the request answered 200 with its
    instructions unread (and Qwen2.5's put its default system prompt in their
    place; a review's probe). OpenAI's newer clients send instructions so; vLLM's
    Responses path maps the role to `system`, as `template_messages` does then."""
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("developer" in text for text in texts)


# What apply_chat_template takes itself, or the request's fields give the template.
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class _ChatTemplateFields(RequestBody):
    """How messages become a prompt (vLLM's fields, its defaults): the chat
    template, then an assistant turn opened (`add_generation_prompt`), or the last
    message, an assistant's, left open for the model to continue
    (`continue_final_message`: a prefilled answer); the template's text gets no
    BOS of the tokenizer's unless `add_special_tokens`."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict | None = None  # more of the template's variables (Qwen3's enable_thinking)
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # the template's `reasoning_effort` (as vLLM's)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict | None) -> dict | None:
        taken = sorted(set(kwargs or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the request's own fields give "
                             f"{'it' if len(taken) == 1 else 'them'}")
        return kwargs

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template writes into the prompt: none here."""
        return None

    @model_validator(mode="after")
    def _effort_to_the_template(self):
        """`reasoning_effort` is the template's variable of that name (gpt-oss's
        templates read it; others leave it unread): chat took it and dropped it,
        and /tokenize counts a prompt as chat renders it."""
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt: false (the last message is "
                             "continued instead of a new turn opened)")
        return self


class ChatBody(_ChatTemplateFields, _OpenAIBody):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_OpenAIBody.UNSUPPORTED, "echo": (None, False),  # vLLM's chat echo
        # vLLM's template inputs, and OpenAI's audio output (each was taken and ignored)
        "chat_template": (None,), "documents": (None, []), "mm_processor_kwargs": (None, {}),
        "return_tokens_as_token_ids": (None, False), "modalities": (None, ["text"]), "audio": (None,),
    }
    UNSUPPORTED_WHY: ClassVar[dict[str, str]] = {
        "chat_template": "the checkpoint's chat template renders every request (vLLM, too, takes one only when "
                         "started with --trust-request-chat-template)",
        "documents": "the chat template is given messages and tools only; put the documents in a message",
        "modalities": "the answer is text only",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None  # (an empty list: none)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True

    @property
    def asks_structure(self) -> bool:
        return super().asks_structure or (bool(self.tools) and self.tool_choice != "none")

    @model_validator(mode="after")
    def _an_answer(self):
        if self.max_tokens == 0 and self.max_completion_tokens is None:  # (named as sent, not max_new_tokens)
            raise ValueError("max_tokens must be >= 1")
        return self

    @field_validator("tools")
    @classmethod
    def _names_once(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"each tool needs its own name: {', '.join(twice)} named twice")
        return tools

    def output_regex(self, tool_format: ToolCallFormat = HERMES, text_never_begins: tuple[str, ...] = ()) -> str | None:
        """`tool_format`: how the served model writes calls (strict tools hold them);
        `text_never_begins`: what a free text answer may not begin with (`tool_regex`).
        A response_format is the form of a text answer: where the model chooses
        between calls and text, the answer is calls or text of that format; where a
        call is asked for (tool_choice "required" or a function) the answer has no
        text and the format waits for a later turn (the OpenAI Agents SDK sends both
        on an agent's first turn). The guided fields, vLLM's, hold the whole answer,
        calls and all: beside a tool choice they are refused."""
        content = response_format_regex(self.response_format)
        only_format = len(openai_asks(self)) == 1  # (a guided field too: one_pattern refuses the pair below)
        if content is not None and only_format and self.tools:
            if chooses_freely(self.tools, self.tool_choice):
                return tool_regex(self.tools, "auto", self.parallel_tool_calls, tool_format, content, text_never_begins)
            if self.tool_choice != "none":  # (a call asked for: its pattern alone)
                return tool_regex(self.tools, self.tool_choice, self.parallel_tool_calls, tool_format)
        asked = "tool_choice" if self.tool_choice is not None else "strict tools"  # (auto holds strict tools)
        return openai_regex(self, **{asked: tool_regex(self.tools, self.tool_choice, self.parallel_tool_calls,
                                                       tool_format, text_never_begins=text_never_begins)})

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM refuse it (it was answered without them)
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling(self, default_max: int, defaults: SamplingDefaults, reasoning: Reasoning | None = None,
                 tool_format: ToolCallFormat = HERMES) -> SamplingParams:
        """`reasoning`: how the answer starts where the server parses reasoning; a
        pattern then holds the answer after it (cluster/reasoning.py);
        `tool_format`: how the served model writes tool calls (cluster/tool_calls.py)."""
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        regex = self.output_regex(tool_format, (REASONING_OPEN,) if reasoning is not None else ())
        if reasoning is not None and regex is not None:
            structured = self.structured_outputs if isinstance(self.structured_outputs, dict) else {}
            written = self.guided_regex is not None or structured.get("regex") is not None  # (the client's own)
            regex = held_regex(regex, reasoning.opened, written)
        params = self._sampling(max_tokens, default_max, logprobs, defaults, regex, name)
        if tool_format.reads_special_tokens and self.tools and self.tool_choice != "none":
            params = dataclasses.replace(params, skip_special_tokens=False)  # (the calls' tag: `ToolCallFormat`)
        return params


class TokenizeBody(_ChatTemplateFields):
    """vLLM's /tokenize: a completion prompt or chat messages, with the fields of
    the body it stands for (`add_special_tokens`: a prompt's default true, chat's
    false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None  # written into a chat's prompt by its template, as the chat request's are
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # "none": no tools in it, as the chat's
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # each token's string too, as the tokenizer's vocabulary spells it

    def template_tools(self) -> list[dict] | None:
        """As `ChatBody.template_tools`: a count of the chat's prompt counted tools
        that the chat, with tool_choice "none", leaves out (356 tokens against 14)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.tools and self.messages is None:
            raise ValueError("tools go with `messages` (the chat template writes them), not with a `prompt`")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self


class DetokenizeBody(RequestBody):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
