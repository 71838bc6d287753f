"""SGLang's `/generate` body: one prompt or a batch, `sampling_params` one or a
list (an unknown key refused, as SGLang refuses it), and the seeds' flat body
(the sampling fields beside the prompt). OpenAI's bodies, and what every body
shares: cluster/api_models.py."""

from __future__ import annotations

from typing import Annotated, ClassVar, Union

from pydantic import ConfigDict, Discriminator, Field, Strict, Tag, model_validator

from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import SamplingParams
from cluster.api_models import MAX_BATCH_REQUESTS, MAX_CHOICES, stop_tuple
from cluster.request_body import LogitBias, RequestBody, TokenId
from cluster.output_format import sglang_regex


class SglangSamplingParams(RequestBody):
    """SGLang's `sampling_params` object: its keys, each a field here, one Tandem
    does not implement (`UNSUPPORTED`), or refused as unknown."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "ebnf": (None,), "structural_tag": (None,),
        "stop_regex": (None, []), "custom_params": (None,), "stream_interval": (None, 1),
    }

    # 0: the prompt alone (its logprobs), as SGLang's frontend asks; null: as many as SGLang gives, up to the
    # context, here also up to the limits (it was the 128 of an omitted one)
    max_new_tokens: int | None = Field(128, ge=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own request (see cluster/app.py)
    temperature: float | None = None  # None: the model's default
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # SGLang's -1 means off
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None  # the sampling seed (SGLang: sampling_seed)
    sampling_seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    regex: str | None = None  # structured output (cluster/output_format.py)
    json_schema: str | None = None  # a JSON schema's text
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    logit_bias: LogitBias | None = None  # token id -> added to its logit
    no_stop_trim: bool = False  # keep the stop string at the end of the text
    # A slow tokenizer's option: fast tokenizers (SGLang's and Tandem's detokenizing) never add those spaces
    spaces_between_special_tokens: bool = True


ONE, MANY = "one", "many"  # the shapes of a field that takes one or a batch: not part of an error's location


def _one_or_many(one, many, is_many):
    """A field of type `one` or, for a batch, `many`, told apart by `is_many(value)`,
    so that an error names the shape the client sent, not both (a plain union
    reports one error per member)."""
    return Annotated[Union[Annotated[one, Tag(ONE)], Annotated[many, Tag(MANY)]],
                     Discriminator(lambda value: MANY if is_many(value) else ONE)]


def _is_list(value) -> bool:
    return isinstance(value, list)


def _is_list_of_lists(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], list)


Rid = Annotated[str, Field(max_length=128)]
Text = _one_or_many(str, list[str], _is_list)
InputIds = _one_or_many(list[TokenId], list[list[TokenId]], _is_list_of_lists)
Params = _one_or_many(SglangSamplingParams, list[SglangSamplingParams], _is_list)
Rids = _one_or_many(Rid, list[Rid], _is_list)


class GenerateBody(RequestBody):
    """The seeds' body: {"text": ..., "max_new_tokens": 32, "temperature": 0.7}, its
    sampling fields (`FLAT_SAMPLING_FIELDS`) beside the prompt, or SGLang's
    `sampling_params` object (both where they agree: a field given twice with two
    values is refused, since either could be the one meant); `input_ids` instead
    of `text`.

    A batch, as SGLang takes it: `text` a list of strings or `input_ids` a list of
    id lists, with one `sampling_params` for all or a list of them, one a prompt,
    and `rid` a list too if given. A batch, or `n` > 1, is answered with a list,
    prompt i's choice j at i * n + j (SGLang's order); streamed, each chunk says
    which by its `index`."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "lora_path": (None,), "image_data": (None,), "input_embeds": (None,), "custom_logit_processor": (None,),
        "return_hidden_states": (None, False), "session_params": (None,),
    }

    text: Text | None = None
    input_ids: InputIds | None = None
    sampling_params: Params | None = None
    max_new_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # (as in sampling_params: flat, -5 was served as off)
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    min_new_tokens: int | None = None
    logit_bias: LogitBias | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # >= 0: the prompt's logprobs too, from this position
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False  # each logprob entry's third element: its token's text (else None)
    rid: Rids | None = None

    @model_validator(mode="after")
    def _one_prompt_or_a_batch(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        size = len(self.prompts())
        if self.is_batch and not size:
            raise ValueError("the batch of prompts is empty")
        for name, value in (("sampling_params", self.sampling_params), ("rid", self.rid)):
            if isinstance(value, list) and (not self.is_batch or len(value) != size):
                raise ValueError(f"{name} is a list of {len(value)}: a list needs a batch of as many prompts"
                                 + (f" (this one has {size})" if self.is_batch else " (this is one prompt)"))
        if self.is_batch and isinstance(self.rid, str):
            raise ValueError("rid must be a list for a batch, one a prompt")
        for name in FLAT_SAMPLING_FIELDS:
            flat = getattr(self, name)
            other = next((getattr(p, name) for p in self._sampling_params() if name in p.model_fields_set
                          and _meaning(name, getattr(p, name)) != _meaning(name, flat)), None)
            if flat is not None and other is not None:
                raise ValueError(f"{name} is given twice, {flat!r} beside the prompt and {other!r} in "
                                 "sampling_params: give it once")
        for params in self._sampling_params():  # (one was served, the other dropped without a word)
            if len({seed for seed in (self.seed, params.seed, params.sampling_seed) if seed is not None}) > 1:
                raise ValueError("seed and sampling_seed name one seed: two values were given, give it once")
        if self.n is None and len({p.n for p in self._sampling_params()}) > 1:
            raise ValueError("every prompt of a batch must ask for the same n")
        if size * self.num_choices > MAX_BATCH_REQUESTS:
            raise ValueError(f"{size} prompts x n={self.num_choices} is more than {MAX_BATCH_REQUESTS} requests")
        return self

    @property
    def is_batch(self) -> bool:
        """A list of texts, or of id lists (a list of ids is one prompt)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def num_choices(self) -> int:
        """`n`: flat, or every prompt's `sampling_params` (the same)."""
        return self.n if self.n is not None else self._sampling_params()[0].n

    @property
    def answers_a_list(self) -> bool:
        return self.is_batch or self.num_choices > 1

    def prompts(self) -> list[str | list[int]]:
        prompt = self.text if self.text is not None else self.input_ids
        return list(prompt) if self.is_batch else [prompt]

    def rids(self) -> list[str | None]:
        """The client's name of each prompt (None: unnamed)."""
        return list(self.rid) if isinstance(self.rid, list) else [self.rid] * len(self.prompts())

    def _sampling_params(self) -> list[SglangSamplingParams]:
        if isinstance(self.sampling_params, list):
            return self.sampling_params
        return [self.sampling_params or SglangSamplingParams()] * len(self.prompts())

    @property
    def asks_structure(self) -> bool:
        """Whether an output is to follow a pattern (whose automaton `sampling` compiles)."""
        return self.regex is not None or self.json_schema is not None or any(
            p.regex is not None or p.json_schema is not None for p in self._sampling_params())

    def sampling(self, unbounded_max: int, defaults: SamplingDefaults) -> list[SamplingParams]:
        """Each prompt's params: its `sampling_params`, the body's own fields over
        them; one made for prompts that share them (a batch of 64 made each anew,
        a 150k-entry logit_bias checked 64 times: 7.8 s). `unbounded_max`: the
        output length of a `max_new_tokens: null`, held to the room its prompt
        leaves as an omitted one is (cluster/prompt_limits.py)."""
        bases, made = self._sampling_params(), {}
        for base in bases:
            if id(base) not in made:
                made[id(base)] = self._params(base, unbounded_max, defaults)
        return [made[id(base)] for base in bases]

    def prompts_only(self) -> list[bool]:
        """Each prompt's `max_new_tokens: 0`: its prompt alone (its logprobs, a
        cache warmed), served as one token generated and dropped, as a
        completion's `max_tokens: 0` is (a 400 before: SGLang's `select` sends it)."""
        return [self._merged(base).max_new_tokens == 0 for base in self._sampling_params()]

    def _merged(self, base: SglangSamplingParams) -> SglangSamplingParams:
        top_level = {name: getattr(self, name) for name in FLAT_SAMPLING_FIELDS}
        return base.model_copy(update={k: v for k, v in top_level.items() if v is not None})

    def _params(self, base: SglangSamplingParams, unbounded_max: int, defaults: SamplingDefaults) -> SamplingParams:
        merged = self._merged(base)
        unbounded = merged.max_new_tokens is None
        model = defaults.fill(temperature=merged.temperature, top_p=merged.top_p, top_k=merged.top_k,
                              min_p=merged.min_p, repetition_penalty=merged.repetition_penalty)
        return SamplingParams(
            max_new_tokens=unbounded_max if unbounded else merged.max_new_tokens or 1,  # (0: one, dropped)
            max_new_tokens_is_default=unbounded or "max_new_tokens" not in merged.model_fields_set,
            temperature=model["temperature"],
            top_p=model["top_p"],
            top_k=max(model["top_k"], 0),
            min_p=model["min_p"],
            stop=stop_tuple(merged.stop),
            stop_token_ids=tuple(merged.stop_token_ids or ()),
            ignore_eos=merged.ignore_eos,
            skip_special_tokens=merged.skip_special_tokens,
            seed=merged.seed if merged.seed is not None else merged.sampling_seed,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num if self.return_logprob and self.logprob_start_len >= 0 else None,
            repetition_penalty=model["repetition_penalty"],
            frequency_penalty=merged.frequency_penalty,
            presence_penalty=merged.presence_penalty,
            min_new_tokens=merged.min_new_tokens,
            logit_bias=tuple((merged.logit_bias or {}).items()),
            include_stop_str_in_output=merged.no_stop_trim,
            regex=sglang_regex(merged),
        )


def _meaning(name: str, value):
    """A sampling field's value as it is served (`stop`: a string, or a list of them)."""
    return stop_tuple(value) if name == "stop" else value


# The seeds' flat body: GenerateBody's fields that are sampling_params' keys too, beside `text`, over them.
FLAT_SAMPLING_FIELDS = tuple(name for name in GenerateBody.model_fields if name in SglangSamplingParams.model_fields)


class AbortBody(RequestBody):
    """SGLang's `/abort_request` body: the requests a client named `rid` (a
    `/generate` prompt's rid, all its choices; or an OpenAI completion's id), or
    every request (`abort_all`)."""

    model_config = ConfigDict(extra="forbid")
    rid: Annotated[Rid, Strict()] = ""
    abort_all: Annotated[bool, Strict()] = False

    @model_validator(mode="after")
    def _names_what_to_abort(self):
        if self.abort_all and self.rid:
            raise ValueError("`rid` and `abort_all` exclude each other: name one request, or abort every one")
        if not self.abort_all and not self.rid:
            raise ValueError("name the request to abort (`rid`), or set `abort_all` to abort every request")
        return self


class ProfileBody(RequestBody):
    """`/start_profile`'s body (SGLang's fields; optional, as vLLM's endpoint
    takes none): how many engine steps to trace (None: until `/stop_profile`),
    and the torch profiler's shapes and Python stacks. Where the traces go is the
    manifest's `profile_dir`, never a client's."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "output_dir": (None,), "activities": (None,), "start_step": (None,), "profile_by_stage": (None, False),
        "profile_id": (None,), "merge_profiles": (None, False)}
    UNSUPPORTED_WHY: ClassVar[dict[str, str]] = {
        "output_dir": "the traces go to the manifest's profile_dir, on each worker's node",
        "activities": "the trace holds the CPU's operators, and a GPU's kernels where there is one"}

    num_steps: Annotated[int, Strict(), Field(ge=1, le=100_000)] | None = None
    record_shapes: Annotated[bool, Strict()] = False
    with_stack: Annotated[bool, Strict()] = False
