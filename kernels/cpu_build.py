"""Builds the C++ CPU kernels in `kernels/csrc/` on first use.

Each source becomes a torch extension compiled with `-O3 -march=native` and
OpenMP. OpenMP matters: `at::parallel_for` is a header template that runs its loop
on torch's thread pool only when the extension itself is compiled with
`-fopenmp`; without it every chunk runs on the calling thread. The extension links
the `libgomp.so.1` that torch has already loaded (same soname), so the kernels and
torch's own ops share one thread pool.

The build is cached by torch (`~/.cache/torch_extensions`, or
`TORCH_EXTENSIONS_DIR`) under a name that includes a hash of the source and of this
CPU's instruction-set flags (the code is built for this CPU). When a kernel cannot
be built (no compiler, no ninja, a build error), `load` returns None, says why once
in the log, and the callers use the torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]

_lock = threading.Lock()
_modules: dict[str, object] = {}
_errors: dict[str, str] = {}


def _build_tag(source: Path) -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode() + source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:10]


def load(source_name: str):
    """The compiled module of `csrc/<source_name>.cpp`, or None when it cannot be built here."""
    with _lock:
        if source_name not in _modules and source_name not in _errors:
            source = CSRC / f"{source_name}.cpp"
            try:
                from torch.utils.cpp_extension import load as load_extension

                _modules[source_name] = load_extension(
                    name=f"tandem_{source_name}_{_build_tag(source)}", sources=[str(source)],
                    extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                )
            except Exception as exc:  # no compiler, no ninja, a build error: fall back
                _errors[source_name] = f"{type(exc).__name__}: {exc}"
                log.warning("C++ kernel %s unavailable, using the torch reference: %s", source_name,
                            _errors[source_name][:500])
        return _modules.get(source_name)


def error(source_name: str) -> str | None:
    """Why `load(source_name)` returned None, if it did."""
    return _errors.get(source_name)
