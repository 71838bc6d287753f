"""Paged decode attention and KV slot writes in Triton: the GPU path.

Same layouts and contracts as the torch reference in `kernels/attention.py`:

    layer_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]  (K at 0, V at 1)
    slot = block_id * block_size + offset

`paged_decode_attention` gives each (sequence, KV head) one program, or several
when the batch is too small to fill the GPU (split-K, "flash decoding"). A program
loads the query heads that share its KV head (grouped-query attention: K and V are
read once per group, never copied per query head) and walks its share of the
sequence's keys a tile of `TILE` keys at a time (several cache blocks: each key's
block is looked up in the block table), with an online softmax (running max and
sum), so no score matrix over the whole context is ever materialised. Scores and the
output accumulate in float32; with a float32 cache the dot products use IEEE
precision (no TF32), so float32 results track the reference closely.

Why splits: one program per (sequence, KV head) is 2 programs for Qwen2.5-0.5B at
batch 1, on a GPU of 132 SMs; a 4k-token context is then read by 2 SMs, a few
percent of the memory bandwidth, and attention, not the weights, sets the step
time. So `num_splits(batch, num_kv_heads)` allows up to `SMs // (batch * KV heads)`
programs per (sequence, KV head) (a power of two, at most `MAX_SPLITS`), and at
least `FULL_GRID_SPLITS`: one program per SM still reads a long context slowly, a
tile at a time (on the H200, batch 64 x 1056 tokens took 16.1 us unsplit and 13.6
split four ways, the merge a kernel of its own then). Each sequence uses
`min(allowed, ceil(length / split_keys))` of them, from its own length:
`split_keys` is MIN_SPLIT_KEYS while the batch leaves SMs idle and
FULL_GRID_SPLIT_KEYS once its (sequence, KV head) pairs fill half of them, so
short sequences are never split, and at a large batch only long ones are. Split
programs write their running max, sum and unnormalised output; the last of a
sequence's programs to finish (a count per (sequence, KV head), taken with an
atomic add) rescales them to a common max and adds them up (the log-sum-exp merge
of flash decoding, as vLLM's paged attention v2 and SGLang's Triton decode backend
merge, but in the same kernel: no second launch, so a batch whose sequences are all
short pays for the allowance only with the programs that find no keys and exit).
The counts live in one zeroed buffer per device (`_arrival_counts`) that the merging
program sets back to zero, so it stays zeroed between launches, CUDA-graph replays
included; launches on one device must not overlap (the engine launches its layers
on one stream). A sequence read by one program gets its output from it directly,
bit for bit what it gets in any batch where it is read by one program; one that is
split depends on how many programs read it (a different float32 summation order,
not a different result beyond rounding). The grid depends only on the batch size,
so the CUDA-graph decode step (captured per batch size) replays it for any lengths.

`write_kv_slots` runs one program per (token, KV head) and stores that head's K and
V row at the token's slot.

Prefill attention is in `kernels/triton_prefill.py`, block copies for transfers in
`kernels/triton_blocks.py`. Measured on an H200 (forty-fifth session, bf16,
qwen2.5-0.5b's attention; docs/benchmarks.md, GPU check): at batch 64 the decode
kernel reads KV at about 1 TB/s over 160-token contexts and 2 TB/s over 1056 (the
split rule leaves batch 64 unsplit; 4 splits took 15% less time at 1056 tokens
but add the combine kernel's launch to every step, short contexts too); it is
about a sixth of a decode step's device time at 160 tokens.

This module imports Triton at import time: import it only where Triton is
installed (the `gpu` extra). `supports_decode` says which shapes the kernel takes
(power-of-two head_dim and block_size of at least 16); `kernels.attention`'s
dispatcher falls back to the reference for the rest. On CPU the kernels run under
Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported),
which is how the tests check them against the reference without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_MIN_DOT = 16  # tl.dot's smallest dimension
MAX_SPLITS = 64  # programs per (sequence, KV head) at most
FULL_GRID_SPLITS = 4  # ... and at least (the H200's best at batch 64 x 1056 tokens; see num_splits)
MIN_SPLIT_KEYS = 128  # a sequence is split only into shares of at least this many keys
FULL_GRID_SPLIT_KEYS = 256  # ... of at least this many when the batch alone fills half the SMs
_MAX_ARRIVAL_COUNTS = 1 << 16  # (sequence, KV head) pairs a launch may have: the counts buffer's size
_TILE_BYTES = 8192  # K (or V) bytes of one KV head a step of the prefill walk reads, at 2 bytes an element
# The decode walk's: twice that. Measured on an H200 (benchmarks/gpu_decode_sweep.py,
# bf16, qwen2.5-0.5b's attention in the engine's cache layout), 128 keys a step
# against 64: 16.1 us against 24.9 at batch 64 x 1056 tokens, 5.05 against 5.72 at
# 64 x 160, 10.8 against 13.9 at 8 x 4096 (8 splits); 8 warps instead of 4 was
# slower at every shape.
_DECODE_TILE_BYTES = 16384
_STAND_IN_SMS = 132  # an H200's SM count, for splitting tensors that are not on a GPU (the interpreter)


def supports_decode(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return num_heads % num_kv_heads == 0 and pow2(head_dim) and head_dim >= _MIN_DOT and pow2(block_size) \
        and block_size >= _MIN_DOT


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _STAND_IN_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, num_kv_heads: int, device: torch.device | str = "cuda") -> int:
    """Programs allowed per (sequence, KV head): as many as fill the GPU's SMs once,
    rounded down to a power of two, between FULL_GRID_SPLITS and MAX_SPLITS."""
    return max(FULL_GRID_SPLITS, _sm_filling_splits(batch, num_kv_heads, device))


def split_keys(batch: int, num_kv_heads: int, device: torch.device | str = "cuda") -> int:
    """The fewest keys a split of a sequence reads: MIN_SPLIT_KEYS while the batch's
    (sequence, KV head) pairs leave more than half the SMs idle, FULL_GRID_SPLIT_KEYS
    once they do not (at batch 64 x 160 tokens, splitting in two took the H200 36%
    longer, the merge a second kernel then)."""
    return MIN_SPLIT_KEYS if _sm_filling_splits(batch, num_kv_heads, device) > 1 else FULL_GRID_SPLIT_KEYS


def _sm_filling_splits(batch: int, num_kv_heads: int, device: torch.device | str) -> int:
    per_sequence = _multiprocessor_count(torch.device(device)) // max(1, batch * num_kv_heads)
    return min(MAX_SPLITS, 1 << max(0, per_sequence.bit_length() - 1))


@functools.lru_cache(maxsize=None)
def _arrival_counts(device: torch.device) -> torch.Tensor:
    """The split programs of each (sequence, KV head) that have finished, this launch:
    zeros between launches (the merging program resets its count). Made on first use,
    before any CUDA graph is captured (the engine runs its steps eagerly first)."""
    return torch.zeros(_MAX_ARRIVAL_COUNTS, dtype=torch.int32, device=device)


def tile_keys(head_dim: int, tile_bytes: int = _TILE_BYTES) -> int:
    """Keys a step of the prefill walk reads: 64 at head_dim 64, 32 at 128 (the
    decode walk, `tile_bytes=_DECODE_TILE_BYTES`: 128 and 64)."""
    return max(_MIN_DOT, tile_bytes // (2 * head_dim))


@triton.jit
def online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION: tl.constexpr):
    """Fold one tile of keys into a running softmax-weighted sum: scores [M, N]
    float32 (-inf where masked), v [N, HEAD_DIM]; returns the new running max, sum
    and acc [M, HEAD_DIM] (acc and sum rescaled to the new max)."""
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    probs = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(running_max - new_max)
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _splits_used(context_len, SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """How many programs read a sequence of `context_len` keys: by its own length,
    at most what the batch allows."""
    return tl.minimum(SPLITS, tl.cdiv(context_len, SPLIT_KEYS))


@triton.jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, arrivals_ptr,
    scale, num_heads, num_kv_heads,
    stride_qb, stride_qh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    splits_used = _splits_used(context_len, SPLITS, SPLIT_KEYS)
    if split < splits_used:
        # This program's share: whole tiles, split after split (the last ones may get none).
        tiles_per_split = tl.cdiv(tl.cdiv(context_len, TILE), splits_used)
        start = split * tiles_per_split * TILE
        end = tl.minimum(context_len, start + tiles_per_split * TILE)
        group = tl.arange(0, PADDED_GROUP)
        in_group = group < GROUP
        heads = kv_head * GROUP + group
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=in_group[:, None],
                    other=0.0)
        q = (q.to(tl.float32) * scale).to(q.dtype)
        running_max = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
        running_sum = tl.zeros([PADDED_GROUP], tl.float32)
        acc = tl.zeros([PADDED_GROUP, HEAD_DIM], tl.float32)
        for tile_start in range(start, end, TILE):
            keys = tile_start + tl.arange(0, TILE)
            valid = keys < end
            blocks = tl.load(tables_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=valid, other=0)
            rows = (cache_ptr + blocks[:, None] * stride_cb + (keys % BLOCK_SIZE)[:, None] * stride_cs
                    + kv_head * stride_ch + dims[None, :])
            k = tl.load(rows, mask=valid[:, None], other=0.0)
            v = tl.load(rows + stride_ckv, mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [G, TILE], float32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            running_max, running_sum, acc = online_softmax_step(scores, v, running_max, running_sum, acc,
                                                                PRECISION)
        outputs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        if splits_used == 1:
            tl.store(outputs, (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=in_group[:, None])
        else:
            # Partials are [batch, heads, SPLITS(, HEAD_DIM)], contiguous, float32.
            slots = (seq * num_heads + heads) * SPLITS
            tl.store(split_max_ptr + slots + split, running_max, mask=in_group)
            tl.store(split_sum_ptr + slots + split, running_sum, mask=in_group)
            tl.store(split_acc_ptr + (slots + split)[:, None] * HEAD_DIM + dims[None, :], acc, mask=in_group[:, None])
            # Count this program in, after all its threads' stores (the barrier; the
            # count's release orders them before it): the program that counts last
            # sees every partial (the count's acquire) and merges them.
            tl.debug_barrier()
            count = arrivals_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == splits_used - 1:
                tl.store(count, 0)
                _merge_splits(outputs, split_acc_ptr, split_max_ptr, split_sum_ptr, slots, splits_used, in_group,
                              dims, PADDED_GROUP, HEAD_DIM)


@triton.jit
def _merge_splits(outputs, split_acc_ptr, split_max_ptr, split_sum_ptr, slots, splits_used, in_group, dims,
                  PADDED_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The group's outputs from its splits' partials: each rescaled to the common
    max and summed. A split that got no keys holds max -inf and weighs 0. Loads
    bypass L1 (`.cg`): the partials were written by other SMs, and this SM may
    hold an earlier launch's lines of them. (The pointers are the output's, of its
    dtype, in a launch that allows one split a sequence; this is never reached then,
    but it is compiled, hence the casts.)"""
    maxes = split_max_ptr + slots
    common_max = tl.load(maxes, mask=in_group, other=0.0, cache_modifier=".cg").to(tl.float32)
    for split in range(1, splits_used):
        common_max = tl.maximum(common_max, tl.load(maxes + split, mask=in_group, other=0.0, cache_modifier=".cg"))
    total = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, HEAD_DIM], tl.float32)
    for split in range(0, splits_used):
        weight = tl.exp(tl.load(maxes + split, mask=in_group, other=0.0, cache_modifier=".cg").to(tl.float32)
                        - common_max)
        total += weight * tl.load(split_sum_ptr + slots + split, mask=in_group, other=1.0, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(split_acc_ptr + (slots + split)[:, None] * HEAD_DIM + dims[None, :],
                                         mask=in_group[:, None], other=0.0, cache_modifier=".cg")
    tl.store(outputs, (acc / total[:, None]).to(outputs.dtype.element_ty), mask=in_group[:, None])


def paged_decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    splits: int | None = None, min_split_keys: int | None = None, tile: int | None = None, num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q: [B, H, d]; block_tables: [B, max_blocks] int; context_lens: [B] int, each
    >= 1. Returns [B, H, d] in q's dtype. Shapes must pass `supports_decode`.
    `splits`: programs allowed per (sequence, KV head), a power of two, and
    `min_split_keys`, the fewest keys a split reads; by default `num_splits` and
    `split_keys` for this batch on q's device. `tile` (keys a step of the walk
    reads, a power of two of at least 16; by default 16 KB of K), `num_warps` and
    `num_stages` (Triton's software pipelining of the walk's loads; by default
    Triton's) are for measuring other launch shapes."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    assert supports_decode(num_heads, num_kv_heads, head_dim, block_size), (q.shape, layer_cache.shape)
    assert layer_cache.stride(4) == 1 and q.stride(2) == 1, "head_dim must be contiguous"
    assert batch * num_kv_heads <= _MAX_ARRIVAL_COUNTS, (batch, num_kv_heads)
    splits = splits or num_splits(batch, num_kv_heads, q.device)
    assert splits & (splits - 1) == 0, splits
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    split_acc = split_max = split_sum = out  # one program per sequence: the kernel writes no partials
    if splits > 1:
        split_acc = torch.empty(batch, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
        split_max = torch.empty(batch, num_heads, splits, device=q.device, dtype=torch.float32)
        split_sum = torch.empty_like(split_max)
    launch = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, layer_cache, block_tables, context_lens, out, split_acc, split_max, split_sum, _arrival_counts(q.device),
        float(scale), num_heads, num_kv_heads,
        q.stride(0), q.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, PADDED_GROUP=max(_MIN_DOT, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, TILE=tile or tile_keys(head_dim, _DECODE_TILE_BYTES), SPLITS=splits,
        SPLIT_KEYS=min_split_keys or split_keys(batch, num_kv_heads, q.device),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch,
    )
    return out


@triton.jit
def _write_slots_kernel(
    cache_ptr, k_ptr, v_ptr, slots_ptr,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_kn, stride_kh, stride_vn, stride_vh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    dims = tl.arange(0, HEAD_DIM)
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + dims
    k = tl.load(k_ptr + token * stride_kn + head * stride_kh + dims)
    v = tl.load(v_ptr + token * stride_vn + head * stride_vh + dims)
    tl.store(row, k.to(cache_ptr.dtype.element_ty))
    tl.store(row + stride_ckv, v.to(cache_ptr.dtype.element_ty))


def supports_write(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Power-of-two head_dim, each head's row contiguous in the cache and in k and v."""
    head_dim = k.shape[-1]
    return head_dim & (head_dim - 1) == 0 and layer_cache.stride(4) == 1 and k.stride(2) == 1 and v.stride(2) == 1


def write_kv_slots(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K and V of N tokens ([N, kvh, d] each) into their slots ([N] int). The layout
    must pass `supports_write`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert supports_write(layer_cache, k, v), "power-of-two head_dim, contiguous rows"
    if num_tokens == 0:
        return
    _write_slots_kernel[(num_tokens, num_kv_heads)](
        layer_cache, k, v, slot_mapping,
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BLOCK_SIZE=layer_cache.shape[2], HEAD_DIM=head_dim,
    )
