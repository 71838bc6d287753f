"""The engine benchmark's workloads: seeded random prompts (ids above the presets'
special tokens) with each request's own output length; greedy, EOS ignored.

- `mixed`: prompt lengths uniform in 32..512, output lengths uniform in 16..256.
- `equal`: every prompt the same length, every output the same length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SPECIAL_IDS = 3  # the presets' special tokens are ids 0..2; prompts avoid them


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
        }


def mixed_workload(num_requests: int, vocab_size: int, seed: int,
                   prompt_range=(32, 512), output_range=(16, 256)) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_range))
    return Workload("mixed", prompts, outputs)


def equal_workload(num_requests: int, prompt_len: int, new_tokens: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(SPECIAL_IDS, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    return Workload("equal", prompts, [new_tokens] * num_requests)
