"""Which linear-layer kernel a model uses.

`select_linear("auto", device, dtype)` (`"auto"` being the engine's default
`kernel_backend`) gives the C++ small-batch kernel (`kernels.cpu_linear`) for
float32 on CPU where it builds, which hands larger inputs to torch; everywhere
else, and with `"torch"`, it gives `torch.nn.functional.linear` (cuBLAS on GPUs;
not measured against anything else here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import wants_cpu_kernels


def select_linear(backend: str, device: torch.device, dtype: torch.dtype) -> Callable:
    if wants_cpu_kernels(backend, device, dtype):
        from kernels import cpu_linear

        if cpu_linear.load() is not None:
            return cpu_linear.linear
    return torch.nn.functional.linear
