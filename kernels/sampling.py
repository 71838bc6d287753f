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
seed and its logits alone, whatever shares the batch, whichever worker samples them (a prefill
worker samples the first token, a decode worker the rest: the seed is all that
travels), whether a step was launched ahead or the request was preempted and
recomputed; and the draws of a whole batch cost one vectorised call (0.04 ms at
batch 64, against 0.33 ms for a `torch.rand` call on a generator of each request's
own, one-off probes on this machine). The logits themselves may round differently
for another step's size: a GPU's GEMM does, and on CPU a step of more than 128
rows leaves the C++ small-batch linear layers for MKL's (kernels/cpu_linear.py),
which round otherwise by about 2e-6 in a logprob (a review saw a seeded request's
33rd token change beside 7 others, 1 case in about 20 fuzzed runs).

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
  such a batch sorts the whole vocabulary, which a GPU does quickly). On CUDA a
  top_k window does not grow: ties of the k-th may lie past it (bf16 logits tie
  often), so the kept set is read as what it always is, every token at least as
  likely as the least likely kept one (top-k with its ties, top-p's whole groups
  and min-p each keep such a set), the top-k's mass for top-p taken from the
  whole row, and the draw is inverted over the whole row with that threshold.
  Cut at the window, a seeded top_k 20 row's token changed with its batch (beside
  a top_k 50 or a top_p row) in 27 to 106 of 400 seeds over flat bf16 logits (a
  review's probe of this path on CPU).
Ties: every token tied with the k-th stays (transformers and vLLM drop only those
below it), a group of ties is kept or dropped by top_p whole, and the draw is
inverted in vocabulary order, so the order a sort gives ties (a `topk` of 40 or of
2000, a full sort: the batch's other rows decide) cannot change a token; it did
in 82 of 200 seeds over bf16 logits read in float32, which tie often. The kept set
is that of a full sort, and so a top-k or top-p row samples the same token as
sorting everything would (`reference_sample`; tests/test_kernels.py holds it to
that, and the reference's kept set to transformers' warpers). `tandem bench
kernels` times both.

The CDF is inverted in float64 (`_invert_cdf`): in float32 a running sum near 1
moves in steps of 6e-8, so a token less likely than that late in the vocabulary
could never be drawn (1.2e-3 of the mass of a 152k vocabulary at temperature 1, a
review measured), and the draw itself kept only 24 of its 53 bits. Blocks of
`CDF_BLOCK` tokens make it cheaper than the float32 prefix sum it replaced: their
sums, then one block's prefix sum.

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
CDF_BLOCK = 1024  # tokens a block of the CDF's inversion sums (`_invert_cdf`)
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
        tokens[rows] = _invert_cdf(probs, part[4])
    if best_first:
        rows, scaled, part = _scaled_rows(logits, settings, best_first)
        max_k = max((ks[n] for n in best_first if ks[n] < vocab), default=0)
        needs_mass = any(ks[n] == vocab for n in best_first)  # a row filters by top_p alone
        tokens[rows] = _sample_best_first(scaled, part[2].long(), part[3].float(), part[5].float(), part[4],
                                          max_k, needs_mass, grows=logits.device.type == "cpu")
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
    """Per row, the first index where the running sum of `probs` (float64) passes
    `draws` (float64) of the row's total; a zero-probability entry is never
    picked. By blocks: the block where the sums of the blocks pass it, then the
    entry within it. A draw at the very top, which rounding can take past the
    total, takes the last entry with any probability (it took the last index
    once: the last vocabulary id whatever its probability, a token that
    allowed_token_ids, a pattern, min_p or a ban had removed)."""
    rows, vocab = probs.shape
    whole = vocab // CDF_BLOCK
    sums = [probs[:, : whole * CDF_BLOCK].unfold(1, CDF_BLOCK, CDF_BLOCK).sum(dim=-1, dtype=torch.float64)] \
        if whole else []
    if vocab > whole * CDF_BLOCK:
        sums.append(probs[:, whole * CDF_BLOCK :].sum(dim=-1, keepdim=True, dtype=torch.float64))
    block_sums = torch.cat(sums, dim=1)
    block_cdf = block_sums.cumsum(dim=-1)
    target = draws.double()[:, None] * block_cdf[:, -1:]
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True), _last_positive(block_sums))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    inside = torch.where(columns < vocab, probs.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    at = torch.searchsorted(inside.double().cumsum(dim=-1), target - before, right=True)
    at = torch.minimum(at, _last_positive(inside))  # (past the block's sum by rounding: its last kept entry)
    return (block * CDF_BLOCK + at).squeeze(1).clamp_(max=vocab - 1)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's last column above 0 (its last where none is)."""
    return values.shape[1] - 1 - (values.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)


def _sample_best_first(scaled, ks, ps, min_ps, draws, max_k: int, needs_mass: bool, grows: bool) -> torch.Tensor:
    """Sample each row among its kept candidates (`_kept`), taken from a window of
    the best `width` (see the module docstring). Where the window `grows` (the
    CPU), it does while a row keeps its last column (candidates tied with it may
    lie past it); elsewhere, where checking would wait for the device, a top_k
    window holds one column past the largest k, and the kept set is read back
    over the whole row (`_pick_over_row`)."""
    vocab = scaled.shape[1]
    probs = scaled.softmax(dim=-1)
    width = min(vocab, max_k + 1)  # every row's k fits, and a column past it: a tie of the k-th shows
    if needs_mass:
        width = min(vocab, max(max_k + 1, FIRST_WINDOW)) if grows else vocab
    while True:
        top_probs, top_ids = probs.topk(width, dim=-1) if width < vocab else probs.sort(dim=-1, descending=True)
        # A window's top-k mass misses the k-th's ties past it, and top_p dropping them kept nothing in
        # its last column, so it did not grow: a top_k + top_p row kept too little (a review's probe: 4
        # of 300 seeded bf16 rows picked another token beside a row of larger top_k).
        k_mass = _top_k_mass(probs, top_probs, ks, vocab) if width < vocab else None
        keep = _kept(top_probs, ks, ps, min_ps, vocab, k_mass)
        if not grows and width < vocab:
            return _pick_over_row(probs, top_probs, top_ids, keep, draws)
        if width == vocab:
            break
        # Enough when no row keeps the last column, and a top_p-only row's p of the mass is in.
        if not bool(keep[:, -1].any()) and (
                not needs_mass or bool(((ks < vocab) | (top_probs.sum(dim=-1) >= ps)).all())):
            break
        width = min(vocab, max(width * 4, FIRST_WINDOW))
    return _pick(top_probs, top_ids, keep, draws)


def _top_k_mass(probs: torch.Tensor, probs_desc: torch.Tensor, ks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each top_k row's mass of its k best and every one tied with the k-th, read
    over the whole row (a window's own misses ties past it); 1 for the others."""
    kth = probs_desc.gather(1, (ks.clamp(max=probs_desc.shape[1]) - 1)[:, None])
    return torch.where(ks < vocab, (probs * (probs >= kth)).sum(dim=-1), 1.0)


def _pick_over_row(probs: torch.Tensor, probs_desc: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor,
                   draws: torch.Tensor) -> torch.Tensor:
    """`_pick`, the kept set read over the whole row: every token at least as
    likely as the least likely kept in the window (the kept set is always such a
    set), so ties of it past the window are kept too."""
    least = torch.where(keep, probs_desc, torch.inf).amin(dim=-1, keepdim=True)
    picks = _invert_cdf(torch.where(probs >= least, probs, 0.0), draws)
    return torch.where(keep.any(dim=-1), picks, ids[:, 0])  # (a NaN row keeps nothing: its best id)


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
          vocab: int, k_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Which of each row's best candidates (`probs_desc`: descending, the first
    columns of a full sort) survive transformers' chain: the best k, and every one
    tied with the k-th (transformers and vLLM drop only those below it); of those,
    the fewest whose mass before them is under p of the k's mass, a group of ties
    counted from the mass before the group (kept or dropped whole: in sort order,
    which ties take anyhow, one was kept and its twin not); of those, every one at
    least min_p of the best. The best always survives. `k_mass`: the top-k's mass
    (`_top_k_mass`), where the columns may not hold all of it."""
    columns = probs_desc.shape[1]
    rank = torch.arange(columns, device=probs_desc.device)[None, :]
    kth = probs_desc.gather(1, (ks.clamp(max=columns) - 1)[:, None])
    in_top_k = (probs_desc >= kth) | (ks[:, None] >= vocab)
    # A row without top_k: the whole vocabulary's mass (1), which a window need not hold.
    if k_mass is None:
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
    row_draws = torch.tensor([draws[i] for i in random_rows], dtype=torch.float64)
    tokens[rows] = _pick(sorted_probs, sorted_ids, keep, row_draws)
    return tokens


def ranks_of(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's rank of `token_ids` ([B]) in its logits [B, V]: how many tokens
    have one at least as high, itself among them (vLLM's `rank`: ties share the
    worse rank; 1 plus those higher gave them the better, unlike vLLM's)."""
    chosen = logits.gather(1, token_ids[:, None])
    return (logits >= chosen).sum(dim=-1).clamp_(min=1)  # (a NaN logit is at least as high as nothing)


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
