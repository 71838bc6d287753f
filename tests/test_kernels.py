"""Paged attention, KV slot writes and sampling against plain references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.attention import (
    decode_attention,
    prefill_attention,
    reference_attention,
    write_kv_slots,
)
from kernels.sampling import logprobs_of, ranks_of, reference_sample, sample, uniform_draws

NUM_LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def _cache(num_blocks, block_size):
    return torch.zeros(num_blocks, NUM_LAYERS, 2, block_size, KV_HEADS, HEAD_DIM)


def _fill(layer_cache, table, k, v, block_size):
    positions = torch.arange(k.shape[0])
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    write_kv_slots(layer_cache, k, v, slots)


def test_write_kv_slots_places_tokens_in_their_blocks():
    cache = _cache(8, 4)
    layer = cache[:, 1]
    k, v = torch.randn(6, KV_HEADS, HEAD_DIM), torch.randn(6, KV_HEADS, HEAD_DIM)
    _fill(layer, [5, 2], k, v, 4)
    assert torch.equal(cache[5, 1, 0], k[:4]) and torch.equal(cache[2, 1, 0, :2], k[4:])
    assert torch.equal(cache[5, 1, 1], v[:4]) and torch.equal(cache[2, 1, 1, :2], v[4:])
    assert cache[:, 0].abs().sum() == 0  # the other layer untouched
    assert cache[2, 1, :, 2:].abs().sum() == 0


def test_prefill_chunk_over_cached_prefix_matches_dense():
    torch.manual_seed(0)
    block_size, total, chunk = 4, 11, 5
    table = [3, 0, 6]
    layer = _cache(8, block_size)[:, 0]
    q = torch.randn(total, HEADS, HEAD_DIM)
    k, v = torch.randn(total, KV_HEADS, HEAD_DIM), torch.randn(total, KV_HEADS, HEAD_DIM)
    _fill(layer, table, k, v, block_size)
    scale = HEAD_DIM**-0.5
    out = prefill_attention(q[-chunk:], k[-chunk:], v[-chunk:], layer, torch.tensor(table), total, scale)
    expected = reference_attention(q, k, v, scale)[-chunk:]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_batch_of_different_lengths_matches_dense():
    torch.manual_seed(1)
    block_size = 4
    lengths = [1, 7, 12]
    tables = [[9], [4, 1], [2, 8, 5]]
    layer = _cache(10, block_size)[:, 1]
    qs, expected = [], []
    for length, table in zip(lengths, tables):
        q = torch.randn(length, HEADS, HEAD_DIM)
        k, v = torch.randn(length, KV_HEADS, HEAD_DIM), torch.randn(length, KV_HEADS, HEAD_DIM)
        _fill(layer, table, k, v, block_size)
        qs.append(q[-1])
        expected.append(reference_attention(q, k, v, HEAD_DIM**-0.5)[-1])
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    out = decode_attention(torch.stack(qs), layer, padded, torch.tensor(lengths), HEAD_DIM**-0.5)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


def _splitmix64(state: int) -> tuple[int, int]:
    """SplitMix64 as published (Steele, Lea and Flood 2014), in Python integers:
    (next state, output)."""
    mask = 2**64 - 1
    state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return state, z ^ (z >> 31)


def test_uniform_draws_are_splitmix64_outputs_keyed_by_the_seed():
    """Draw i of a seed is the i-th output of SplitMix64 started from the seed's
    key (the mix of the seed); numpy's wrapping uint64 arithmetic must match."""
    for seed in (0, 1, 2**63 - 1, 123456789):
        key = (_splitmix64((seed - 0x9E3779B97F4A7C15) % 2**64)[1])  # the mix of the seed itself
        state, expected = key, []
        for _ in range(5):
            state, out = _splitmix64(state)
            expected.append((out >> 11) * 2.0**-53)
        assert uniform_draws([seed] * 5, range(5)) == expected


