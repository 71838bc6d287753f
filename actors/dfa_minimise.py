"""A DFA's states that no text tells apart, merged (actors/regex_dfa.py builds the
DFA; this makes it small): dead ends pruned, then Moore's refinement, its rounds
sorting a checked hash of each state's blocks, bounded by `MAX_MINIMISE_WORK`.

A DFA here is its transitions by class of bytes (`by_class`: a row a state, a
column a class) and which states accept; state 0 is dead (nothing can follow) and
1 the start, and stay so.
"""

from __future__ import annotations

import numpy as np

MAX_MINIMISE_WORK = 1_500_000  # states x rounds of refinement: about 0.3 s, here; then kept as built

DEAD, START = 0, 1  # the states every DFA has


def prune_dead(transitions: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """Transitions into states from which no accepting state is reachable go to 0
    (`transitions`: a column a byte, or a class of bytes). A search back from the
    accepting states along the edges reversed: each state once, where rounds of
    "leads to a live state" took one a step of the longest path (`[\\s\\S]{2000}`,
    a chain of 16k states: about 2000 rounds, and its compile 2.0 s, 0.46 s after)."""
    num_states, num_columns = transitions.shape
    targets = transitions.ravel()
    order = np.argsort(targets, kind="stable")
    sources = (order // num_columns).tolist()  # each edge's state, the edges sorted by target
    first_edge = np.searchsorted(targets[order], np.arange(num_states + 1)).tolist()
    live = accepting.tolist()
    live[DEAD] = False
    stack = [state for state, accepts in enumerate(live) if accepts]
    while stack:
        state = stack.pop()
        for before in sources[first_edge[state]:first_edge[state + 1]]:
            if not live[before]:
                live[before] = True
                stack.append(before)
    live = np.array(live)
    return np.where(live[transitions], transitions, 0).astype(np.int32)


def minimised(by_class: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The DFA with the states that no text tells apart merged (Moore's
    refinement: split states by accepting or not, then by the blocks their
    bytes lead to, until no block splits). The subset construction leaves many
    such states (a JSON string's characters under each key of a schema, say,
    or twenty strict tools' 5179 states, 2121 merged); each one a request
    reaches costs a walk of the vocabulary (its mask,
    actors/structured_output.py). A round tells states apart by a hash of their
    blocks (`_hashed_split`), a sort of one integer a state; the blocks it
    settles on are then checked to be what merging needs (each block's states
    accept alike and lead, byte for byte, to the same blocks), so a collision
    of hashes costs the exact rounds (`_split`), never a wrong automaton. Dead
    stays 0 and the start 1. A DFA that has not settled within
    `MAX_MINIMISE_WORK` / its states rounds (a long chain of states, each told
    apart from the next only by its distance to the end: 300 rounds at 5000
    states; twenty strict tools' answer settles in 134, forty's 9579 states in
    about 140) is kept as it is."""
    multipliers = np.random.default_rng(len(accepting)).integers(
        1, 2**63, by_class.shape[1] + 1, dtype=np.uint64) | np.uint64(1)  # (odd)
    blocks = _refined(by_class, accepting, lambda blocks, _: _hashed_split(blocks, by_class, multipliers))
    if blocks is not None and not _merges_soundly(blocks, by_class, accepting):
        blocks = _refined(by_class, accepting, lambda blocks, num_blocks: _split(blocks, by_class, num_blocks))
    if blocks is None:
        return by_class, accepting
    num_blocks = blocks.max() + 1
    if num_blocks == len(accepting) or blocks[DEAD] == blocks[START]:
        return by_class, accepting
    order = [blocks[DEAD], blocks[START]] + [b for b in dict.fromkeys(blocks.tolist()) if b not in
                                             (blocks[DEAD], blocks[START])]
    new_id = np.empty(num_blocks, dtype=np.int32)
    new_id[order] = np.arange(num_blocks, dtype=np.int32)
    first_of = np.unique(blocks, return_index=True)[1]  # a state of each block
    representatives = first_of[order]
    return new_id[blocks[by_class[representatives]]], accepting[representatives]


def classes_within(by_class: np.ndarray, num_bytes: int) -> np.ndarray:
    """Each state's class, where the states of a class lead to a dead state after the
    same texts of at most `num_bytes` bytes (Moore's rounds from dead or live, that
    many at most, exact): the tokens that short a state allows are its class's
    (actors/structured_output.py shares their masks). A counted repeat's copies are
    apart in the automaton but alike to a token: a JSON string of at most 2000
    characters has 28,004 states, and 16 bytes tell apart 211 classes of them."""
    blocks = (np.arange(len(by_class)) != DEAD).astype(np.int64)
    num_blocks = len(np.unique(blocks))
    for _ in range(num_bytes):
        blocks = _split(blocks, by_class, num_blocks)
        if blocks.max() + 1 == num_blocks:
            break
        num_blocks = blocks.max() + 1
    return blocks


def _refined(by_class: np.ndarray, accepting: np.ndarray, split) -> np.ndarray | None:
    """Each state's block once `split` (blocks, their number -> the next blocks)
    splits none, from accepting or not; None if that takes more rounds than
    `MAX_MINIMISE_WORK` allows."""
    blocks = accepting.astype(np.int64)
    num_blocks = len(np.unique(blocks))
    for _ in range(MAX_MINIMISE_WORK // len(accepting)):
        blocks = split(blocks, num_blocks)
        if blocks.max() + 1 == num_blocks:
            return blocks
        num_blocks = blocks.max() + 1
    return None


def _hashed_split(blocks: np.ndarray, columns: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """`_split` by a hash of each state's block and its columns' blocks (random
    odd `multipliers`, sums wrapping at 64 bits): distinct rows may collide, which
    `_merges_soundly` catches."""
    signature = np.concatenate([blocks[:, None], blocks[columns]], axis=1).astype(np.uint64)
    keys = (signature * multipliers).sum(axis=1, dtype=np.uint64)
    return np.unique(keys, return_inverse=True)[1].reshape(-1)


def _merges_soundly(blocks: np.ndarray, columns: np.ndarray, accepting: np.ndarray) -> bool:
    """Whether each block's states accept alike and each byte class takes them all
    to one block: then merging them keeps the language."""
    _, first_of, numbered = np.unique(blocks, return_index=True, return_inverse=True)
    blocks = numbered.reshape(-1)
    first = first_of[blocks]  # each state's block's first state
    return bool((accepting == accepting[first]).all() and (blocks[columns] == blocks[columns[first]]).all())


def _split(blocks: np.ndarray, columns: np.ndarray, num_blocks: int) -> np.ndarray:
    """Each state's new block: its block and its columns' blocks, numbered from 0.
    One integer a state where (block, columns) fits in 63 bits, else its row of them."""
    signature = np.concatenate([blocks[:, None], blocks[columns]], axis=1)
    if int(num_blocks) ** signature.shape[1] < 2 ** 63:  # (Python ints: no overflow)
        keys = signature @ (num_blocks ** np.arange(signature.shape[1], dtype=np.int64))
    else:
        signature = np.ascontiguousarray(signature)
        keys = signature.view(np.dtype((np.void, signature.dtype.itemsize * signature.shape[1]))).reshape(-1)
    return np.unique(keys, return_inverse=True)[1].reshape(-1)
