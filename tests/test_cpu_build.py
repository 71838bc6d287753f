"""Building the C++ CPU kernels (kernels/cpu_build.py): a build killed midway
leaves torch's lock file behind, and the next load must not wait on it forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

LOAD_WITH_A_DEAD_BUILDERS_LOCK = textwrap.dedent("""
    from pathlib import Path
    from torch.utils.cpp_extension import _get_build_directory
    from kernels import cpu_build

    name = f"tandem_norm_rope_{cpu_build._build_tag(cpu_build.CSRC / 'norm_rope.cpp')}"
    stale = Path(_get_build_directory(name, verbose=False)) / "lock"
    stale.touch()  # what a builder killed mid-build leaves
    module = cpu_build.load("norm_rope")
    print("built" if module is not None else "unbuilt", stale.exists())
""")


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    done = subprocess.run([sys.executable, "-c", LOAD_WITH_A_DEAD_BUILDERS_LOCK], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, lock_left = done.stdout.split()[-2:]
    assert loaded == "built" and lock_left == "False", done.stdout + done.stderr[-2000:]
