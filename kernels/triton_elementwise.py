"""RMSNorm, RoPE (alone, and with the KV cache write) and SiLU-and-multiply in
Triton: one kernel each on CUDA.

Each torch reference is a chain of small ops (in bfloat16, RMSNorm eight kernels:
cast, square, mean, add, rsqrt, multiply, cast, scale; RoPE seven a call, two calls
a layer; the MLP's activation two), and on a GPU a small model's step pays per
kernel: in launch time when steps run eagerly (prefill), in each kernel's fixed
cost inside a CUDA graph (decode). With these (RoPE once a layer, over q's and
k's heads together, writing k and v to the cache as it goes) and the fused
residual add, a decoder layer runs 9 kernels (counted from the code, not
profiled) instead of 44.

Same contracts and arithmetic as the references (`kernels/norm.py`,
`kernels/rope.py`, `kernels/activation.py`): float32 inside, the result rounded to
the input's dtype once (the references round after each op, so half-precision
results may differ in the last bit; float32 agrees to rounding).

- `rms_norm`: one program per row; the row must fit one block (hidden sizes up to
  `MAX_HIDDEN`). `add_rms_norm` the same after adding the residual, which it
  also writes (the sum rounded to the model's dtype, then normalised, as the
  reference's `x + residual` then RMSNorm).
- `apply_rope`: one program per token, all its heads (the model passes q's and k's
  together), the rotate-half form Llama and Qwen2 use: out = x * cos +
  rotate_half(x) * sin, with cos and sin rounded to x's dtype first, as the
  reference does. Reads the heads in place from the fused QKV output (rows may be
  strided; each head's row contiguous). `rope_and_write_kv` also stores the
  token's rotated k heads and its v heads at its cache slot
  (`kernels/rope_cache.py`): the slot write's kernel, and its reading k back,
  saved.
- `silu_and_mul`: silu(gate) * up of the fused gate/up projection [N, 2I] -> [N, I].

Like their C++ twins in `kernels/cpu_norm_rope.py`, the wrappers hand layouts their
kernels do not take (the `supports_*` functions) to the references. Imports Triton
at import time: import it only where Triton is installed (the `gpu` extra); on CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import activation as reference_activation
from kernels import norm as reference_norm
from kernels import rope as reference_rope

MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, size, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (row * stride in 32 bits wrapped past 2**31 elements)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() >= 1 and x.shape[-1] <= MAX_HIDDEN and x.stride(-1) == 1 and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; returns a new tensor of x's shape and dtype. Layouts the kernel
    does not take go to the reference."""
    if not supports_rms_norm(x, weight):
        return reference_norm.rms_norm(x, weight, eps)
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), size, float(eps),
                                           BLOCK=triton.next_power_of_2(size))
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_out, stride_sum, size, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (row * stride in 32 bits wrapped past 2**31 elements)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(sum_ptr.dtype.element_ty)  # the residual stream keeps the model's dtype
    tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / size + eps)
    normed = (s * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel; x and residual [..., H]
    of one shape and dtype. Layouts the kernel does not take go to the reference."""
    if not (supports_rms_norm(x, weight) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.stride(-1) == 1):
        return reference_norm.add_rms_norm(x, residual, weight, eps)
    size = x.shape[-1]
    rows, residual_rows = x.reshape(-1, size), residual.reshape(-1, size)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, residual_rows, weight, out, summed, rows.stride(0),
                                               residual_rows.stride(0), out.stride(0), summed.stride(0), size,
                                               float(eps), BLOCK=triton.next_power_of_2(size))
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _rope_token(x_ptr, cos_ptr, sin_ptr, out_ptr, token, num_heads, stride_xn, stride_xh, stride_cn, stride_on,
                stride_oh, HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotate one token's heads (rotate-half RoPE, in float32, cos and sin rounded
    to x's dtype first, as the reference rounds them) into `out`. Returns the
    rotated halves of each head's row (in out's dtype), the head and dimension
    indexes, and the mask of real heads."""
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    row = x_ptr + token * stride_xn + heads * stride_xh
    x1 = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + token * stride_cn + dims).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cn + HALF + dims).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_cn + dims).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_cn + HALF + dims).to(dtype).to(tl.float32)
    first = (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty)
    second = (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty)
    out = out_ptr + token * stride_on + heads * stride_oh
    tl.store(out + dims, first, mask=mask)
    tl.store(out + HALF + dims, second, mask=mask)
    return first, second, heads, dims, mask


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, stride_xn, stride_xh, stride_cn, stride_on, stride_oh,
                 HEADS: tl.constexpr, HALF: tl.constexpr):
    _rope_token(x_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0).to(tl.int64), num_heads, stride_xn, stride_xh,
                stride_cn, stride_on, stride_oh, HEADS, HALF)


