"""Tensor kernels: torch references, and the C++ (CPU) and Triton (CUDA) kernels
that replace them where they apply. Each `select_*` function picks one from the
engine's `kernel_backend`: `auto` (the fastest kernel that applies on the device)
or `torch` (always the reference, for debugging and comparison)."""

import importlib.util

import torch

KERNEL_BACKENDS = ("auto", "torch")


def check_kernel_backend(backend: str) -> None:
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")


def wants_cpu_kernels(backend: str, device, dtype) -> bool:
    """Whether `backend` asks for the C++ CPU kernels on this device and dtype: `auto`
    and float32 on CPU (each caller still falls back when its kernel does not build)."""
    check_kernel_backend(backend)
    return backend == "auto" and torch.device(device).type == "cpu" and dtype == torch.float32


def wants_triton_kernels(backend: str, device) -> bool:
    """Whether `backend` asks for the Triton kernels on this device: `auto` on CUDA
    with Triton installed (the `gpu` extra); each caller still falls back, per call,
    for the shapes its kernel does not take."""
    check_kernel_backend(backend)
    return backend == "auto" and torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; to CUDA from pinned memory without waiting:
    a blocking copy from pageable memory waits for the stream's queued work (a step
    still running). Torch's caching host allocator keeps the pinned buffer until the
    copy has run."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_into(view: torch.Tensor, host: torch.Tensor) -> None:
    """`host` (a CPU tensor) copied into `view` (a tensor on any device), as
    `to_device` copies: to CUDA from pinned memory, without waiting. A strided
    host slice (a bucket of the decode graphs' block tables) is made contiguous
    first: pinned as it is, its copy may go through pageable memory, which the
    driver copies with the host waiting."""
    if view.is_cuda:
        host = host.contiguous().pin_memory()
    view.copy_(host, non_blocking=True)
