"""Argument types of the `tandem bench` options, so that a count, size, rate or
duration out of its range, or a list with a bad item, is refused by argparse with
one line naming the option (`--capacity -1` reached the Poisson arrivals and ended
in a traceback, and so did `--rows 1,x` in the kernels benchmark)."""

from __future__ import annotations

import argparse


def _number(kind, accepts, wanted: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value
    return parse


positive_int = _number(int, lambda v: v > 0, "an integer > 0")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
# (finite: `--capacity inf` passed, and failed after the cluster was up, OverflowError)
positive_float = _number(float, lambda v: 0 < v < float("inf"), "a number > 0")
non_negative_float = _number(float, lambda v: 0 <= v < float("inf"), "a number >= 0")
fraction = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
# (an SLO's attainment target: 0 passed, and the autoscale run's app refused it after minutes of calibration)
attainment_target = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def int_between(low: int, high: int | None = None):
    """An integer in [low, high] (no bound above where None): `--drafts 17`
    failed once the model was loaded, minutes in."""
    return _number(int, lambda v: v >= low and (high is None or v <= high),
                   f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]")


def _numbers(kind, accepts, wanted: str):
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, comma-separated, got {text!r}") from None
        if not all(map(accepts, values)):
            raise argparse.ArgumentTypeError(f"must be {wanted}, comma-separated, got {text!r}")
        return values
    return parse


positive_ints = _numbers(int, lambda v: v > 0, "integers > 0")  # `--lengths 64,512,1800`
non_negative_floats = _numbers(float, lambda v: 0 <= v < float("inf"), "numbers >= 0")  # `--long-at-s 1,2.5`


def names(*allowed: str):
    """A comma-separated choice among `allowed` (`--sections linear,sampling`), in
    the order given; an unknown name is refused (it was a traceback, or silently
    ran nothing)."""
    def parse(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        if not chosen or any(name not in allowed for name in chosen):
            raise argparse.ArgumentTypeError(f"must be names from {', '.join(allowed)}, comma-separated, got {text!r}")
        return chosen
    return parse


def rates(text: str) -> str:
    """Comma-separated offered rates, req/s, each > 0 (`--rates 2,4,8`), checked up
    front and kept as written (a bad one surfaced minutes later, after the apps
    were deployed)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be rates > 0 in req/s, comma-separated, got {text!r}") from None
    if not all(value > 0 and value != float("inf") for value in values):
        raise argparse.ArgumentTypeError(f"must be rates > 0 in req/s, comma-separated, got {text!r}")
    return text


def block_size(text: str) -> int:
    """A KV block size the engine takes: 16, 32 or 64."""
    if text not in ("16", "32", "64"):
        raise argparse.ArgumentTypeError(f"must be 16, 32 or 64, got {text!r}")
    return int(text)


def preset(text: str) -> str:
    """A built-in model preset's name (actors/model_builder.py)."""
    from actors.model_shapes import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(sorted(PRESETS))}, got {text!r}")
    return text


def arch(text: str) -> str:
    """A built-in model architecture's name (actors/model_builder.py)."""
    from actors.model_shapes import ARCH_SPECS

    if text not in ARCH_SPECS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(ARCH_SPECS)}, got {text!r}")
    return text
