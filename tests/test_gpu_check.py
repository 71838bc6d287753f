"""The GPU check's steps run end to end on CPU (tiny model, kernels under Triton's
interpreter): a smoke run of the script a GPU machine will run, so it does not
first fail there. The figures of a CPU run mean nothing; the plumbing does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_gpu_check_steps_run_on_cpu(tmp_path):
    root = Path(__file__).parent.parent
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--steps", "kernels,exactness,roofline,graphs",
           "--prefill-tokens", "128", "--decode-batch", "4", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0 and results["ok"], (done.stdout[-2000:], done.stderr[-2000:], results)
    assert set(results["steps"]) == {"kernels", "exactness", "roofline", "graphs"}
    assert results["steps"]["exactness"]["identical"] == results["steps"]["exactness"]["prompts"]
    roofline = results["steps"]["roofline"]
    assert roofline["prefill_mfu"] > 0 and roofline["decode_mbu"] > 0 and roofline["decode_forward_mbu"] > 0
    graphs = results["steps"]["graphs"]  # on CPU: the padded static step, not captured
    assert set(graphs["identical_greedy"].values()) == {graphs["prompts"]} and not graphs["captured"]
    assert graphs["identical_sampled_with_overlap"] == graphs["prompts"] and graphs["steps_launched_ahead"] > 0
    assert graphs["identical_with_speculation"] == 2 * graphs["prompts"] and graphs["drafts_confirmed"] > 0


def test_gpu_check_script_says_what_it_needs_without_a_gpu(tmp_path):
    root = Path(__file__).parent.parent
    done = subprocess.run(["bash", str(root / "benchmarks/gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, cwd=root, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path),
                                                      "PYTHON": sys.executable})
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, (done.stdout, done.stderr)