def test_uniform_draws_are_uniform_across_indexes_and_neighbouring_seeds():
    by_index = torch.tensor(uniform_draws([42] * 50_000, range(50_000)))
    by_seed = torch.tensor(uniform_draws(range(50_000), [0] * 50_000))
    for draws in (by_index, by_seed):
        assert 0 <= draws.min() and draws.max() < 1
        counts = torch.histc(draws, bins=10, min=0, max=1)
        assert (counts - 5000).abs().max() < 300  # about 4 standard deviations
    assert abs(torch.corrcoef(torch.stack([by_seed[:-1], by_seed[1:]]))[0, 1]) < 0.02


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50)
    out = sample(logits, [0.0] * 3, [0] * 3, [1.0] * 3, uniform_draws(range(3), [0] * 3))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100)
    out = sample(logits, [1.0] * 4, [1, 1, 0, 0], [1.0, 1.0, 1e-6, 1e-6], uniform_draws(range(4), [0] * 4))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_restricts_to_the_k_best():
    torch.manual_seed(0)
    logits = torch.randn(1, 30)
    allowed = set(logits[0].topk(3).indices.tolist())
    picks = {int(sample(logits, [5.0], [3], [1.0], uniform_draws([0], [i]))[0]) for i in range(200)}
    assert picks <= allowed and len(picks) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    for index in range(3000):
        counts[sample(logits, [1.0], [0], [1.0], uniform_draws([0], [index]))[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)


def test_a_seeded_row_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    row = torch.randn(1, 64)
    alone = sample(row, [0.9], [0], [0.95], uniform_draws([7], [12]))
    batch = torch.cat([torch.randn(2, 64), row, torch.randn(1, 64)])
    draws = uniform_draws([1, 2, 7, 3], [0, 5, 12, 9])
    together = sample(batch, [0.5, 0.0, 0.9, 1.3], [0, 5, 0, 0], [1.0, 1.0, 0.95, 0.5], draws)
    assert together[2] == alone[0]


@pytest.mark.parametrize("spread", ["peaked", "flat", "top_k rows flat"])
def test_filtered_rows_sample_what_a_full_sort_samples(spread):
    """Top-k and top-p rows take their candidates from a window of the best (grown
    until it holds a top_p-only row's mass; the whole vocabulary when the
    distribution is flat); the tokens are those of sorting everything, draw for
    draw, whatever else shares the batch."""
    torch.manual_seed(0)
    vocab = 20_000
    settings = [(0.8, 0, 0.9, 0), (1.0, 40, 1.0, 0), (1.2, 3000, 0.95, 0), (0.7, 0, 0.5, 0), (1.0, 0, 1.0, 0),
                (0.0, 0, 1.0, 0), (0.7, 20, 0.8, 0), (1.0, 50, 0.9, 0.05), (0.9, 0, 0.95, 0.1), (1.0, 0, 1.0, 0.1)]
    rows = [settings[i % len(settings)] for i in range(len(settings) * 8)]
    scale = {"peaked": lambda row: 8.0, "flat": lambda row: 0.05,
             "top_k rows flat": lambda row: 0.05 if row[1] else 8.0}[spread]
    logits = torch.randn(len(rows), vocab) * torch.tensor([scale(row) for row in rows])[:, None]
    temperatures, top_ks, top_ps, min_ps = ([r[n] for r in rows] for n in range(4))
    draws = uniform_draws(range(len(rows)), [0] * len(rows))
    tokens = sample(logits, temperatures, top_ks, top_ps, draws, min_ps)
    expected = reference_sample(logits, temperatures, top_ks, top_ps, draws, min_ps)
    filtered = [i for i, (temperature, top_k, top_p, _) in enumerate(rows) if temperature == 0 or top_k or top_p < 1]
    assert tokens[filtered].tolist() == expected[filtered].tolist()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 20, 0.8, 0.0), (0.7, 20, 0.8, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.1),
    (0.6, 40, 0.95, 0.05), (1.3, 0, 0.7, 0.2), (1.0, 1, 0.5, 0.5),
])
def test_the_kept_candidates_are_transformers_warpers(temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p over the top-k's renormalised mass, min-p: the
    tokens transformers' warpers leave finite are the ones the sampler keeps."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from kernels.sampling import _kept

    torch.manual_seed(3)
    vocab = 500
    logits = torch.randn(16, vocab) * torch.linspace(0.5, 6, 16)[:, None]  # flat to peaked
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    warpers = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
    for warper in warpers + ([MinPLogitsWarper(min_p)] if min_p else []):
        warped = warper(None, warped)
    probs, ids = (logits / temperature).softmax(dim=-1).sort(dim=-1, descending=True)
    ks, ps, min_ps = torch.tensor([top_k or vocab] * 16), torch.full((16,), top_p), torch.full((16,), min_p)
    keep = _kept(probs, ks, ps, min_ps, vocab)
    for row in range(16):
        assert set(ids[row][keep[row]].tolist()) == set(torch.isfinite(warped[row]).nonzero().flatten().tolist())


def test_top_p_after_top_k_is_of_the_top_ks_mass():
    """The two best hold 0.3 and 0.2: of their 0.5, the best alone holds 0.6, past a
    top_p of 0.5, so only it is kept (of the whole vocabulary's mass, 0.3 would not be)."""
    logits = torch.log(torch.tensor([[0.3, 0.2] + [0.1] * 5]))
    picks = {int(sample(logits, [1.0], [2], [0.5], uniform_draws([0], [i]))[0]) for i in range(300)}
    assert picks == {0}


def test_top_p_after_top_k_counts_the_kths_ties_past_the_window():
    """top_k 2 over 0.5 and five tokens tied at 0.1: the top-k mass is 1.0 (the k
    best and every tie of the k-th), so the ties, 0.5 of it before them, stay
    under a top_p of 0.6. The CPU window (3 columns) summed its own 0.7 and
    dropped them, and kept nothing in its last column, so it never grew: it
    picked the best alone, and a row's token changed with its batch's top_k."""
    logits = torch.log(torch.tensor([[0.5] + [0.1] * 5 + [1e-13] * 10]))
    draws = [0.3, 0.6, 0.9]
    got = [int(sample(logits, [1.0], [2], [0.6], [draw])[0]) for draw in draws]
    assert got == [int(reference_sample(logits, [1.0], [2], [0.6], [draw])[0]) for draw in draws] == [0, 1, 4]
    beside = torch.cat([logits, logits.roll(3, dims=1)])  # (a mate whose top_k makes the window wider)
    assert [int(sample(beside, [1.0, 1.0], [2, 12], [0.6, 1.0], [draw, 0.5])[0]) for draw in draws] == got


def test_min_p_alone_keeps_what_holds_min_p_of_the_best():
    """0.2 of the best (0.5) is 0.1: the 0.05 token goes, the rest keep their shares."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = torch.zeros(4)
    for index in range(3000):
        counts[sample(logits, [1.0], [0], [1.0], uniform_draws([0], [index]), [0.2])[0]] += 1
    assert counts[3] == 0
    torch.testing.assert_close(counts / counts.sum(), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.03, rtol=0)


def test_unfiltered_rows_never_pick_an_impossible_token():
    logits = torch.randn(4, 5000)
    logits[:, ::2] = float("-inf")
    picks = torch.stack([sample(logits, [1.0] * 4, [0] * 4, [1.0] * 4, uniform_draws(range(4), [i] * 4))
                         for i in range(200)])
    assert (picks % 2 == 1).all()


@pytest.mark.parametrize("min_p", [0.0, 0.5])
def test_a_draw_at_the_very_top_picks_a_possible_token(min_p):
    """A draw in [1 - 2**-25, 1) is 1.0 in float32, past every entry of the CDF:
    in vocabulary order (no top-k, no top-p) it took the last vocabulary id,
    whatever its probability (seed 78499289's first draw is one)."""
    top = uniform_draws([78499289], [0])
    assert top[0] < 1.0 and float(torch.tensor(top, dtype=torch.float32)[0]) == 1.0
    only = torch.full((1, 2048), -float("inf"))
    only[0, 100] = 0.0  # the one token with any probability
    assert sample(only, [1.0], [0], [1.0], top, [min_p]).item() == 100
    peaked = torch.randn(1, 2048)
    peaked[0, 7] = 20.0
    assert sample(peaked, [1.0], [0], [1.0], top, [0.5]).item() == 7  # min_p keeps token 7 alone
    # (with every token possible, the draw, in float64, is no longer 1.0: the token where the CDF passes it)
    assert sample(peaked, [1.0], [0], [1.0], top, [min_p]).item() == (7 if min_p else _inverted(peaked[0], top[0]))


def _inverted(logits: torch.Tensor, draw: float) -> int:
    """The token a draw picks from a row's softmax, its CDF summed in float64 by numpy."""
    cdf = np.cumsum(logits.float().softmax(-1).double().numpy())
    return int(np.searchsorted(cdf, draw * cdf[-1], side="right"))


def test_the_least_likely_tokens_can_be_drawn():
    """A 150k-token tail holding 1e-3 of the mass, each token 7e-9, below the
    step of a float32 sum near 1 (6e-8): a CDF summed in float32 gave none of
    them any width, and a draw in the tail took the last one, or a token the
    rounding chose. Summed in float64 (by blocks), each is drawn as likely as
    it is: a draw half through the tail takes the token half through it."""
    vocab = 150_001
    logits = torch.full((1, vocab), float(np.log(1e-3 / (vocab - 1))))
    logits[0, 0] = float(np.log(1 - 1e-3))
    for draw in (1 - 0.5e-3, 1 - 0.25e-3, 0.9995 + 1e-9):
        picked = sample(logits, [1.0], [0], [1.0], [draw]).item()
        assert picked == _inverted(logits[0], draw) and abs(picked - (draw - 0.999) / 1e-3 * vocab) < 200


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 1.0), (0, 0.5)])
def test_a_row_of_nan_logits_gets_a_token_and_leaves_its_neighbours_alone(top_k, top_p):
    """A broken model's NaN row must not fail the batch (the step would fail every
    request on the worker): it gets some token in the vocabulary, the others theirs."""
    logits = torch.randn(3, 2048)
    broken = logits.clone()
    broken[1] = float("nan")
    args = ([1.0, 1.0, 0.7], [top_k] * 3, [top_p] * 3, uniform_draws([1, 2, 3], [0] * 3))
    picks, healthy = sample(broken, *args), sample(logits, *args)
    assert 0 <= picks[1] < 2048
    assert picks[[0, 2]].tolist() == healthy[[0, 2]].tolist()


