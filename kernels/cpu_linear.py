"""The C++ small-batch linear layer for CPU (`kernels/csrc/small_linear.cpp`).

Decode steps multiply a few token rows by every weight matrix: memory-bound work
where MKL's sgemm (which packs the weight on every call) leaves much of the
bandwidth unused. `small_linear` streams each weight row once and multiplies it by
all input rows while it is in cache. It is used up to `MAX_ROWS` input rows, where
it measured faster than `torch.nn.functional.linear` on this project's machines
(docs/benchmarks.md, `tandem bench kernels`); above that (prefill chunks) MKL's
blocked sgemm is the better kernel and is used. Float32, AVX2 + FMA; built on
first use by `kernels.cpu_build` (None from `load()` means torch's linear is used).
"""

from __future__ import annotations

import torch

from kernels import cpu_build

_SOURCE = "small_linear"
MAX_ROWS = 128


def load():
    """The compiled module, or None when it cannot be built here (no compiler, no AVX2)."""
    return cpu_build.load(_SOURCE)


def build_error() -> str | None:
    return cpu_build.error(_SOURCE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `torch.nn.functional.linear` for float32 CPU tensors:
    x [..., K], weight [N, K], bias [N] or None -> [..., N]. More than MAX_ROWS rows,
    or a weight that is not one contiguous block, go to torch."""
    rows = x.reshape(-1, x.shape[-1])
    if not 0 < rows.shape[0] <= MAX_ROWS or not weight.is_contiguous():
        return torch.nn.functional.linear(x, weight, bias)
    assert x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    out = load().small_linear(rows.contiguous(), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
