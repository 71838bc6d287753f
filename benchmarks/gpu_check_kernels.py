"""The GPU check's `kernels` step (`benchmarks/gpu_check.py`): every Triton kernel
against its torch reference and, on CUDA, each one's time beside torch's.

Errors, for a few shapes and dtypes (attention: max abs difference from the
reference computed in float32 from the same inputs; copies: bit-exact or not):
- decode attention over contexts of 1 to 1000 tokens;
- prefill attention of a chunk with no prefix and of one over a cached prefix,
  neither aligned to blocks;
- KV slot writes, block gather and block scatter against torch indexing;
- RMSNorm, RoPE (on q as a view of the fused QKV rows), RoPE with the KV cache
  write (`rope_and_write_kv`, one kernel) and SiLU-and-multiply against their
  torch references (max abs difference, in the input's dtype).

Times on CUDA (`cuda_time_ms`: CUDA-graph replays timed with CUDA events),
bfloat16, at qwen2.5-0.5b's attention shape (14 heads, 2 KV heads, head_dim 64,
blocks of 16), each beside what torch does in its place:
- decode at batch 64 x 1024-token contexts, 8 x 4096 and 1 x 8192: Triton as
  dispatched (split-K as `num_splits` and `split_keys` allow: where the batch leaves
  SMs idle, and long contexts at any batch), Triton unsplit, the torch reference;
  KV GB/s;
- prefill of a 2048-token prompt and of a 512-token chunk over 3584 cached tokens:
  Triton, the torch reference (gather + SDPA), and SDPA alone on K/V that are
  already contiguous (the reference without its gather); attention TFLOP/s;
- gather and scatter of 64 scattered blocks of a 24-layer cache: Triton, torch
  indexing; GB/s moved (read + write);
- RMSNorm, RoPE, RoPE with the KV write and SiLU-and-multiply at 64 and 4096
  tokens of qwen2.5-0.5b's sizes: Triton, the torch reference (and for the fused
  RoPE and KV write, the two Triton kernels it replaces, in turn).
These are the figures that decide, per path, whether the Triton kernel or torch
(SDPA, indexing) should run on a GPU. On CPU the kernels run under Triton's
interpreter on smaller inputs, one shape, and no times are taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import cuda_time_ms

_SHAPES = ((14, 2, 64, 16), (12, 4, 64, 16), (32, 8, 128, 32))  # heads, KV heads, head_dim, block_size


def check_kernels(device: str) -> dict:
    from kernels import triton_attention, triton_blocks, triton_elementwise, triton_prefill

    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16]
    # (on CPU, one shape: the plumbing; tests/test_triton_kernels.py checks the kernels' shapes under the interpreter)
    shapes = _SHAPES if device == "cuda" else _SHAPES[:1]
    decode = [_decode_error(triton_attention, device, shape, dtype) for shape in shapes for dtype in dtypes]
    num_cached = 1000 if device == "cuda" else 35
    q_len = 300 if device == "cuda" else 21
    prefill = [_prefill_error(triton_prefill, device, shape, dtype, cached, q_len)
               for shape in shapes for dtype in dtypes for cached in (0, num_cached)]
    result = {"decode": decode, "prefill": prefill, "slot_writes_exact": _slot_writes_exact(triton_attention, device),
              "block_copies_exact": _block_copies_exact(triton_blocks, device)}
    elementwise = [row for dtype in dtypes for row in _elementwise_errors(triton_elementwise, device, dtype)]
    result["elementwise"] = elementwise
    if device == "cuda":
        result["timing"] = {
            "decode": _time_decode(triton_attention),
            "prefill": _time_prefill(triton_prefill),
            "block_copy_64_blocks": _time_block_copies(triton_blocks),
            "elementwise": _time_elementwise(triton_elementwise),
        }
    result["ok"] = result["slot_writes_exact"] and result["block_copies_exact"] and all(
        _within_tolerance(row) for row in decode + prefill + elementwise)
    return result


def _within_tolerance(row: dict) -> bool:
    """Attention outputs are averages (about 1 in size); elementwise ones carry their
    own `scale`, the reference's largest magnitude."""
    tolerance = 1e-4 if "float32" in row["dtype"] else 3e-2
    return row["max_abs_err"] < tolerance * max(1.0, row.get("scale", 1.0))


