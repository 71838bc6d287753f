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

from kernels.attention import decode_attention, prefill_attention, write_kv_slots  # noqa: E402
from kernels.blocks import gather_blocks, scatter_blocks  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def triton_attention():
    import kernels.triton_attention as module

    return module


@pytest.fixture(scope="module")
def triton_prefill():
    import kernels.triton_prefill as module

    return module


@pytest.fixture(scope="module")
def triton_blocks():
    import kernels.triton_blocks as module

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


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (14, 2, 32)], ids=["gqa2", "gqa7"])
def test_split_decode_matches_the_reference(triton_attention, num_heads, num_kv_heads, head_dim):
    """Split-K: sequences longer than MIN_SPLIT_KEYS read by several programs (some
    splits left with no keys at head_dim 16, whose tile is 256 keys) and combined;
    those that fit one split come out bit for bit as they do unsplit."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    block_size, lengths = 16, [1, 100, 129, 300, 700]
    max_blocks = max(-(-n // block_size) for n in lengths)
    cache = _cache(sum(-(-n // block_size) for n in lengths) + 4, block_size, num_kv_heads, head_dim, torch.float32)
    tables = torch.stack([torch.randperm(cache.shape[0], generator=generator)[:max_blocks] for _ in lengths])
    q = 3 * torch.randn(len(lengths), num_heads, head_dim, generator=generator)  # peaked softmax: maxes matter
    context_lens = torch.tensor(lengths)
    want = decode_attention(q, cache, tables, context_lens, head_dim ** -0.5)
    unsplit = triton_attention.paged_decode_attention(q, cache, tables, context_lens, head_dim ** -0.5, splits=1)
    for splits in (2, 8, 64):
        got = triton_attention.paged_decode_attention(q, cache, tables, context_lens, head_dim ** -0.5, splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[:2], unsplit[:2]), splits  # 1 and 100 keys: one program either way


def test_splits_fill_the_gpu_once_and_never_exceed_the_cap(triton_attention):
    """132 SMs (an H200; the stand-in off a GPU): Qwen2.5-0.5B's 2 KV heads. At
    least four programs a sequence are allowed, but once the batch fills half the SMs
    only sequences of 256 keys a split are split."""
    splits = lambda batch, kv_heads: triton_attention.num_splits(batch, kv_heads, "cpu")  # noqa: E731
    keys = lambda batch, kv_heads: triton_attention.split_keys(batch, kv_heads, "cpu")  # noqa: E731
    assert splits(1, 2) == triton_attention.MAX_SPLITS == 64
    assert [splits(b, 2) for b in (8, 16, 32, 33, 64, 256)] == [8, 4, 4, 4, 4, 4]
    assert [keys(b, 2) for b in (8, 16, 32, 33, 34, 64, 256)] == [128] * 4 + [256] * 3
    assert splits(16, 8) == 4 and keys(16, 8) == 256


def test_split_programs_merge_in_the_launch_and_leave_their_counts_at_zero(triton_attention):
    """The last split program of a (sequence, KV head) merges the partials: with
    every length split (down to one tile a split, some splits left with none) the
    output is the reference's; the arrival counts are all zero after the launch,
    so the next launch, the same one again, gives the same output bit for bit."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_heads, num_kv_heads, head_dim, block_size, lengths = 14, 2, 32, 16, [17, 64, 300, 1000]
    max_blocks = max(-(-n // block_size) for n in lengths)
    cache = _cache(len(lengths) * max_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    tables = torch.randperm(cache.shape[0], generator=generator).view(len(lengths), max_blocks)
    q = 3 * torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    context_lens = torch.tensor(lengths)
    want = decode_attention(q, cache, tables, context_lens, head_dim ** -0.5)
    for splits, keys in ((4, 16), (16, 16), (8, 256)):
        call = lambda: triton_attention.paged_decode_attention(  # noqa: E731
            q, cache, tables, context_lens, head_dim ** -0.5, splits=splits, min_split_keys=keys, tile=16)
        first = call()
        assert not triton_attention._arrival_counts(torch.device("cpu")).any()
        torch.testing.assert_close(first, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(call(), first), (splits, keys)


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


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, num_cached, q_len, dtype",
    [(4, 2, 16, 16, 0, 5, torch.float32), (4, 2, 16, 16, 21, 13, torch.float32),
     (14, 2, 32, 16, 37, 20, torch.float32), (8, 8, 16, 32, 32, 17, torch.float32),
     (6, 2, 16, 16, 16, 16, torch.float32), (14, 2, 32, 16, 37, 20, torch.float16),
     (14, 2, 64, 16, 150, 20, torch.float32)],
    ids=["no-prefix-gqa2", "prefix-gqa2", "prefix-gqa7", "mha-bs32-aligned-prefix", "block-aligned-gqa3",
         "fp16-gqa7", "three-tiles-gqa7"],
)
def test_paged_prefill_matches_the_reference(triton_prefill, num_heads, num_kv_heads, head_dim, block_size,
                                             num_cached, q_len, dtype):
    """One chunk over a cached prefix in scattered blocks of a non-contiguous layer
    view. bfloat16 is not checked here: the interpreter's tl.dot gets it wrong (the
    decode kernel too); the GPU check covers it."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    ctx_len = num_cached + q_len
    num_blocks = 16
    cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    table = torch.randperm(num_blocks, generator=generator)[: -(-ctx_len // block_size)]
    k = torch.randn(ctx_len, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(ctx_len, num_kv_heads, head_dim, generator=generator).to(dtype)
    positions = torch.arange(ctx_len)
    write_kv_slots(cache, k, v, table[positions // block_size] * block_size + positions % block_size)
    q = torch.randn(q_len, num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    got = triton_prefill.paged_prefill_attention(q, k[num_cached:], v[num_cached:], cache, table, ctx_len, scale)
    want = prefill_attention(q.float(), k[num_cached:].float(), v[num_cached:].float(), cache.float(), table,
                             ctx_len, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_prefill_takes_the_decode_kernels_shapes(triton_prefill):
    assert triton_prefill.supports_prefill(14, 2, 64, 16)
    assert not triton_prefill.supports_prefill(14, 2, 80, 16)
    assert not triton_prefill.supports_prefill(4, 2, 64, 8)
    assert not triton_prefill.supports_prefill(6, 4, 64, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole_cache", [True, False], ids=["all-layers", "layer-view"])
def test_block_gather_and_scatter_match_torch_indexing(triton_blocks, dtype, whole_cache):
    full = torch.randn(12, 3, 2, 16, 2, 16).to(dtype)  # [blocks, layers, K/V, block_size, kvh, d]
    cache = full if whole_cache else full[:, 1]
    block_ids = torch.randperm(12)[:5]
    got = triton_blocks.gather_blocks(cache, block_ids)
    assert got.is_contiguous() and torch.equal(got, gather_blocks(cache, block_ids))

    blocks = torch.randn(5, *cache.shape[1:]).to(dtype)
    expected = full.clone()
    scatter_blocks(expected if whole_cache else expected[:, 1], block_ids, blocks)
    triton_blocks.scatter_blocks(cache, block_ids, blocks)
    assert torch.equal(full, expected)  # the listed blocks written, nothing else touched


def test_block_copies_of_no_blocks_and_unsupported_tensors(triton_blocks):
    cache = torch.randn(4, 2, 16, 2, 16)
    none = torch.tensor([], dtype=torch.long)
    assert triton_blocks.gather_blocks(cache, none).shape == (0, 2, 16, 2, 16)
    triton_blocks.scatter_blocks(cache, none, torch.empty(0, 2, 16, 2, 16))
    assert not triton_blocks.supports_blocks(cache[:, :, :8])  # a block that is not one span
    assert not triton_blocks.supports_blocks(cache, torch.randn(2, 2, 16, 2, 16).half())
    assert not triton_blocks.supports_blocks(cache, torch.randn(2, 16, 2, 2, 16).transpose(1, 2))


# ---- elementwise: RMSNorm, RoPE, SiLU-and-multiply ---------------------------------
@pytest.fixture(scope="module")
def triton_elementwise():
    import kernels.triton_elementwise as module

    return module


_HALF_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 896, 100])
def test_rms_norm_matches_the_reference(triton_elementwise, dtype, hidden):
    from kernels.norm import rms_norm

    x = (torch.randn(7, hidden) * 3).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    tolerance = _HALF_TOLERANCE[dtype]
    got = triton_elementwise.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), rms_norm(x, weight, 1e-6).float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [896, 100])
def test_add_rms_norm_matches_the_reference(triton_elementwise, dtype, hidden):
    """The residual add fused into RMSNorm: the sum exactly `x + residual` in the
    model's dtype (in bfloat16 within one unit in the last place: the interpreter
    casts float32 to bfloat16 by truncating, a GPU rounds to nearest like torch),
    the norm as the reference's over that sum."""
    from kernels.norm import add_rms_norm

    x, residual = (torch.randn(7, hidden) * 3).to(dtype), (torch.randn(7, hidden) * 5).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    normed, summed = triton_elementwise.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_sum = add_rms_norm(x, residual, weight, 1e-6)
    assert normed.dtype == summed.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(summed.float(), expected_sum.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(summed, expected_sum)
    tolerance = _HALF_TOLERANCE[dtype]
    torch.testing.assert_close(normed.float(), expected_normed.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_matches_the_reference_on_a_strided_view(triton_elementwise, dtype):
    """q and k as the model has them: views into the fused QKV projection's rows."""
    from kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

    num_tokens, num_heads, num_kv_heads, head_dim = 9, 6, 2, 32  # 6 heads: a padded tile
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos_table, sin_table = rope_cos_sin(rope_inv_freq(head_dim, 10000.0), 64)
    positions = torch.randint(0, 64, (num_tokens,))
    cos, sin = cos_table[positions], sin_table[positions]
    tolerance = _HALF_TOLERANCE[dtype]
    for x, heads in ((q, num_heads), (k, num_kv_heads)):
        x = x.view(num_tokens, heads, head_dim)
        got = triton_elementwise.apply_rope(x, cos, sin)
        torch.testing.assert_close(got.float(), apply_rope(x, cos, sin).float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (14, 2), (4, 4)], ids=["gqa3", "gqa7", "mha"])
def test_rope_and_kv_write_in_one_kernel_match_the_two_in_turn(triton_elementwise, dtype, num_heads, num_kv_heads):
    """q's and k's heads rotated in one new tensor, k's rotated heads and v at the
    tokens' slots of a layer's view of the cache (the rest of the cache untouched),
    as `kernels.rope_cache.rope_and_write_kv` (torch's RoPE, then torch indexing)."""
    from kernels.rope import rope_cos_sin, rope_inv_freq
    from kernels.rope_cache import rope_and_write_kv

    num_tokens, head_dim, block_size = 9, 32, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    cos_table, sin_table = rope_cos_sin(rope_inv_freq(head_dim, 10000.0), 64)
    positions = torch.randint(0, 64, (num_tokens,))
    cos, sin = cos_table[positions], sin_table[positions]
    cache = _cache(6, block_size, num_kv_heads, head_dim, dtype)
    expected_cache = cache.clone()
    slots = torch.randperm(6 * block_size)[:num_tokens]
    got = triton_elementwise.rope_and_write_kv(qk, v, cos, sin, cache, slots)
    want = rope_and_write_kv(qk, v, cos, sin, expected_cache, slots)
    tolerance = _HALF_TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache.float(), expected_cache.float(), atol=tolerance, rtol=tolerance)
    written = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(cache.shape[0], block_size)
    assert torch.equal(cache.transpose(1, 2)[untouched], expected_cache.transpose(1, 2)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [352, 4864, 5])
def test_silu_and_mul_matches_the_reference(triton_elementwise, dtype, size):
    from kernels.activation import silu_and_mul

    x = (torch.randn(6, 2 * size) * 4).to(dtype)
    tolerance = _HALF_TOLERANCE[dtype]
    got = triton_elementwise.silu_and_mul(x)
    assert got.shape == (6, size) and got.dtype == dtype
    torch.testing.assert_close(got.float(), silu_and_mul(x).float(), atol=tolerance, rtol=tolerance)
