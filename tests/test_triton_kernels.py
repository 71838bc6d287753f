"""The Triton kernels (kernels/triton_attention.py, triton_prefill.py,
triton_blocks.py, triton_elementwise.py) against the torch reference, on CPU under Triton's interpreter:
`tests/triton_kernel_checks.py`, run in a process of its own with TRITON_INTERPRET=1.
That they compile for a Hopper GPU (`tests/triton_compile_checks.py`, no GPU
needed). And the CUDA dispatchers' per-call fallbacks, which need no GPU. Skipped
where Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_the_reference_under_the_interpreter():
    checks = Path(__file__).with_name("triton_kernel_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=checks.parent.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_triton_kernels_compile_for_hopper_without_a_gpu():
    """`tests/triton_compile_checks.py`: each kernel, launched by its real wrapper,
    compiled to a cubin for sm_90 (what the interpreter never exercises)."""
    checks = Path(__file__).with_name("triton_compile_checks.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; silences its warning
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=checks.parent.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_the_cuda_dispatch_falls_back_to_the_reference_for_shapes_triton_does_not_take():
    """Choosing the CUDA path needs no GPU; a head_dim of 80 (not a power of two)
    must go to the reference, here run on CPU tensors."""
    import torch

    from kernels.attention import decode_attention, select_decode_attention

    attend = select_decode_attention("auto", torch.device("cuda"), torch.float16)
    assert attend is not decode_attention  # the Triton path, with its fallback
    cache = torch.randn(8, 2, 16, 2, 80)
    q, tables, lens = torch.randn(2, 4, 80), torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 5])
    torch.testing.assert_close(attend(q, cache, tables, lens, 0.1), decode_attention(q, cache, tables, lens, 0.1))


def test_the_cuda_prefill_dispatch_falls_back_to_the_reference_for_shapes_triton_does_not_take():
    """As for decode: a block_size of 8 (under tl.dot's minimum) goes to the
    reference, here run on CPU tensors."""
    import torch

    from kernels.attention import prefill_attention, select_prefill_attention

    attend = select_prefill_attention("auto", torch.device("cuda"))
    assert attend is not prefill_attention  # the Triton path, with its fallback
    layer_cache, table = torch.randn(8, 2, 8, 2, 64), torch.tensor([3, 0, 5])
    q, k_new, v_new = torch.randn(6, 4, 64), torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    args = (q, k_new, v_new, layer_cache, table, 20, 0.125)
    torch.testing.assert_close(attend(*args), prefill_attention(*args))


def test_the_cuda_prefill_dispatch_leaves_a_chunk_with_no_prefix_to_sdpa():
    """A supported shape, but no cached prefix: the reference (SDPA on the chunk's own
    K/V, flash attention on a GPU) runs, not Triton (which, given CPU tensors here,
    would raise)."""
    import torch

    from kernels.attention import prefill_attention, select_prefill_attention

    attend = select_prefill_attention("auto", torch.device("cuda"))
    layer_cache, table = torch.randn(8, 2, 16, 2, 64), torch.tensor([3, 0])
    q, k_new, v_new = torch.randn(20, 4, 64), torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    args = (q, k_new, v_new, layer_cache, table, 20, 0.125)
    torch.testing.assert_close(attend(*args), prefill_attention(*args))


def test_the_cuda_block_copy_dispatch_falls_back_to_torch_indexing_for_tensors_triton_does_not_take():
    """A cache whose blocks are not one span each (a slice inside the block), and a
    non-contiguous source for a scatter, go to torch indexing, here on CPU tensors."""
    import torch

    from kernels.blocks import TORCH_BLOCK_COPY, select_block_copy

    copy = select_block_copy("auto", torch.device("cuda"))
    assert copy is not TORCH_BLOCK_COPY
    full = torch.randn(6, 2, 2, 16, 2, 8)
    cache, block_ids = full[:, :, :, :8], torch.tensor([4, 1])
    assert torch.equal(copy.gather(cache, block_ids), cache[block_ids])
    blocks = torch.randn(2, 2, 2, 2, 8, 8).transpose(3, 4)  # [2, 2, 2, 8, 2, 8], not contiguous
    expected = full.clone()
    expected[:, :, :, :8].index_copy_(0, block_ids, blocks)
    copy.scatter(cache, block_ids, blocks)
    assert torch.equal(full, expected)


def test_the_cuda_elementwise_dispatch_falls_back_to_the_references_for_layouts_triton_does_not_take():
    """RMSNorm and SiLU-and-multiply over a strided last axis, and RoPE with a
    head_dim of 80, go to the references, here on CPU tensors."""
    import torch

    from kernels.activation import select_silu_and_mul, silu_and_mul
    from kernels.norm import add_rms_norm, rms_norm, select_add_rms_norm, select_rms_norm
    from kernels.rope import apply_rope, select_apply_rope

    cuda = torch.device("cuda")
    norm, rotate, activate = select_rms_norm("auto", cuda, torch.float16), \
        select_apply_rope("auto", cuda, torch.float16), select_silu_and_mul("auto", cuda)
    assert norm is not rms_norm and rotate is not apply_rope and activate is not silu_and_mul
    x, weight = torch.randn(16, 3).t(), torch.randn(16)  # [3, 16], last axis strided
    torch.testing.assert_close(norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    add_norm = select_add_rms_norm("auto", cuda, torch.float16)
    assert add_norm is not add_rms_norm
    for got, expected in zip(add_norm(x, x, weight, 1e-6), add_rms_norm(x, x, weight, 1e-6)):
        torch.testing.assert_close(got, expected)
    q, cos, sin = torch.randn(3, 2, 80), torch.randn(3, 80), torch.randn(3, 80)
    torch.testing.assert_close(rotate(q, cos, sin), apply_rope(q, cos, sin))
    gate_up = torch.randn(8, 4).t()  # [4, 8], columns strided
    torch.testing.assert_close(activate(gate_up), silu_and_mul(gate_up))
