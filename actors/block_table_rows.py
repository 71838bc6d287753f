"""The host side of a static decode step's block tables, kept from step to step.

Converting every sequence's block table from a Python list to int64 each step costs
O(context) a sequence: for 64 sequences 0.08 ms a step at 8 blocks, 0.18 ms at 64,
0.53 ms at 256 (4k tokens at block size 16), against 0.011 ms kept this way
(`tandem bench kernels --sections block_tables`); the rest of a step's host work
is about 1.2 ms. But a
sequence's block table only grows (the scheduler appends blocks to the same list;
preemption, admission and finishing make a new list), and a run of decode steps
keeps its sequences in the same rows. So row i mirrors the list it was last given
and a step copies only the blocks appended since: O(1) a sequence, O(context) only
when a row changes hands. vLLM's input batch keeps persistent block tables for the
same reason.

Invariant: row i holds `owners[i][:lengths[i]]`, then `pad` to the end of the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableRows:
    def __init__(self, max_rows: int, max_blocks: int, pad: int) -> None:
        self.pad = pad
        self.array = np.full((max_rows, max_blocks), pad, dtype=np.int64)
        self.lengths = [0] * max_rows
        self.owners: list[list[int] | None] = [None] * max_rows

    def update(self, tables: Sequence[list[int]], num_blocks: Sequence[int], num_rows: int) -> int:
        """Row i := tables[i][:num_blocks[i]] for the given tables; rows after them,
        up to `num_rows`, hold padding only. Returns the widest row's length (the
        columns a step must copy)."""
        for row, (table, length) in enumerate(zip(tables, num_blocks)):
            have = self.lengths[row]
            if self.owners[row] is table and have <= length:
                if length > have:  # blocks appended since the last step
                    self.array[row, have:length] = table[have:length]
            else:
                self.array[row, :length] = table[:length]
                if have > length:
                    self.array[row, length:have] = self.pad
                self.owners[row] = table
            self.lengths[row] = length
        for row in range(len(tables), num_rows):
            if self.lengths[row]:
                self.array[row, : self.lengths[row]] = self.pad
            self.lengths[row], self.owners[row] = 0, None
        return max(self.lengths[:num_rows], default=0)
