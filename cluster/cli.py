"""The `tandem` command line: build models, run the offline demo, benchmarks.

Every subcommand turns bad input into a one-line message on stderr and exit code 2;
no traceback reaches the user for a mistake they can fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _cmd_make_model(args: argparse.Namespace) -> None:
    from actors.model_builder import PRESETS, build_checkpoint

    if args.preset not in PRESETS:
        raise CliError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    out = build_checkpoint(args.preset, args.arch, Path(args.out), progress=True)
    print(f"wrote {args.preset}/{args.arch} checkpoint to {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a deterministic HF checkpoint folder")
    make.add_argument("--preset", required=True, help="tiny | bench")
    make.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    make.add_argument("--out", required=True, help="output folder")
    make.set_defaults(func=_cmd_make_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except CliError as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
