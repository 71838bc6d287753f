"""Offline API: run the engine in this process over a list of prompts.

    from actors.llm import LLM
    from actors.sampling_params import SamplingParams
from actors.tokenization import encode_prompt

    llm = LLM("models/tiny", block_size=16, prefill_chunk_size=256)
    for out in llm.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0)):
        print(out.token_ids, out.text)

`generate` without params samples as the checkpoint's generation_config.json says
(`default_sampling_params`, actors/sampling_defaults.py); explicit SamplingParams
are used as they are. `chat` answers conversations (lists of `{"role", "content"}`
messages) through the checkpoint's chat template, as the HTTP chat endpoint
renders them (no tokenizer BOS beyond what the template writes; `tools` and
`chat_template_kwargs` to the template), and returns the answers' outputs, their
text unparsed (tool calls and reasoning are split over HTTP: cluster/).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

from actors.config import EngineConfig
from actors.engine import Engine
from actors.request import RequestOutput
from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import SamplingParams
from actors.tokenization import encode_prompt, load_tokenizer


class LLM:
    def __init__(self, model_dir: str | Path, **engine_args) -> None:
        self.model_dir = model_dir
        self.engine = Engine(model_dir, EngineConfig(**engine_args))
        self.sampling_defaults = SamplingDefaults.load(model_dir)

    @functools.cached_property
    def tokenizer(self):
        """transformers' tokenizer, the chat template's (the engine's own may be its
        pipeline alone: `load_engine_tokenizer`)."""
        return load_tokenizer(self.model_dir)

    def default_sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams with the checkpoint's sampling defaults, `fields` on top
        (as vLLM's `LLM.get_default_sampling_params`)."""
        return SamplingParams(**{**dataclasses.asdict(self.sampling_defaults), **fields})

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.
        All prompts are validated before any is queued."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        encoded = [self.engine.tokenize(p) for p in prompts]
        for ids, p in zip(encoded, params):
            self.engine.validate(ids, p)
        ids = [self.engine.add_request(e, p) for e, p in zip(encoded, params)]
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Answer each conversation (one conversation: a list of messages; or a
        list of them), in order."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.chat_prompt(messages, tools=tools, chat_template_kwargs=chat_template_kwargs,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)
                   for messages in conversations]
        return self.generate(prompts, params, progress=progress)

    def chat_prompt(self, messages: Sequence[dict], *, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """A conversation's prompt ids: the chat template's text, tokenized without
        the tokenizer's own special tokens (the template writes those it wants)."""
        text = self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  **(chat_template_kwargs or {}))
        return encode_prompt(self.tokenizer, text, add_special_tokens=False)