@triton.jit
def _rope_write_kv_kernel(x_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, cache_ptr, slots_ptr, num_heads, num_kv_heads,
                          stride_xn, stride_xh, stride_vn, stride_vh, stride_cn, stride_on, stride_oh,
                          stride_cb, stride_ckv, stride_cs, stride_ch,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """`_rope_kernel`, and the token's rotated k heads (the last `num_kv_heads` of
    its heads) and its v heads stored at its slot of the cache."""
    token = tl.program_id(0).to(tl.int64)
    first, second, heads, dims, mask = _rope_token(x_ptr, cos_ptr, sin_ptr, out_ptr, token, num_heads, stride_xn,
                                                   stride_xh, stride_cn, stride_on, stride_oh, HEADS, HALF)
    slot = tl.load(slots_ptr + token)
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    kv_head = heads - (num_heads - num_kv_heads)  # negative for q's heads, which are masked out
    is_k = mask & (kv_head >= 0)
    cache_type = cache_ptr.dtype.element_ty
    tl.store(row + kv_head * stride_ch + dims, first.to(cache_type), mask=is_k)
    tl.store(row + kv_head * stride_ch + HALF + dims, second.to(cache_type), mask=is_k)
    v_heads = tl.arange(0, KV_HEADS)[:, None]
    v_dims = tl.arange(0, 2 * HALF)[None, :]
    is_v = v_heads < num_kv_heads
    v = tl.load(v_ptr + token * stride_vn + v_heads * stride_vh + v_dims, mask=is_v, other=0.0)
    tl.store(row + stride_ckv + v_heads * stride_ch + v_dims, v.to(cache_type), mask=is_v)


def supports_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """[N, heads, d] with d a power of two of at least 2, each head's row contiguous;
    cos and sin [N, d] with contiguous rows and the same strides."""
    head_dim = x.shape[-1]
    return (x.dim() == 3 and head_dim >= 2 and head_dim & (head_dim - 1) == 0 and x.stride(2) == 1
            and cos.stride() == sin.stride() and cos.stride(-1) == 1 and cos.shape == (x.shape[0], head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, d]; cos, sin: [N, d] float32. Returns a new contiguous tensor.
    Layouts the kernel does not take go to the reference."""
    if not supports_rope(x, cos, sin):
        return reference_rope.apply_rope(x, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rope_kernel[(num_tokens,)](x, cos, sin, out, num_heads, x.stride(0), x.stride(1), cos.stride(0),
                                    out.stride(0), out.stride(1), HEADS=triton.next_power_of_2(num_heads),
                                    HALF=head_dim // 2)
    return out


def rope_and_write_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      layer_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`kernels.rope_cache.rope_and_write_kv` in one kernel: qk [N, q_heads +
    kv_heads, d] rotated into a new tensor, its k heads and v ([N, kv_heads, d])
    written to the cache at the slots. Layouts the kernel does not take go to the
    reference."""
    from kernels import rope_cache

    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    if not (supports_rope(qk, cos, sin) and v.shape == (num_tokens, num_kv_heads, head_dim) and v.stride(2) == 1
            and layer_cache.stride(4) == 1 and layer_cache.shape[3:] == (num_kv_heads, head_dim)):
        return rope_cache.rope_and_write_kv(qk, v, cos, sin, layer_cache, slot_mapping)
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens,)](
            qk, v, cos, sin, out, layer_cache, slot_mapping, num_heads, num_kv_heads,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
            HEADS=triton.next_power_of_2(num_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2, BLOCK_SIZE=layer_cache.shape[2],
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (row * stride in 32 bits wrapped past 2**31 elements)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] (gate, then up); returns [N, I] in x's dtype. Layouts the kernel
    does not take go to the reference."""
    if not supports_silu_and_mul(x):
        return reference_activation.silu_and_mul(x)
    num_rows, size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, size, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(size, 1)))
    if num_rows and size:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(size, block))](x, out, x.stride(0), out.stride(0), size,
                                                                   BLOCK=block)
    return out
