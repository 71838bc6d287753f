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
- a filtered row inverts it over its best candidates, in descending order, from
  `topk` over a window: the largest top_k of the batch's filtered rows, or, when a
  row filters by top_p alone, a window that grows (x4 from 1024) until it holds
  that row's top_p of the mass (on CPU, where checking costs nothing; on CUDA
  checking would wait for the device, so such a batch sorts the whole vocabulary,
  which a GPU does quickly).
The kept set and its order are those of a full descending sort, so a top-k or
top-p row samples the same token as sorting everything would (`reference_sample`;
tests/test_kernels.py holds it to that, and the reference's kept set to
transformers' warpers). `tandem bench kernels` times both.

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
    """Sample each row among its kept candidates (`_kept`), taken in descending
    order from a window of the best `width` (see the module docstring)."""
    vocab = scaled.shape[1]
    probs = scaled.softmax(dim=-1)
    width = max_k  # every row's k fits: enough unless a row filters by top_p alone
    if needs_mass:
        width = vocab if probs.is_cuda else min(vocab, max(max_k, FIRST_WINDOW))
    while True:
        top_probs, top_ids = probs.topk(width, dim=-1) if width < vocab else probs.sort(dim=-1, descending=True)
        # Enough when every row keeps at most `width`: its k fits, or its p of the mass does.
        if not needs_mass or width == vocab or bool(((ks <= width) | (top_probs.sum(dim=-1) >= ps)).all()):
            break
        width = min(vocab, width * 4)
    keep = _kept(top_probs, ks, ps, min_ps, vocab)
    picks = _invert_cdf(top_probs * keep, draws)
    # A pick past the kept set can only come from rounding at the top of the CDF;
    # a row of NaN logits (a broken model) keeps nothing and gets the best id.
    picks = torch.minimum(picks, (keep.sum(dim=-1) - 1).clamp_(min=0))
    return top_ids.gather(1, picks[:, None]).squeeze(1)


def _kept(probs_desc: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, min_ps: torch.Tensor,
          vocab: int) -> torch.Tensor:
    """Which of each row's best candidates (`probs_desc`: descending, the first
    columns of a full sort) survive transformers' chain: the best k; of those, the
    fewest whose mass before them is under p of the k's mass; of those, every one
    at least min_p of the best. The best always survives."""
    rank = torch.arange(probs_desc.shape[1], device=probs_desc.device)[None, :]
    in_top_k = rank < ks[:, None]
    # A row without top_k: the whole vocabulary's mass (1), which a window need not hold.
    k_mass = torch.where(ks < vocab, (probs_desc * in_top_k).sum(dim=-1), 1.0)
    mass_before = probs_desc.cumsum(dim=-1) - probs_desc
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
    row sorts the whole vocabulary and inverts the CDF in descending order. Top-k
    and top-p rows pick what `sample` picks, draw for draw; the others the same
    distribution in another order. CPU, for tests and `tandem bench kernels`."""
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
    cdf = (sorted_probs * keep).cumsum(dim=-1)
    row_draws = torch.tensor([draws[i] for i in random_rows], dtype=torch.float32)
    picks = torch.searchsorted(cdf, (row_draws * cdf[:, -1])[:, None], right=True).clamp_(max=sorted_probs.shape[1] - 1)
    picks = torch.minimum(picks, keep.sum(dim=-1, keepdim=True) - 1)
    tokens[rows] = sorted_ids.gather(1, picks).squeeze(1)
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
