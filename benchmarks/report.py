"""Shared helpers for the benchmarks: statistics, Markdown tables, JSON results and
the headline line.

Plain Python (no torch): every benchmark module imports this at the top, so the
`tandem` CLI stays fast. Contract of a benchmark's output: a Markdown table (or
several), then the JSON file at `args.out`, then as the very LAST line printed
`NAME: <headline figure> (goal <goal>)`; `finish()` does the last two in order.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path


# ---- statistics --------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order
    statistics (numpy's default method). Raises ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements, and the relative spread
    (max - min) / median (0.0 for a single measurement)."""
    mid = median(values)
    low, high = min(values), max(values)
    return {
        "median": mid,
        "min": low,
        "max": high,
        "rel_spread": (high - low) / mid if mid else 0.0,
        "n": len(values),
    }


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is zero or missing."""
    if not denominator:
        return None
    return numerator / denominator


# ---- formatting --------------------------------------------------------------
def fmt(value, digits: int = 3) -> str:
    """A table cell: numbers to `digits` significant figures, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = math.floor(math.log10(abs(value)))
        decimals = max(0, digits - 1 - magnitude)
        return f"{value:.{decimals}f}"
    return str(value)


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub Markdown table; cells go through `fmt`, pipes are escaped."""
    if any(len(row) != len(headers) for row in rows):
        raise ValueError(f"every row needs {len(headers)} cells")

    def cell(value) -> str:
        return fmt(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    print(f"\n### {title}\n")
    print(markdown_table(headers, rows))


def headline(name: str, figure: str, goal: str) -> str:
    """`NAME: <figure> (goal <goal>)`, the last line every benchmark prints."""
    return f"{name}: {figure} (goal {goal})"


# ---- results -----------------------------------------------------------------
def write_json(path: str | Path, payload: dict) -> Path:
    """Write `payload` as indented JSON, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def machine_info() -> dict:
    """What the numbers were measured on. Cheap; torch only if already imported."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
    }
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def finish(name: str, out: str | Path, payload: dict, figure: str, goal: str) -> str:
    """Write the JSON results, then print the headline as the last line. Returns it."""
    payload = {"benchmark": name, "headline": headline(name, figure, goal), **payload}
    path = write_json(out, payload)
    print(f"\nresults written to {path}")
    line = headline(name, figure, goal)
    print(line, flush=True)
    return line
