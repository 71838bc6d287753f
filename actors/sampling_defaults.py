"""A model's own sampling defaults: what a request that leaves a field out gets.

Instruct checkpoints ship the sampling their authors tuned them for in
generation_config.json (Qwen2.5 Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05; Llama 3.1 Instruct: temperature 0.6, top_p 0.9).
transformers' `generate` reads them; vLLM (`--generation-config auto`, its default
since 0.8) and SGLang (`--sampling-defaults model`, its default) make them the
values of the fields an HTTP request omits, and a field the request sets wins, even
when it sets OpenAI's default (`temperature: 1.0` is 1.0). Tandem does the same:
the manifest's `sampling_defaults: model` (the default), or `openai` for OpenAI's
defaults whatever the checkpoint says (`temperature` 1, `top_p` 1, no `top_k`, no
`min_p`, no repetition penalty).

What is read, and what is not:
- `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, where the file
  names them (null or absent: OpenAI's default). A value no request could carry
  (top_p 0, a negative temperature, a string) is a CheckpointError at start-up,
  not a 400 on every request that left the field out.
- not `do_sample`: transformers' own default is false, so reading it would make
  every base checkpoint (which says `do_sample: false` or nothing) greedy by
  default; vLLM and SGLang ignore it too.
- not `max_new_tokens` (vLLM caps a request's default at it; SGLang does not): the
  endpoints keep their own (16 for completions, `limits.max_new_tokens` for chat).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from actors.config import GENERATION_CONFIG, CheckpointError, read_generation_config
from actors.sampling_params import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)

SamplingDefaultsSource = Literal["model", "openai"]


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off

    @classmethod
    def load(cls, model_dir: str | Path, source: SamplingDefaultsSource = "model") -> SamplingDefaults:
        """The defaults `source` names: the checkpoint's (`model`) or OpenAI's."""
        if source == "openai":
            return cls()
        path = Path(model_dir) / GENERATION_CONFIG
        generation = read_generation_config(model_dir)
        fields = {}
        for field in dataclasses.fields(cls):
            value = generation.get(field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"{path}: {field.name} must be a number, got {value!r}")
            if field.type == "int" and value != int(value):
                raise CheckpointError(f"{path}: {field.name} must be an integer, got {value!r}")
            fields[field.name] = int(value) if field.type == "int" else float(value)
        defaults = cls(**fields)
        try:
            SamplingParams(**dataclasses.asdict(defaults))
        except InvalidRequestError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        if fields:
            log.info("sampling defaults from %s: %s", path, fields)
        return defaults

    def fill(self, **fields) -> dict:
        """The request's sampling fields, each one it left out (None) the default."""
        return {name: getattr(self, name) if value is None else value for name, value in fields.items()}
