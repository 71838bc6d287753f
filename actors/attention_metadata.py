"""Per-step attention metadata: which token slots to write, how queries group.

Built by the model runner once per step and passed down the model explicitly. The
step's tokens are laid out prefill spans first, then the single-token decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk: tokens [q_start, q_start + q_len) of the step attend to
    the sequence's first ctx_len tokens (the chunk is its last q_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    prefills: tuple[PrefillSpan, ...]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_context_lens is None else int(self.decode_context_lens.shape[0])
