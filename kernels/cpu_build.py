"""Builds the C++ CPU kernels in `kernels/csrc/` on first use.

Each source becomes a torch extension compiled with `-O3 -march=native` and
OpenMP. OpenMP matters: `at::parallel_for` is a header template that runs its loop
on torch's thread pool only when the extension itself is compiled with
`-fopenmp`; without it every chunk runs on the calling thread. The extension links
the `libgomp.so.1` that torch has already loaded (same soname), so the kernels and
torch's own ops share one thread pool.

The build is cached by torch (`~/.cache/torch_extensions`, or
`TORCH_EXTENSIONS_DIR`) under a name that includes a hash of the source and of this
CPU's instruction-set flags (the code is built for this CPU); processes that ask
for the same kernel at once wait while one of them builds (`_build_lock`).
When a kernel cannot be built (no compiler, no ninja, a build error), `load`
returns None, says why once in the log, and the callers use the torch reference.

A first build takes about 30 s of one core per kernel (the sources include ATen
and pybind11, not `torch/extension.h`'s whole C++ API): 94 s of CPU, 53 s on two
cores, for the three (docs/benchmarks.md, "Session 67"). `python -m
kernels.cpu_build` builds all of them at once, in parallel; `make serve` and
`make test` run it after installing, so no worker or test pays for it later.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]

SOURCES = ("paged_decode_attention", "small_linear", "norm_rope")

_locks = {name: threading.Lock() for name in SOURCES}
_modules: dict[str, object] = {}
_errors: dict[str, str] = {}


def _build_tag(source: Path) -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(flags.encode() + source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:10]


@contextlib.contextmanager
def _build_lock(name: str):
    """Hold the build of extension `name` for this process; yields its build folder.

    Torch's own lock is a file that exists while a process builds (`lock` in the
    build folder), and a process killed mid-build (Ctrl-C during the first `make
    serve`, a test run stopped) leaves it behind: every later load of that kernel
    then waited on it forever, and workers never started. Here a builder first
    takes an flock on a file beside it, which the OS lets go when its holder
    dies; whoever holds the flock knows a torch lock file there is a dead
    builder's, and removes it."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with open(folder / "tandem-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield folder


def load(source_name: str):
    """The compiled module of `csrc/<source_name>.cpp`, or None when it cannot be built here.
    Called on every kernel call: once built, a dict lookup without the lock."""
    module = _modules.get(source_name)
    if module is not None:
        return module
    with _locks[source_name]:
        if source_name not in _modules and source_name not in _errors:
            source = CSRC / f"{source_name}.cpp"
            try:
                from torch.utils.cpp_extension import load as load_extension

                name = f"tandem_{source_name}_{_build_tag(source)}"
                with _build_lock(name) as folder:
                    _modules[source_name] = load_extension(
                        name=name, sources=[str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                        build_directory=str(folder),
                    )
            except Exception as exc:  # no compiler, no ninja, a build error: fall back
                _errors[source_name] = f"{type(exc).__name__}: {exc}"
                log.warning("C++ kernel %s unavailable, using the torch reference: %s", source_name,
                            _errors[source_name][:500])
        return _modules.get(source_name)


def error(source_name: str) -> str | None:
    """Why `load(source_name)` returned None, if it did."""
    return _errors.get(source_name)


def build_all() -> dict[str, str | None]:
    """Build (or load from the cache) every kernel, in parallel; the error of each
    that failed, None for those that built."""
    with ThreadPoolExecutor(len(SOURCES)) as pool:
        list(pool.map(load, SOURCES))
    return {name: error(name) for name in SOURCES}


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    print(f"building the C++ CPU kernels ({', '.join(SOURCES)}); the first time takes about a minute ...",
          flush=True)
    started = time.perf_counter()
    failed = {name: why for name, why in build_all().items() if why}
    for name, why in failed.items():
        print(f"  {name}: not built, the torch reference will be used ({why.splitlines()[0][:200]})")
    print(f"C++ CPU kernels: {len(SOURCES) - len(failed)} of {len(SOURCES)} ready in "
          f"{time.perf_counter() - started:.0f} s")
    sys.exit(0)  # a kernel that does not build is not an error: the references run instead
