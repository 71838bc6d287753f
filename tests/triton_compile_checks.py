"""Every Triton kernel compiles for a Hopper GPU (sm_90: the H100 and H200), with the
arguments its wrapper really passes, on a machine with no GPU.

Triton's interpreter (`triton_kernel_checks.py`) checks what the kernels compute but
not that they compile: it runs the Python, never Triton's code generator, which is
where a GPU run would fail first (a `tl.dot` shape, a dtype the hardware path does
not take, a precision option). Triton compiles to PTX and a cubin without a GPU, so
here each kernel's launch is replaced by a compilation for sm_90: `CompileForHopper`
takes the place of the `@triton.jit` object in its module, and calling the wrapper
(the real one, on CPU tensors of the real shapes and dtypes) compiles the kernel from
the exact arguments the launch would have had. Nothing runs; the wrappers' outputs
are never read.

Run by `tests/test_triton_kernels.py` in a process of its own, without
TRITON_INTERPRET (the jit objects must be real ones).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

assert not os.environ.get("TRITON_INTERPRET"), "compile checks need Triton's compiler, not its interpreter"
triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.uint8: "u8"}


class CompileForHopper:
    """Stands in for a `@triton.jit` function: `kernel[grid](*args, **kwargs)`
    compiles it for sm_90 from those arguments instead of launching it."""

    def __init__(self, jit_fn) -> None:
        self.fn = jit_fn
        self.compiled: list[dict] = []

    def __getitem__(self, grid):
        return self._compile

    def _compile(self, *args, **kwargs) -> None:
        values = dict(zip(self.fn.arg_names, args), **kwargs)
        signature, constexprs = {}, {}
        for param in self.fn.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                raise TypeError(f"{param.name}: no Triton type for {type(value).__name__}")
        kernel = triton.compile(ASTSource(self.fn, signature, constexprs), target=HOPPER)
        assert "cubin" in kernel.asm and kernel.asm["cubin"], self.fn.__name__
        self.compiled.append({"signature": signature, "constexprs": constexprs, "ttir": kernel.asm["ttir"]})


@pytest.fixture
def hopper(monkeypatch):
    """Replace each named kernel of a module by a CompileForHopper; return them."""
    def replace(module, *names):
        stand_ins = [CompileForHopper(getattr(module, name)) for name in names]
        for name, stand_in in zip(names, stand_ins):
            monkeypatch.setattr(module, name, stand_in)
        return stand_ins

    return replace


# (heads, KV heads, head_dim, block_size): qwen2.5-0.5b's attention, and an 8B-sized one
SHAPES = [(14, 2, 64, 16), (32, 8, 128, 32)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_kernels_compile_for_hopper(hopper, shape, dtype):
    from kernels import triton_attention, triton_prefill

    num_heads, num_kv_heads, head_dim, block_size = shape
    decode, write = hopper(triton_attention, "_paged_decode_kernel", "_write_slots_kernel")
    (prefill,) = hopper(triton_prefill, "_paged_prefill_kernel")
    layer_cache = torch.zeros(8, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype)[:, 1]
    tables, lens = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, dtype=torch.long)
    for splits in (1, 16):  # one program per sequence, and split-K with its merge
        triton_attention.paged_decode_attention(torch.zeros(3, num_heads, head_dim, dtype=dtype), layer_cache,
                                                tables, lens, 0.125, splits=splits)
    k = torch.zeros(5, num_kv_heads, head_dim, dtype=dtype)
    triton_attention.write_kv_slots(layer_cache, k, k, torch.arange(5))
    q = torch.zeros(5, num_heads, head_dim, dtype=dtype)
    triton_prefill.paged_prefill_attention(q, k, k, layer_cache, torch.arange(4), 40, 0.125)
    assert len(decode.compiled) == 2
    assert len(write.compiled) == len(prefill.compiled) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_copy_and_elementwise_kernels_compile_for_hopper(hopper, dtype):
    from kernels import triton_blocks, triton_elementwise

    (copy,) = hopper(triton_blocks, "_copy_blocks_kernel")
    norm, add_norm, rope, rope_write, activation = hopper(triton_elementwise, "_rms_norm_kernel",
                                                          "_add_rms_norm_kernel", "_rope_kernel",
                                                          "_rope_write_kv_kernel", "_silu_and_mul_kernel")
    cache = torch.zeros(8, 3, 2, 16, 2, 64, dtype=dtype)
    ids = torch.tensor([3, 1])
    triton_blocks.gather_blocks(cache, ids)
    triton_blocks.scatter_blocks(cache, ids, torch.zeros(2, *cache.shape[1:], dtype=dtype))
    triton_elementwise.rms_norm(torch.zeros(4, 896, dtype=dtype), torch.zeros(896, dtype=dtype), 1e-6)
    hidden = torch.zeros(4, 896, dtype=dtype)
    triton_elementwise.add_rms_norm(hidden, hidden, torch.zeros(896, dtype=dtype), 1e-6)
    qkv = torch.zeros(4, 18 * 64, dtype=dtype)
    cos = torch.zeros(4, 64)
    triton_elementwise.apply_rope(qkv[:, : 16 * 64].view(4, 16, 64), cos, cos)
    layer_cache = torch.zeros(8, 2, 2, 16, 2, 64, dtype=dtype)[:, 1]
    triton_elementwise.rope_and_write_kv(qkv[:, : 16 * 64].view(4, 16, 64), qkv[:, 16 * 64 :].view(4, 2, 64), cos,
                                         cos, layer_cache, torch.arange(4))
    triton_elementwise.silu_and_mul(torch.zeros(4, 2 * 4864, dtype=dtype))
    assert len(copy.compiled) == 2
    assert len(norm.compiled) == len(add_norm.compiled) == len(rope.compiled) == len(activation.compiled) == 1
    assert len(rope_write.compiled) == 1
    for kernel in (norm, add_norm, rope, rope_write, activation):
        assert _rows_offset_in_64_bits(kernel.compiled[0]["ttir"]), kernel.fn.__name__


def _rows_offset_in_64_bits(ttir: str) -> bool:
    """Whether no product of the program's row (its first grid axis) is taken in
    32 bits. `row * stride` in i32 wrapped past 2**31 elements: SiLU-and-mul's
    input is that at 42k tokens of a 32B model's step (out-of-bounds reads and
    writes, or wrong activations)."""
    rows = re.findall(r"(%[\w.]+) = tt\.get_program_id x : i32", ttir)
    products = [line.split(" loc(")[0] for line in ttir.splitlines() if "arith.muli" in line]
    return bool(rows) and not any(re.search(rf"muli {row}, .*: i32$|muli .*, {row} : i32$", product)
                                  for row in rows for product in products)
