"""The Triton kernels against the torch reference, on CPU under Triton's interpreter
(fresh random inputs each run; small shapes, so CI stays fast).

Run by `tests/test_triton_kernels.py` in a process of its own: Triton reads
TRITON_INTERPRET when it is first imported (its own library functions included),
so the variable must be set before anything imports Triton.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.attention import decode_attention, write_kv_slots  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def triton_attention():
    import kernels.triton_attention as module

    return module


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    # A layer's view of a block-major cache with 2 layers: non-contiguous across blocks.
    full = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    return full[:, 1]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype",
    [(4, 2, 16, 16, torch.float32), (14, 2, 64, 16, torch.float32), (8, 8, 32, 32, torch.float32),
     (14, 2, 64, 16, torch.float16)],
    ids=["gqa2", "qwen2.5-0.5b-shape", "mha-bs32", "fp16"],
)
def test_paged_decode_matches_the_reference(triton_attention, num_heads, num_kv_heads, head_dim, block_size, dtype):
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    lengths = [1, block_size, block_size + 1, 3 * block_size - 5, 70]
    max_blocks = max(-(-n // block_size) for n in lengths)
    cache = _cache(64, block_size, num_kv_heads, head_dim, dtype)
    tables = torch.stack([torch.randperm(64, generator=generator)[:max_blocks] for _ in lengths])
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    context_lens = torch.tensor(lengths)
    scale = head_dim ** -0.5
    got = triton_attention.paged_decode_attention(q, cache, tables, context_lens, scale)
    want = decode_attention(q.float(), cache.float(), tables, context_lens, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_unsupported_shapes_are_reported(triton_attention):
    assert triton_attention.supports_decode(14, 2, 64, 16)
    assert not triton_attention.supports_decode(14, 2, 80, 16)  # head_dim not a power of two
    assert not triton_attention.supports_decode(4, 2, 64, 8)  # block smaller than tl.dot's minimum
    assert not triton_attention.supports_decode(6, 4, 64, 16)  # heads not a multiple of KV heads


def test_slot_writes_match_the_reference(triton_attention):
    num_blocks, block_size, num_kv_heads, head_dim = 16, 16, 2, 32
    cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size)[:37]
    k, v = torch.randn(37, num_kv_heads, head_dim), torch.randn(37, num_kv_heads, head_dim)
    triton_attention.write_kv_slots(cache, k, v, slots)
    write_kv_slots(expected, k, v, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
