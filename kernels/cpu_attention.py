"""C++ attention kernels for CPU (`kernels/csrc/`), compiled on first use.

`paged_decode_attention` reads each sequence's K and V in place from the paged cache
(no gather copy), one pass over K for the scores and one over V for the output,
with all query heads of a KV head computed together. Against the torch reference
(`kernels.attention.decode_attention`), which copies every sequence's K/V out of
its blocks and lines them up for two einsums, it moves about a third of the bytes.
Float32 only; parallel over (sequence, KV head) pairs with torch's own thread pool.

Compiling needs a C++ compiler and ninja (a dependency). The build is cached by
torch (`~/.cache/torch_extensions`, or `TORCH_EXTENSIONS_DIR`) under a name that
includes this CPU's instruction-set flags, since it is built with `-march=native`.
When it cannot be built, `load()` returns None, says why once in the log, and the
engine uses the torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast"]
_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_tag() -> str:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def load():
    """The compiled module, or None when it cannot be built here."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load as load_extension

                _module = load_extension(
                    name=f"tandem_cpu_attention_{_cpu_tag()}", sources=[str(_SOURCE)], extra_cflags=_FLAGS
                )
            except Exception as exc:  # no compiler, no ninja, a build error: fall back
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("CPU attention kernel unavailable, using the torch reference: %s", _error[:500])
        return _module


def paged_decode_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as `kernels.attention.decode_attention`, float32 on CPU."""
    batch, num_heads, head_dim = q.shape
    assert q.device.type == "cpu" and q.dtype == layer_cache.dtype == torch.float32, (q.device, q.dtype)
    assert layer_cache.dim() == 5 and layer_cache.shape[1] == 2 and layer_cache.shape[4] == head_dim
    assert layer_cache.stride(4) == 1, "the cache's last dimension must be contiguous"
    assert num_heads % layer_cache.shape[3] == 0, (num_heads, layer_cache.shape)
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    return load().paged_decode_attention(
        q.contiguous(), layer_cache, block_tables.contiguous(), context_lens, float(scale)
    )
