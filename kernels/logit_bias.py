"""Per-request additive logit bias, and the bans built on it; a per-request list of
the only tokens allowed.

OpenAI's `logit_bias` adds a fixed number (-100 to 100) to chosen tokens' logits
before sampling; a ban adds minus infinity, which is how `min_new_tokens` keeps a
request's stop tokens (EOS included) out until it has that many tokens (vLLM's
`min_tokens` does the same). A token named twice for a row (a bias on a banned
token) gets the sum: banned either way. Applied before the penalties
(kernels/penalties.py) and the temperature; logprobs stay those of the raw logits.

vLLM's `allowed_token_ids` bans every other token (`keep_only_`), before the bias:
a bias on an allowed token still counts, one on another token is moot. A
structured-output request's tokens are a packed mask a row (`keep_masked_`,
actors/structured_output.py), applied the same way and before the bias.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from kernels import to_device


def add_logit_bias_(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[Sequence[int] | np.ndarray],
                    values: Sequence[Sequence[float] | np.ndarray]) -> None:
    """Add `values[i][j]` to entry `token_ids[i][j]` of row `rows[i]` of `logits`
    [B, V] (contiguous; in place): one scatter-add of the named entries. Arrays
    cost a concatenation (lists a conversion: make long ones arrays once).

    A row whose bans (minus infinities) would leave it no token to draw keeps what
    it had before this call: its other rules (a pattern's one way on, its allowed
    ids) outrank them, as a pattern's mask keeps a stop id where it is the one way
    on (actors/structured_output.py). A row of minus infinities would sample an
    arbitrary id. Checked on the device, for the rows with a ban only."""
    lengths = [len(ids) for ids in token_ids]
    if not sum(lengths):
        return
    columns = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_ids])
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    added = np.concatenate([np.asarray(v, dtype=np.float64) for v in values])
    banned = np.isneginf(added)
    has_bans = bool(banned.any())
    if has_bans:
        banning = to_device(torch.from_numpy(np.unique(row_of[banned])), logits.device)
        before = logits[banning]  # (a copy)
    keys = to_device(torch.from_numpy(row_of * logits.shape[1] + columns), logits.device)
    logits.view(-1).index_add_(0, keys, to_device(torch.from_numpy(added).to(logits.dtype), logits.device))
    if has_bans:
        after = logits[banning]
        emptied = torch.isneginf(after).all(dim=1, keepdim=True)
        logits[banning] = torch.where(emptied, before, after)


def keep_only_(logits: torch.Tensor, rows: Sequence[int], allowed: Sequence[Sequence[int] | np.ndarray]) -> None:
    """Set every entry of row `rows[i]` of `logits` [B, V] (contiguous; in place) to
    minus infinity except those `allowed[i]` names (ids, a list or an array; an
    empty one: the row is left as it is)."""
    named = [(row, ids) for row, ids in zip(rows, allowed) if len(ids)]
    if not named:
        return
    keys = np.concatenate([np.asarray(ids, dtype=np.int64) + row * logits.shape[1] for row, ids in named])
    keys = to_device(torch.from_numpy(keys), logits.device)
    banned_rows = to_device(torch.from_numpy(np.asarray([row for row, _ in named], dtype=np.int64)), logits.device)
    kept = logits.view(-1)[keys]
    logits[banned_rows] = -torch.inf
    logits.view(-1)[keys] = kept


def keep_masked_(logits: torch.Tensor, rows: Sequence[int], packed_masks: Sequence[np.ndarray]) -> None:
    """Set every entry of row `rows[i]` of `logits` [B, V] (in place) to minus
    infinity except those whose bit is set in `packed_masks[i]` (`np.packbits` of a
    [V] bool mask: eight tokens a byte, the first in the high bit). To a GPU the
    masks cross packed (a 152k vocabulary: 19 KB a row) and are unpacked there, a
    byte's eight bits looked up in a table; on CPU numpy unpacks them."""
    if not len(rows):
        return
    packed = np.stack(packed_masks)
    if logits.device.type == "cpu":
        keep = torch.from_numpy(np.unpackbits(packed, axis=1, count=logits.shape[1]).view(bool))
    else:
        table = _bit_table(logits.device)
        keep = table[to_device(torch.from_numpy(packed), logits.device).long()].reshape(len(rows), -1)
        keep = keep[:, : logits.shape[1]]
    if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # every row, in order (rows are ascending)
        logits.masked_fill_(~keep, -torch.inf)
        return
    index = to_device(torch.from_numpy(np.asarray(rows, dtype=np.int64)), logits.device)
    logits[index] = logits[index].masked_fill(~keep, -torch.inf)


@functools.cache
def _bit_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte value, the high bit first (np.packbits' order)."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool)
    return to_device(torch.from_numpy(bits), device)
