"""Token sampling and log-probabilities over a batch of logits rows.

Each row carries its own temperature, top-k, top-p, min-p and draw, a uniform
number in [0, 1) at which it inverts the CDF of its (filtered) distribution, so a
row's result depends only on its logits and its draw.

The filters chain as transformers' warpers do (the reference a checkpoint's
recommended settings were tuned against): temperature, then top-k, then top-p over
the top-k's own mass (renormalised: with top_k 20 and top_p 0.8, Qwen2.5
Instruct's defaults, the fewest of the 20 best that hold 0.8 of those 20's mass),
then min-p (a token stays if its probability is at least min_p times the best
one's). vLLM renormalises top-p over top-k too; SGLang's torch path takes top-p of
the whole mass. The draws come from `uniform_draws`: a
counter-based generator, one number per (seed, index of the token being sampled),
the same on every device and in every batch. So a request's tokens depend on its
seed alone, whatever shares the batch, whichever worker samples them (a prefill
worker samples the first token, a decode worker the rest: the seed is all that
travels), whether a step was launched ahead or the request was preempted and
recomputed; and the draws of a whole batch cost one vectorised call (0.04 ms at
batch 64, against 0.33 ms for a `torch.rand` call on a generator of each request's
own, one-off probes on this machine).

No full sort of the vocabulary where it can be avoided: sorting a 152k-token
vocabulary costs about 10 ms a row on this machine's CPU (590-680 ms a step at
batch 64 in `tandem bench kernels --sections sampling`, four times the bench
model's forward), so
- a row with no filter (top_k 0, top_p 1: the default request) inverts the CDF
  of its probabilities in vocabulary order (a softmax and a prefix sum); a min_p
  alone zeroes the probabilities under its threshold first (a max and a compare);
- a filtered row inverts it over its kept candidates, in vocabulary order, from
  `topk` over a window: one past the largest top_k of the batch's filtered rows,
  or, when a row filters by top_p alone, a window that grows (x4 from 1024) until
  it holds that row's top_p of the mass and no row keeps its last column (on CPU,
  where checking costs nothing; on CUDA checking would wait for the device, so
  such a batch sorts the whole vocabulary, which a GPU does quickly).
Ties: every token tied with the k-th stays (transformers and vLLM drop only those
below it), a group of ties is kept or dropped by top_p whole, and the draw is
inverted in vocabulary order, so the order a sort gives ties (a `topk` of 40 or of
2000, a full sort: the batch's other rows decide) cannot change a token; it did
in 82 of 200 seeds over bf16 logits read in float32, which tie often. The kept set
is that of a full sort, and so a top-k or top-p row samples the same token as
sorting everything would (`reference_sample`; tests/test_kernels.py holds it to
that, and the reference's kept set to transformers' warpers). `tandem bench
kernels` times both.

Devices. The draws are made on the host. Every tensor the sampling makes sits on
the logits' device; the per-row settings and the draws go there in one copy from
pinned memory that does not wait for the device, so sampling never stalls the host
on work queued before it (a step can be launched while the previous one still runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels import to_device

FIRST_WINDOW = 1024  # candidates a top_p-only row starts from (CPU)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2**64 over the golden ratio, odd


def uniform_draws(seeds: Sequence[int], indexes: Sequence[int]) -> list[float]:
    """One number in [0, 1) per (seed, index), each seed in [0, 2**63): SplitMix64,
    counter-based. The seed is mixed into a key (so neighbouring seeds give
    unrelated streams) and draw `index` is the mix of key + (index + 1) * gamma,
    which is the index-th output of SplitMix64 started from that key (a generator
    that passes BigCrush); the top 53 bits make the double."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as it should
        key = _mix64(np.asarray(seeds, dtype=np.uint64))
        mixed = _mix64(key + (np.asarray(indexes, dtype=np.uint64) + np.uint64(1)) * _GAMMA)
    return ((mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53).tolist()


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Stafford's variant 13 of the MurmurHash3 finaliser)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    draws: Sequence[float],
    min_ps: Sequence[float] | None = None,
) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] float32 (any float dtype where every
    row is greedy: an argmax alone, actors/model_runner.py). Temperature 0 means greedy;
    top_k 0, top_p 1.0 and min_p 0 (None: every row's) mean no filtering; `draws`
    (from `uniform_draws`) are read for the rows that sample. Returns [B] int64 on
    the logits' device."""
    batch, vocab = logits.shape
    min_ps = min_ps or [0.0] * batch
    assert len(temperatures) == len(top_ks) == len(top_ps) == len(draws) == len(min_ps) == batch
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, t in enumerate(temperatures) if t > 0]
    if not random_rows:
        return tokens
    ks = [top_ks[i] if 0 < top_ks[i] < vocab else vocab for i in random_rows]
    # One row a setting: row index, temperature, top-k, top-p, draw, min-p.
    settings = to_device(torch.tensor(
        [random_rows, [temperatures[i] for i in random_rows], ks, [top_ps[i] for i in random_rows],
         [draws[i] for i in random_rows], [min_ps[i] for i in random_rows]],
        dtype=torch.float64,
    ), logits.device)
    vocab_order = [n for n, k in enumerate(ks) if k == vocab and top_ps[random_rows[n]] >= 1.0]
    best_first = sorted(set(range(len(random_rows))) - set(vocab_order))
    if vocab_order:
        rows, scaled, part = _scaled_rows(logits, settings, vocab_order)
        probs = scaled.softmax(dim=-1)
        if any(min_ps[random_rows[n]] > 0 for n in vocab_order):
            probs.masked_fill_(probs < part[5].float()[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        tokens[rows] = _invert_cdf(probs, part[4].float())
    if best_first:
        rows, scaled, part = _scaled_rows(logits, settings, best_first)
        max_k = max((ks[n] for n in best_first if ks[n] < vocab), default=0)
        needs_mass = any(ks[n] == vocab for n in best_first)  # a row filters by top_p alone
        tokens[rows] = _sample_best_first(scaled, part[2].long(), part[3].float(), part[5].float(), part[4].float(),
                                          max_k, needs_mass)
    return tokens


def _scaled_rows(logits: torch.Tensor, settings: torch.Tensor, members: list[int]):
    """The rows of `members` (indexes into the settings' columns): their row ids,
    their logits over their temperatures, and their settings."""
    part = settings[:, members] if len(members) < settings.shape[1] else settings
    rows = part[0].long()
    every_row = len(members) == logits.shape[0]  # then no gather: a copy of [B, V] costs as much as a softmax
    scaled = (logits if every_row else logits[rows]).float() / part[1].float()[:, None]
    return rows, scaled, part


def _invert_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where the running sum of `probs` passes `draws` of
    the row's total (a zero-probability entry is never picked). A draw at the very
    top (one in [1 - 2**-25, 1) is 1.0 in float32, and a product with the total can
    round up to it) passes every entry: it takes the last entry with any
    probability. It took the last index, clamped: in vocabulary order, the last
    vocabulary id whatever its probability, once in about 34 million draws a token
    that allowed_token_ids, a pattern, min_p or a ban had removed."""
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
    last_kept = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(picks, last_kept)


def _sample_best_first(scaled, ks, ps, min_ps, draws, max_k: int, needs_mass: bool) -> torch.Tensor:
    """Sample each row among its kept candidates (`_kept`), taken from a window of
    the best `width` (see the module docstring). On the CPU the window grows while
    a row keeps its last column (candidates tied with it may lie past it); on a
    device, where checking would wait for it, a top_k window holds one column past
    the largest k, and ties of the k-th past that are cut (rare: two or more)."""
    vocab = scaled.shape[1]
    probs = scaled.softmax(dim=-1)
    width = min(vocab, max_k + 1)  # every row's k fits, and a column past it: a tie of the k-th shows
    if needs_mass:
        width = vocab if probs.device.type != "cpu" else min(vocab, max(max_k + 1, FIRST_WINDOW))
    while True:
        top_probs, top_ids = probs.topk(width, dim=-1) if width < vocab else probs.sort(dim=-1, descending=True)
        keep = _kept(top_probs, ks, ps, min_ps, vocab)
        if width == vocab or probs.device.type != "cpu":
            break
        # Enough when no row keeps the last column, and a top_p-only row's p of the mass is in.
        if not bool(keep[:, -1].any()) and (
                not needs_mass or bool(((ks < vocab) | (top_probs.sum(dim=-1) >= ps)).all())):
            break
        width = min(vocab, max(width * 4, FIRST_WINDOW))
    return _pick(top_probs, top_ids, keep, draws)


def _pick(probs_desc: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Each row's draw inverted over its kept candidates in vocabulary order, so
    that the order ties take in a sort (a `topk` of 40, of 2000, a full sort: the
    batch's other rows set which) cannot change the token. In descending order, a
    seeded request's token changed with its batch in 82 of 200 draws over bf16
    logits rounded to float32, which tie often (a review's probe)."""
    vocab_order = torch.where(keep, ids, torch.iinfo(ids.dtype).max).argsort(dim=-1)  # kept first, by id
    picks = _invert_cdf((probs_desc * keep).gather(1, vocab_order), draws)
    # A pick past the kept set can only come from rounding at the top of the CDF;
    # a row of NaN logits (a broken model) keeps nothing and gets the best id.
    picks = torch.minimum(picks, (keep.sum(dim=-1) - 1).clamp_(min=0))
    return ids.gather(1, vocab_order.gather(1, picks[:, None])).squeeze(1)


def _kept(probs_desc: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, min_ps: torch.Tensor,
          vocab: int) -> torch.Tensor:
    """Which of each row's best candidates (`probs_desc`: descending, the first
    columns of a full sort) survive transformers' chain: the best k, and every one
    tied with the k-th (transformers and vLLM drop only those below it); of those,
    the fewest whose mass before them is under p of the k's mass, a group of ties
    counted from the mass before the group (kept or dropped whole: in sort order,
    which ties take anyhow, one was kept and its twin not); of those, every one at
    least min_p of the best. The best always survives."""
    columns = probs_desc.shape[1]
    rank = torch.arange(columns, device=probs_desc.device)[None, :]
    kth = probs_desc.gather(1, (ks.clamp(max=columns) - 1)[:, None])
    in_top_k = (probs_desc >= kth) | (ks[:, None] >= vocab)
    # A row without top_k: the whole vocabulary's mass (1), which a window need not hold.
    k_mass = torch.where(ks < vocab, (probs_desc * in_top_k).sum(dim=-1), 1.0)
    mass_before = probs_desc.cumsum(dim=-1) - probs_desc
    ascending = -probs_desc  # (a descending row, negated: ascending, as searchsorted wants)
    first_of_ties = torch.searchsorted(ascending.contiguous(), ascending.contiguous(), right=False)
    first_of_ties.clamp_(max=columns - 1)  # (a NaN row's: past the end)
    mass_before = mass_before.gather(1, first_of_ties)
    in_top_p = (mass_before < ps[:, None] * k_mass[:, None]) | (rank == 0)
    return in_top_k & in_top_p & (probs_desc >= min_ps[:, None] * probs_desc[:, :1])


def reference_sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    draws: Sequence[float],
    min_ps: Sequence[float] | None = None,
) -> torch.Tensor:
    """The reference for `sample` (and what it was before the windows): every random
    row sorts the whole vocabulary and inverts the CDF over its kept candidates in
    vocabulary order. Top-k and top-p rows pick what `sample` picks, draw for draw;
    the others the same distribution. CPU, for tests and `tandem bench kernels`."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, t in enumerate(temperatures) if t > 0]
    if not random_rows:
        return tokens
    vocab = logits.shape[1]
    rows = torch.tensor(random_rows)
    temps = torch.tensor([temperatures[i] for i in random_rows], dtype=torch.float32)
    sorted_probs, sorted_ids = (logits[rows].float() / temps[:, None]).softmax(-1).sort(dim=-1, descending=True)
    ks = torch.tensor([top_ks[i] if 0 < top_ks[i] < vocab else vocab for i in random_rows])
    ps = torch.tensor([top_ps[i] for i in random_rows], dtype=torch.float32)
    min_p = torch.tensor([min_ps[i] if min_ps else 0.0 for i in random_rows], dtype=torch.float32)
    keep = _kept(sorted_probs, ks, ps, min_p, vocab)
    row_draws = torch.tensor([draws[i] for i in random_rows], dtype=torch.float32)
    tokens[rows] = _pick(sorted_probs, sorted_ids, keep, row_draws)
    return tokens


def ranks_of(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's rank of `token_ids` ([B]) in its logits [B, V]: 1 plus how many
    tokens have a higher one (vLLM's `rank`; ties share the better rank)."""
    chosen = logits.gather(1, token_ids[:, None])
    return (logits > chosen).sum(dim=-1) + 1


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-softmax of the raw logits at `token_ids` ([B]), and the `num_top` best
    (ids [B, n], logprobs [B, n]) when num_top > 0."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_top <= 0:
        return chosen, None, None
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_lp
