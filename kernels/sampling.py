"""Token sampling and log-probabilities over a batch of logits rows.

Each row carries its own temperature, top-k, top-p and random generator, so a row's
result depends only on its logits and its own generator: the same seed gives the same
tokens whatever else shares the batch. A random row draws exactly one uniform number
from its generator per token (inverse-CDF sampling over the filtered distribution).

Devices. The generators are CPU generators whatever the logits' device: a seed then
draws the same numbers on every device, and a generator's state can travel between
workers (a prefill worker hands it to the decode worker with the first token). Every
tensor the sampling makes sits on the logits' device; the per-row settings and the
draws go there in one copy from pinned memory that does not wait for the device, so
sampling never stalls the host on work queued before it (a step can be launched
while the previous one still runs).
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] float32. Temperature 0 means greedy;
    top_k 0 and top_p 1.0 mean no filtering. Returns [B] int64 on the logits' device."""
    batch = logits.shape[0]
    assert len(temperatures) == len(top_ks) == len(top_ps) == len(generators) == batch
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, t in enumerate(temperatures) if t > 0]
    if not random_rows:
        return tokens
    vocab = logits.shape[1]
    draws = [float(torch.rand((), generator=generators[i])) for i in random_rows]
    # One row a setting: row index, temperature, top-k, top-p, draw.
    settings = torch.tensor(
        [random_rows, [temperatures[i] for i in random_rows], [top_ks[i] or vocab for i in random_rows],
         [top_ps[i] for i in random_rows], draws],
        dtype=torch.float64,
    )
    if logits.device.type == "cuda":
        settings = settings.pin_memory().to(logits.device, non_blocking=True)
    else:
        settings = settings.to(logits.device)
    rows, ks = settings[0].long(), settings[2].long()
    temps, ps, draws = settings[1].float(), settings[3].float(), settings[4].float()
    scaled = logits[rows].float() / temps[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    keep = rank < ks[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < ps[:, None]) | (rank == 0)
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    picks = picks.clamp_(max=vocab - 1)
    # A pick past the kept set can only come from rounding at the top of the CDF.
    num_kept = keep.sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, num_kept - 1)
    tokens[rows] = sorted_ids.gather(1, picks).squeeze(1)
    return tokens


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