def test_sampling_keeps_every_tensor_on_the_logits_device():
    """On the meta device any CPU tensor mixed in raises, as it does on CUDA (where
    the default request, temperature 1.0, once crashed the step)."""
    logits = torch.empty(3, 50, device="meta")
    tokens = sample(logits, [1.0, 0.0, 0.7], [0, 0, 5], [1.0, 1.0, 0.9], uniform_draws(range(3), [0] * 3))
    assert tokens.device.type == "meta" and tokens.shape == (3,)
    chosen, top_ids, _ = logprobs_of(logits, tokens, 2)
    assert chosen.device.type == top_ids.device.type == "meta"


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(2, 20)
    chosen, top_ids, top_lps = logprobs_of(logits, torch.tensor([3, 7]), 4)
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(chosen, reference[[0, 1], [3, 7]])
    torch.testing.assert_close(top_lps, reference.topk(4).values)
    assert torch.equal(top_ids, reference.topk(4).indices)


def test_a_window_that_does_not_grow_keeps_the_ties_past_it():
    """On CUDA a top_k window is one column past the batch's largest k and does
    not grow (checking would wait for the device); bf16 logits tie often, and
    ties of the k-th past the window were cut, so a seeded row's token changed
    with its batch. That path, run here on the CPU, picks what sorting the whole
    vocabulary picks for each row alone."""
    from kernels.sampling import _sample_best_first

    tied = torch.full((1, 256), -10.0)  # 10 best, then 100 tied: top_k 20's k-th is one of them, and so are 90
    tied[0, :10], tied[0, 10:110] = torch.linspace(6.0, 5.0, 10), 3.0  # past a window of 21
    draws = uniform_draws(list(range(40)), [0] * 40)
    got = [_sample_best_first(tied, torch.tensor([20]), torch.tensor([1.0]), torch.tensor([0.0]),
                              torch.tensor([draw], dtype=torch.float64), max_k=20, needs_mass=False,
                              grows=False).item() for draw in draws]
    assert got == [reference_sample(tied, [1.0], [20], [1.0], [draw]).item() for draw in draws]
    assert max(got) > 30  # (a tie past the window was drawn)
    vocab, gen = 4096, torch.Generator().manual_seed(0)
    temps, top_ks, top_ps, min_ps = [0.7, 1.0, 1.0], [20, 50, 5], [1.0, 0.95, 1.0], [0.0, 0.0, 0.1]
    for seed in range(60):
        logits = (torch.randn(3, vocab, generator=gen) * 2 + 5).bfloat16().float()
        draws = uniform_draws([seed] * 3, [0, 1, 2])
        got = _sample_best_first(logits / torch.tensor(temps)[:, None], torch.tensor(top_ks), torch.tensor(top_ps),
                                 torch.tensor(min_ps), torch.tensor(draws, dtype=torch.float64), max_k=50,
                                 needs_mass=False, grows=False)
        alone = [reference_sample(logits[i : i + 1], [temps[i]], [top_ks[i]], [top_ps[i]], [draws[i]],
                                  [min_ps[i]]).item() for i in range(3)]
        assert got.tolist() == alone, seed


