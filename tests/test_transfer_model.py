"""The P-D transfer model admission learns from P's chunk timings (no Ray)."""

from __future__ import annotations

import pytest

from actors.messages import ChunkTiming
from cluster.admission import InFlight, WorkerModels
from cluster.cost_model import prefill_features
from cluster.transfer_model import PRIOR_BYTES_PER_S, TransferModels


def chunk(num_blocks: int, seconds: float, at: float = 100.0) -> ChunkTiming:
    return ChunkTiming(0, num_blocks, compute_done_s=at, send_start_s=at, arrived_s=at + 1e3,  # D's clock: not used
                       acknowledged_s=at + seconds)


def test_a_pair_learns_a_fixed_cost_and_a_cost_per_block():
    models = TransferModels(block_size=16, prefill_chunk_size=256)
    models.observe("p0", "d0", [chunk(n, 0.004 + 0.0005 * n) for n in (1, 2, 4, 8, 16, 17)])
    assert models.chunk_s("p0", "d0", 10) == pytest.approx(0.004 + 0.005, rel=1e-6)
    assert models.chunk_s("p0", "d0", 100) == pytest.approx(0.004 + 0.05, rel=1e-6)


def test_chunks_of_one_size_put_their_time_in_the_fixed_cost():
    """Every chunk seen held 2 blocks: a chunk of 40 costs about as much, not 20 times
    as much (the slope is not seen, so it is not made up)."""
    models = TransferModels(block_size=16, prefill_chunk_size=256)
    models.observe("p0", "d0", [chunk(2, 0.01)] * 8)
    assert models.chunk_s("p0", "d0", 2) == pytest.approx(0.01, rel=1e-3)
    assert models.chunk_s("p0", "d0", 40) == pytest.approx(0.01, rel=1e-3)


def test_a_new_pair_borrows_from_its_p_then_its_d_then_takes_the_prior():
    models = TransferModels(block_size=16, prefill_chunk_size=256)
    models.block_bytes = 1_000_000
    assert models.chunk_s("p0", "d0", 3) == pytest.approx(3e6 / PRIOR_BYTES_PER_S)
    models.observe("p0", "d0", [chunk(2, 0.01)])
    models.observe("p1", "d1", [chunk(2, 0.05)])
    assert models.chunk_s("p0", "d9", 2) == pytest.approx(0.01)  # P's sender, to a D it has not sent to yet
    assert models.chunk_s("p9", "d1", 2) == pytest.approx(0.05)  # a new P, to a D that others sent to
    models.forget("d0")
    assert models.chunk_s("p0", "d9", 3) == pytest.approx(3e6 / PRIOR_BYTES_PER_S)


def test_a_requests_transfer_is_its_last_chunk():
    """600 uncached tokens in chunks of 256: the last computes 88 tokens, whose 6
    blocks and the one a chunk boundary splits go after it; never more blocks than D
    lacks."""
    models = TransferModels(block_size=16, prefill_chunk_size=256)
    models.observe("p0", "d0", [chunk(n, 0.001 * n) for n in (1, 2, 4, 8)])
    assert models.last_chunk_s("p0", "d0", num_uncached_tokens=600, num_blocks_to_send=38) == pytest.approx(0.007)
    assert models.last_chunk_s("p0", "d0", num_uncached_tokens=600, num_blocks_to_send=3) == pytest.approx(0.003)
    assert models.last_chunk_s("p0", "d0", num_uncached_tokens=20, num_blocks_to_send=2) == pytest.approx(0.002)


def test_a_burst_waits_for_the_chunks_ahead_of_it():
    """P's chunks to a D go one at a time: with 20 ms a chunk learned, the 16th of
    a burst of short prompts admitted back to back is predicted 16 prefills and 16
    chunks after the burst began. With the 1 GB/s prior a chunk was free, and the
    spread of a burst's first tokens was put in the learned bias instead."""
    models = WorkerModels(block_size=16)
    for new in (16, 64, 256):
        models.prefill_model("p0").observe(prefill_features(new, 0), 0.001 * new)
    models.transfers.observe("p0", "d0", [chunk(2, 0.02)] * 4)
    for index in range(16):
        prediction = models.predict("p0", "d0", num_prompt_tokens=20, cached_tokens=0)
        models.inflight[f"r{index}"] = InFlight(f"r{index}", "p0", "d0", 20, 10, prediction.ttft_s)
    assert prediction.ttft_s == pytest.approx(16 * (0.02 + 0.02), abs=0.05)