# ---- errors -------------------------------------------------------------------------
def _decode_error(triton_attention, device: str, shape, dtype) -> dict:
    from kernels.attention import decode_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    lengths = [1, block_size + 1, 300, 1000]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    per_seq = max(-(-n // block_size) for n in lengths)
    tables = torch.stack([torch.randperm(num_blocks, device=device)[:per_seq] for _ in lengths])
    q = torch.randn(len(lengths), num_heads, head_dim, device=device).to(dtype)
    lens = torch.tensor(lengths, device=device)
    got = triton_attention.paged_decode_attention(q, cache, tables, lens, head_dim ** -0.5)
    want = decode_attention(q.float(), cache.float(), tables, lens, head_dim ** -0.5)
    return _row(shape, dtype, max_abs_err=(got.float() - want).abs().max().item())


def _prefill_error(triton_prefill, device: str, shape, dtype, num_cached: int, q_len: int) -> dict:
    from kernels.attention import prefill_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    ctx_len = num_cached + q_len
    num_blocks = -(-ctx_len // block_size) + 4
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    table = torch.randperm(num_blocks, device=device)[: -(-ctx_len // block_size)]
    k_new, v_new = _chunk_kv(cache, table, num_cached, ctx_len)
    q = torch.randn(q_len, num_heads, head_dim, device=device).to(dtype)
    got = triton_prefill.paged_prefill_attention(q, k_new, v_new, cache, table, ctx_len, head_dim ** -0.5)
    want = prefill_attention(q.float(), k_new.float(), v_new.float(), cache.float(), table, ctx_len, head_dim ** -0.5)
    return _row(shape, dtype, num_cached=num_cached, q_len=q_len, max_abs_err=(got.float() - want).abs().max().item())


def _chunk_kv(cache, table, num_cached: int, ctx_len: int):
    """The chunk's own K/V, as the model has them: what the cache holds at its slots."""
    from kernels.attention import gather_kv

    k, v = gather_kv(cache, table, ctx_len)
    return k[num_cached:], v[num_cached:]


def _row(shape, dtype, **values) -> dict:
    num_heads, num_kv_heads, head_dim, block_size = shape
    return {"heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "dtype": str(dtype), **values}


def _slot_writes_exact(triton_attention, device: str) -> bool:
    from kernels.attention import write_kv_slots

    cache = torch.randn(16, 2, 16, 2, 64, device=device)
    reference = cache.clone()
    slots = torch.randperm(256, device=device)[:50]
    k, v = torch.randn(50, 2, 64, device=device), torch.randn(50, 2, 64, device=device)
    triton_attention.write_kv_slots(cache, k, v, slots)
    write_kv_slots(reference, k, v, slots)
    return bool(torch.equal(cache, reference))


def _block_copies_exact(triton_blocks, device: str) -> bool:
    from kernels.blocks import gather_blocks, scatter_blocks

    cache = torch.randn(16, 3, 2, 16, 2, 64, device=device).to(torch.bfloat16)  # [blocks, layers, K/V, ...]
    block_ids = torch.randperm(16, device=device)[:6]
    gathered = triton_blocks.gather_blocks(cache, block_ids)
    gathers_exactly = torch.equal(gathered, gather_blocks(cache, block_ids))
    blocks = torch.randn_like(gathered)
    reference = cache.clone()
    triton_blocks.scatter_blocks(cache, block_ids, blocks)
    scatter_blocks(reference, block_ids, blocks)
    return bool(gathers_exactly and torch.equal(cache, reference))


def _elementwise_inputs(device: str, dtype, num_tokens: int) -> dict:
    """qwen2.5-0.5b's sizes: hidden 896, 14 heads of 64 (+2 KV heads; RoPE rotates q's
    and k's 16 heads in one call), MLP 4864."""
    from kernels.rope import rope_cos_sin, rope_inv_freq

    cos_table, sin_table = rope_cos_sin(rope_inv_freq(64, 1e6), 4096)
    positions = torch.randint(0, 4096, (num_tokens,))
    qkv = torch.randn(num_tokens, (14 + 4) * 64, device=device).to(dtype)
    num_blocks = num_tokens // 16 + 2
    return {"x": torch.randn(num_tokens, 896, device=device).to(dtype), "weight": torch.randn(896, device=device).to(dtype),
            "q": qkv[:, : 16 * 64].view(num_tokens, 16, 64), "cos": cos_table[positions].to(device),
            "sin": sin_table[positions].to(device), "gate_up": torch.randn(num_tokens, 2 * 4864, device=device).to(dtype),
            "v": qkv[:, 16 * 64 :].view(num_tokens, 2, 64),
            "cache": torch.zeros(num_blocks, 2, 16, 2, 64, device=device, dtype=dtype),
            "slots": torch.randperm(num_blocks * 16, device=device)[:num_tokens]}


def _elementwise_pairs(triton_elementwise, inputs: dict, with_cache: bool = False) -> dict:
    """name -> (Triton call, reference call) over the same inputs; `with_cache`:
    the fused RoPE and KV write's answer holds the cache it wrote (for errors,
    not times)."""
    from kernels.activation import silu_and_mul
    from kernels.norm import add_rms_norm, rms_norm
    from kernels.rope import apply_rope
    from kernels.rope_cache import rope_and_write_kv

    x, weight, q, cos, sin, gate_up = (inputs[k] for k in ("x", "weight", "q", "cos", "sin", "gate_up"))
    ours_cache, reference_cache = inputs["cache"], inputs["cache"].clone()

    def rope_and_cache(rope_and_write, cache):
        """The rotated q and k, and the cache the call wrote k and v into (each side
        its own: with one cache between them, the fused kernel's write, the only KV
        write on CUDA, was never compared)."""
        rotated = rope_and_write(q, inputs["v"], cos, sin, cache, inputs["slots"])
        return torch.cat([rotated.flatten(), cache.flatten()]) if with_cache else rotated

    return {
        "rms_norm": (lambda: triton_elementwise.rms_norm(x, weight, 1e-6), lambda: rms_norm(x, weight, 1e-6)),
        "add_rms_norm": (lambda: triton_elementwise.add_rms_norm(x, x, weight, 1e-6)[0],
                         lambda: add_rms_norm(x, x, weight, 1e-6)[0]),
        "rope": (lambda: triton_elementwise.apply_rope(q, cos, sin), lambda: apply_rope(q, cos, sin)),
        "silu_and_mul": (lambda: triton_elementwise.silu_and_mul(gate_up), lambda: silu_and_mul(gate_up)),
        "rope_and_write_kv": (lambda: rope_and_cache(triton_elementwise.rope_and_write_kv, ours_cache),
                              lambda: rope_and_cache(rope_and_write_kv, reference_cache)),
    }


def _elementwise_errors(triton_elementwise, device: str, dtype) -> list[dict]:
    rows = []
    pairs = _elementwise_pairs(triton_elementwise, _elementwise_inputs(device, dtype, 37), with_cache=True)
    for name, (ours, reference) in pairs.items():
        want = reference().float()
        rows.append({"kernel": name, "dtype": str(dtype), "max_abs_err": (ours().float() - want).abs().max().item(),
                     "scale": want.abs().max().item()})
    return rows


# ---- times (CUDA) ----------------------------------------------------------------------
def _time_elementwise(triton_elementwise) -> dict:
    """Each kernel beside its torch reference; the fused RoPE and KV write also
    beside the two Triton kernels it replaces, in turn."""
    from kernels import triton_attention
    from kernels.rope_cache import rope_and_write_kv

    times = {}
    for num_tokens in (64, 4096):
        inputs = _elementwise_inputs("cuda", torch.bfloat16, num_tokens)
        for name, (ours, reference) in _elementwise_pairs(triton_elementwise, inputs).items():
            times[f"{name}_{num_tokens}_triton_ms"] = cuda_time_ms(ours)
            times[f"{name}_{num_tokens}_torch_ms"] = cuda_time_ms(reference)
        args = (inputs["q"], inputs["v"], inputs["cos"], inputs["sin"], inputs["cache"], inputs["slots"])
        times[f"rope_and_write_kv_{num_tokens}_two_triton_kernels_ms"] = cuda_time_ms(
            lambda: rope_and_write_kv(*args, rope=triton_elementwise.apply_rope, write=triton_attention.write_kv_slots))
    return times

def _time_decode(triton_attention) -> dict:
    """Each batch x context: Triton as dispatched, Triton with one program per
    (sequence, KV head), and the torch reference."""
    from kernels.attention import decode_attention

    heads, kv_heads, head_dim, block_size = 14, 2, 64, 16
    rows = {}
    for batch, context in ((64, 1024), (8, 4096), (1, 8192)):
        per_seq = context // block_size
        cache = torch.randn(batch * per_seq, 2, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        tables = torch.arange(batch * per_seq, device="cuda").view(batch, per_seq)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), context, device="cuda")
        unsplit = lambda *args: triton_attention.paged_decode_attention(*args, splits=1)  # noqa: E731
        times = {"splits": triton_attention.num_splits(batch, kv_heads)}
        for name, fn in (("triton_ms", triton_attention.paged_decode_attention), ("triton_unsplit_ms", unsplit),
                         ("torch_reference_ms", decode_attention)):
            times[name] = cuda_time_ms(lambda fn=fn: fn(q, cache, tables, lens, 0.125),
                                       capture=fn is not decode_attention)  # the reference reads lengths to the host
        kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
        for name in ("triton_ms", "triton_unsplit_ms"):
            times[name.replace("_ms", "_gb_s")] = kv_bytes / (times[name] / 1e3) / 1e9
        rows[f"batch{batch}_ctx{context}"] = times
    return rows


def _time_prefill(triton_prefill) -> dict:
    from kernels.attention import prefill_attention

    heads, kv_heads, head_dim, block_size = 14, 2, 64, 16
    scale = head_dim ** -0.5
    rows = {}
    for num_cached, q_len in ((0, 2048), (3584, 512)):
        ctx_len = num_cached + q_len
        num_blocks = -(-ctx_len // block_size)
        cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(num_blocks, device="cuda")
        q = torch.randn(q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = _chunk_kv(cache, table, num_cached, ctx_len)
        args = (q, k_new, v_new, cache, table, ctx_len, scale)
        sdpa_only = _sdpa_on_contiguous_kv(q, cache, table, num_cached, ctx_len, scale)
        times = {"triton_ms": cuda_time_ms(lambda: triton_prefill.paged_prefill_attention(*args)),
                 "torch_reference_ms": cuda_time_ms(lambda: prefill_attention(*args)),
                 "torch_sdpa_contiguous_kv_ms": cuda_time_ms(sdpa_only)}
        flops = 4 * heads * head_dim * (q_len * num_cached + q_len * (q_len + 1) // 2)
        for name in list(times):
            times[name.replace("_ms", "_tflop_s")] = flops / (times[name] / 1e3) / 1e12
        rows[f"cached{num_cached}_chunk{q_len}"] = times
    return rows


def _sdpa_on_contiguous_kv(q, cache, table, num_cached: int, ctx_len: int, scale: float):
    """The reference's SDPA call, with its K/V gathered (and its mask built) once
    beforehand: what SDPA costs when no gather is needed."""
    from kernels.attention import gather_kv

    k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in gather_kv(cache, table, ctx_len))
    query = q.transpose(0, 1).unsqueeze(0)
    mask = None
    if num_cached:
        positions = torch.arange(ctx_len, device=q.device)
        mask = positions[None, :] <= positions[num_cached:, None]
    return lambda: F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                  enable_gqa=True)


def _time_block_copies(triton_blocks) -> dict:
    from kernels.blocks import gather_blocks, scatter_blocks

    num_layers, block_size, kv_heads, head_dim, num_blocks = 24, 16, 2, 64, 1024
    cache = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, device="cuda",
                        dtype=torch.bfloat16)
    block_ids = torch.randperm(num_blocks, device="cuda")[:64]
    blocks = gather_blocks(cache, block_ids)
    times = {"triton_gather_ms": cuda_time_ms(lambda: triton_blocks.gather_blocks(cache, block_ids)),
             "torch_gather_ms": cuda_time_ms(lambda: gather_blocks(cache, block_ids)),
             "triton_scatter_ms": cuda_time_ms(lambda: triton_blocks.scatter_blocks(cache, block_ids, blocks)),
             "torch_scatter_ms": cuda_time_ms(lambda: scatter_blocks(cache, block_ids, blocks))}
    moved_bytes = 2 * blocks.numel() * blocks.element_size()
    for name in list(times):
        times[name.replace("_ms", "_gb_s")] = moved_bytes / (times[name] / 1e3) / 1e9
    return times