def test_a_tokens_rank_counts_the_tokens_at_least_as_likely():
    """vLLM's rank: a tie shares the worse one (it was the better, 1 plus those above)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 1.0, 0.0, -2.0]])
    assert ranks_of(logits, torch.tensor([0, 0])).tolist() == [3, 1]
    assert ranks_of(logits, torch.tensor([3, 3])).tolist() == [2, 4]


def test_cpu_decode_kernel_matches_the_reference():
    """The C++ kernel against the torch reference on a page-first cache view with
    scattered block tables, GQA, and lengths from one token to several blocks and
    several context splits (256 tokens each)."""
    from kernels import cpu_attention

    if cpu_attention.load() is None:
        pytest.skip(f"no C++ toolchain here: {cpu_attention.build_error()}")
    torch.manual_seed(7)
    num_layers, num_blocks, block_size, kv_heads, heads, head_dim = 3, 64, 16, 2, 6, 32
    cache = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    lengths = torch.tensor([1, 15, 16, 17, 100, 250, 33, 256, 257, 600, 768])
    tables = torch.stack([torch.randperm(num_blocks)[:48] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim)
    layer = cache[:, 1]
    expected = decode_attention(q, layer, tables, lengths, head_dim**-0.5)
    got = cpu_attention.paged_decode_attention(q, layer, tables, lengths, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_cpu_decode_kernel_gives_a_sequence_the_same_result_in_any_batch():
    from kernels import cpu_attention

    if cpu_attention.load() is None:
        pytest.skip(f"no C++ toolchain here: {cpu_attention.build_error()}")
    torch.manual_seed(8)
    cache = torch.randn(64, 1, 2, 16, 2, 32)[:, 0]
    lengths = torch.tensor([700, 3, 300, 40])
    tables = torch.stack([torch.randperm(64)[:48] for _ in lengths])
    q = torch.randn(len(lengths), 4, 32)
    together = cpu_attention.paged_decode_attention(q, cache, tables, lengths, 0.2)
    for row in range(len(lengths)):
        alone = cpu_attention.paged_decode_attention(q[row : row + 1], cache, tables[row : row + 1],
                                                     lengths[row : row + 1], 0.2)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 37, 64, 128, 129])
def test_cpu_linear_matches_torch(rows):
    """The C++ small-batch linear against F.linear: every register tile (1-4 input
    rows), an odd number of weight rows, K not a multiple of 8, with and without
    bias, and inputs above MAX_ROWS (handed to torch)."""
    from kernels import cpu_linear

    if cpu_linear.load() is None:
        pytest.skip(f"no C++ toolchain or no AVX2 here: {cpu_linear.build_error()}")
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 100), torch.randn(77, 100), torch.randn(77)
    torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    leading = x.view(rows, 1, 100)  # any leading dimensions, as F.linear takes
    torch.testing.assert_close(cpu_linear.linear(leading, weight), F.linear(leading, weight), atol=1e-4, rtol=1e-5)
    strided = torch.randn(100, 77).t()  # not one contiguous block: handed to torch
    torch.testing.assert_close(cpu_linear.linear(x, strided), F.linear(x, strided), atol=1e-4, rtol=1e-5)


def test_cpu_linear_gives_a_row_the_same_result_in_any_batch():
    from kernels import cpu_linear

    if cpu_linear.load() is None:
        pytest.skip(f"no C++ toolchain or no AVX2 here: {cpu_linear.build_error()}")
    torch.manual_seed(3)
    x, weight = torch.randn(23, 768), torch.randn(300, 768)
    together = cpu_linear.linear(x, weight)
    for row in (0, 5, 22):
        assert torch.equal(cpu_linear.linear(x[row : row + 1], weight)[0], together[row])


def test_backend_selection():
    from kernels.attention import select_decode_attention, select_prefill_attention
    from kernels.blocks import TORCH_BLOCK_COPY, select_block_copy

    assert select_decode_attention("torch", torch.device("cpu"), torch.float32) is decode_attention
    assert select_decode_attention("auto", torch.device("cpu"), torch.bfloat16) is decode_attention
    for backend in ("auto", "torch"):  # CPU: the references, whatever the backend
        assert select_prefill_attention(backend, torch.device("cpu")) is prefill_attention
        assert select_block_copy(backend, torch.device("cpu")) is TORCH_BLOCK_COPY
    assert select_prefill_attention("torch", torch.device("cuda")) is prefill_attention
    assert select_block_copy("torch", torch.device("cuda")) is TORCH_BLOCK_COPY
    with pytest.raises(ValueError, match="kernel_backend"):
        select_decode_attention("fast", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="kernel_backend"):
        select_prefill_attention("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel_backend"):
        select_block_copy("fast", torch.device("cpu"))


def test_block_copies_are_torch_indexing():
    from kernels.blocks import gather_blocks, scatter_blocks

    cache = torch.randn(6, NUM_LAYERS, 2, 4, KV_HEADS, HEAD_DIM)
    block_ids = torch.tensor([5, 0, 3])
    blocks = gather_blocks(cache, block_ids)
    assert blocks.is_contiguous() and torch.equal(blocks[1], cache[0]) and torch.equal(blocks[0], cache[5])
    target = torch.zeros_like(cache)
    scatter_blocks(target, torch.tensor([1, 2, 4]), blocks)
    assert torch.equal(target[[1, 2, 4]], blocks) and target[[0, 3, 5]].abs().sum() == 0


def test_linear_norm_and_rope_backend_selection():
    from kernels.linear import select_linear
    from kernels.norm import rms_norm, select_rms_norm
    from kernels.rope import apply_rope, select_apply_rope

    import importlib.util

    has_triton = importlib.util.find_spec("triton") is not None
    for select, reference in ((select_linear, F.linear), (select_rms_norm, rms_norm), (select_apply_rope, apply_rope)):
        assert select("torch", torch.device("cpu"), torch.float32) is reference
        assert select("torch", torch.device("cuda"), torch.float32) is reference
        assert select("auto", torch.device("cpu"), torch.bfloat16) is reference
        on_cuda_triton = has_triton and select is not select_linear  # cuBLAS stays for linear layers
        assert (select("auto", torch.device("cuda"), torch.float32) is reference) is not on_cuda_triton
        with pytest.raises(ValueError, match="kernel_backend"):
            select("fast", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_cpu_norm_and_rope_match_the_references(rows):
    """The C++ RMSNorm and RoPE against kernels.norm / kernels.rope, RoPE on strided
    views of a fused QKV output as the model passes them."""
    from kernels import cpu_norm_rope
    from kernels.norm import rms_norm
    from kernels.rope import apply_rope

    if cpu_norm_rope.load() is None:
        pytest.skip(f"no C++ toolchain here: {cpu_norm_rope.build_error()}")
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 96) * 3, torch.randn(96)
    torch.testing.assert_close(cpu_norm_rope.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    qkv = torch.randn(rows, 6 * 32 + 2 * 2 * 32)
    q, k, _ = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)
    angles = torch.rand(rows, 16) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    heads_apart = torch.randn(rows, 32, 6).transpose(1, 2)  # a layout the kernel hands to the reference
    for x in (q.view(rows, 6, 32), k.view(rows, 2, 32), heads_apart):
        torch.testing.assert_close(cpu_norm_rope.apply_rope(x, cos, sin), apply_rope(x, cos, sin))


def test_a_seeded_rows_token_is_its_own_whatever_shares_the_batch_when_probabilities_tie():
    """bf16 logits read in float32 tie often (a GPU's); the CDF was inverted in the
    order a sort gives ties, and a batch mate's top_k or top_p set the sort (a topk
    of 40, of 2000, a full one): the token changed in 82 of 200 seeds. Now the kept
    set holds every tie of the k-th, and the draw is inverted in vocabulary order."""
    torch.manual_seed(5)
    vocab = 8000
    logits = (torch.randn(1, vocab) * 3).bfloat16().float()
    assert logits.unique().numel() < vocab // 4, "(ties: the case under test)"
    mates = {"alone": ([], [], []), "with a top_k of 2000": ([1.0], [2000], [1.0]),
             "with a top_p-only row": ([1.0], [0], [0.9])}
    for top_k, top_p in ((40, 1.0), (40, 0.8), (0, 0.05)):
        for seed in range(100):
            tokens = set()
            for temps, ks, ps in mates.values():
                batch = torch.cat([logits] + [logits.roll(7, dims=1)] * len(temps))
                draws = uniform_draws([seed] + [seed + 1] * len(temps), [0] * (1 + len(temps)))
                tokens.add(int(sample(batch, [1.0, *temps], [top_k, *ks], [top_p, *ps], draws)[0]))
            reference = reference_sample(logits, [1.0], [top_k], [top_p], uniform_draws([seed], [0]))
            assert tokens == {int(reference[0])}, (top_k, top_p, seed, tokens)


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does():
    """top_k 1 with two tokens tied for the best: transformers and vLLM keep both
    (they drop only those below the k-th); one was kept, whichever a sort put first."""
    logits = torch.zeros(1, 1000)
    logits[0, 5] = logits[0, 900] = 10.0
    picks = [int(sample(logits, [1.0], [1], [1.0], uniform_draws([0], [i]))[0]) for i in range(400)]
    assert set(picks) == {5, 900} and 150 < picks.count(5) < 250
