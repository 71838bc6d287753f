"""The `tandem` command line: build models, run the offline demo, check manifests,
look at and drain a running deployment's pools, benchmarks.

Every subcommand turns bad input into a one-line message on stderr and exit code 2;
no traceback reaches the user for a mistake they can fix.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

from actors.checkpoint_error import CheckpointError
from actors.model_shapes import ARCH_SPECS, UnknownModel
from cluster.cli_error import CliError
from cluster.pool_cli import add_pool_commands


def _cmd_make_model(args: argparse.Namespace) -> None:
    from actors.model_builder import BUILD_STAMP, build_checkpoint

    if not args.out.strip():
        raise CliError("--out is empty: give the folder to write the checkpoint to")
    out_dir = Path(args.out)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / BUILD_STAMP).exists():
        # (a build replaces a folder's config, tokenizer and weights: another checkpoint's, once)
        raise CliError(f"{args.out} holds files, and no checkpoint this command wrote: give an empty or new "
                       "folder (it would replace what is there)")
    try:
        out = build_checkpoint(args.preset, args.arch, Path(args.out), progress=True)
    except OSError as exc:
        raise CliError(f"cannot write the checkpoint to {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {args.preset}/{args.arch} checkpoint to {out}")


def _cmd_demo(args: argparse.Namespace) -> None:
    from actors.llm import LLM
    from actors.model_builder import ensure_checkpoint
    from actors.sampling_params import InvalidRequestError, SamplingParams

    if args.model is not None and not args.model.strip():  # (--model "$UNSET": not the built-in model)
        raise CliError("--model is empty: give a checkpoint folder, or leave --model out for a built-in one")
    if args.model is not None and (args.preset, args.arch) != (None, None):  # (both were taken: the folder ran)
        raise CliError("--preset and --arch name a built-in model: give them, or --model, not both")
    model_dir = Path(args.model) if args.model else ensure_checkpoint(args.preset or "tiny", args.arch or "qwen2")
    llm = LLM(model_dir, block_size=16, prefill_chunk_size=64)
    prompts = args.prompt or ["The quick brown fox", "Serving language models on Ray", "Prefill and decode"]
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as exc:
        raise CliError(str(exc)) from None
    for prompt, out in zip(prompts, outputs):
        print(f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason.value})")


def _cmd_check_cluster(args: argparse.Namespace) -> None:
    from cluster.cluster_check import check_cluster_config

    problems = check_cluster_config(args.config)
    if problems:
        raise CliError(f"{args.config} is not valid:\n  " + "\n  ".join(problems))
    print(f"{args.config}: valid (Ray's cluster schema and Tandem's node roles)")


def _cmd_check_manifest(args: argparse.Namespace) -> None:
    from cluster.manifest_check import check_manifest

    problems = check_manifest(args.manifest, local=args.local)
    if problems:
        raise CliError(f"{args.manifest} is not valid:\n  " + "\n  ".join(problems))
    print(f"{args.manifest}: valid (Serve's config schema and Tandem's settings)")


def _add_benchmarks(sub) -> None:
    from benchmarks import BENCHMARKS

    bench = sub.add_parser("bench", help="run a benchmark (Markdown table, JSON results)")
    names = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        parser = names.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0])
        parser.add_argument("--out", default=f"benchmarks/results/{name}.json", help="JSON results file")
        module.add_arguments(parser)
        parser.set_defaults(func=_checked_out(module.main))


def _checked_out(run):
    """A benchmark's main, run only once its `--out` can be written: a full run
    takes minutes to hours, and it wrote its results only at the end (an
    unwritable path was a traceback then, and the run lost)."""

    def checked(args: argparse.Namespace) -> None:
        out = Path(args.out)
        if out.is_dir():
            raise CliError(f"--out {out} is a folder: give a file's path (results.json)")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out.parent):  # (a file can be made there: root's access() says yes to all)
                pass
        except (FileExistsError, NotADirectoryError):
            raise CliError(f"cannot write --out {out}: a file stands where its folder would be") from None
        except OSError as exc:
            raise CliError(f"cannot write --out {out}: {exc.strerror or exc}") from None
        run(args)

    return checked


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a deterministic HF checkpoint folder")
    make.add_argument("--preset", required=True, help="tiny | bench | qwen2.5-0.5b")
    make.add_argument("--arch", choices=list(ARCH_SPECS), default="qwen2")
    make.add_argument("--out", required=True, help="output folder")
    make.set_defaults(func=_cmd_make_model)

    demo = sub.add_parser("demo", help="generate offline with the built-in model (no Ray)")
    demo.add_argument("--model", help="checkpoint folder (default: the built-in preset)")
    demo.add_argument("--preset", help="a built-in model (default: tiny)")
    demo.add_argument("--arch", choices=list(ARCH_SPECS), help="its architecture (default: qwen2)")
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.add_argument("--temperature", type=float, default=0.7)
    demo.set_defaults(func=_cmd_demo)

    check = sub.add_parser("check-cluster", help="validate a ray_cluster.yaml offline")
    check.add_argument("config", help="cluster-launcher YAML")
    check.set_defaults(func=_cmd_check_cluster)

    manifest = sub.add_parser("check-manifest", help="validate a Serve manifest (serve run / serve deploy) offline")
    manifest.add_argument("manifest", help="Serve config YAML, or a RayService")
    manifest.add_argument("--local", action="store_true",
                          help="served from this machine: its model.path must be a checkpoint folder here")
    manifest.set_defaults(func=_cmd_check_manifest)

    add_pool_commands(sub)  # tandem pools, tandem drain (cluster/pool_cli.py)
    _add_benchmarks(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except _one_line_errors() as exc:  # (evaluated only when something was raised)
        print(f"tandem {args.command}: {_said(exc)}", file=sys.stderr)
        return 2
    return 0


def _said(exc: Exception) -> str:
    """An error's line: an OSError's as `<why>: <path>`, without its errno."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def _one_line_errors() -> tuple[type[Exception], ...]:
    """What a command says in one line: a request an engine refuses too (a
    benchmark's `--prompt-tokens` past the model's context was a traceback),
    whose module, loading torch, is imported only then; and an OSError the
    command met on a path it was given (`File name too long`, from an
    `is_dir()` Python 3.11 lets it through)."""
    from actors.sampling_params import InvalidRequestError

    return CliError, CheckpointError, UnknownModel, InvalidRequestError, OSError


if __name__ == "__main__":
    sys.exit(main())
