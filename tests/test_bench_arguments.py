"""`tandem bench` options out of range are refused by argparse, one line naming
the option, before any benchmark runs (a negative capacity reached the Poisson
arrivals and ended in a traceback). Every numeric option of every benchmark has
a ranged type; only a seed takes any integer. Every list option is parsed by
its type too, a bad item or unknown name refused up front."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import arguments
from cluster.cli import build_parser, main

RANGED = {arguments.positive_int, arguments.non_negative_int, arguments.positive_float,
          arguments.non_negative_float, arguments.fraction}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    return _subcommands(_subcommands(build_parser())["bench"])


def test_every_numeric_option_has_a_range():
    for name, parser in _bench_parsers().items():
        for action in parser._actions:
            if action.type in (int, float):
                assert action.dest == "seed", f"tandem bench {name} {action.option_strings[0]}: give it a range"


def test_every_list_option_is_parsed_by_its_type():
    """A list kept as text was split where it was used, minutes into a run: a bad
    item was a traceback (`--rows 1,x`), an unknown name one (`--workloads`) or
    nothing run at all (`--sections`)."""
    for name, parser in _bench_parsers().items():
        for action in parser._actions:
            if isinstance(action.default, str) and "," in action.default:
                assert action.type is not None, f"tandem bench {name} {action.option_strings[0]}: give it a type"


def test_every_preset_option_is_checked_against_the_presets():
    """An unknown preset was a traceback from the model builder, or from the
    settings inside a Serve deployment (`tandem bench serve`)."""
    presets = {name: action for name, parser in _bench_parsers().items()
               for action in parser._actions if action.dest == "preset"}
    assert len(presets) >= 8
    for name, action in presets.items():
        assert action.type is arguments.preset, f"tandem bench {name} --preset: give it type=preset"


@pytest.mark.parametrize("argv, message", [
    (["overload", "--capacity", "-1"], "argument --capacity: must be a number > 0, got '-1'"),
    (["serve", "--attainment", "1.5"], "argument --attainment: must be a number in (0, 1], got '1.5'"),
    # found by a review: the autoscale run's app refused it, after minutes of calibration
    (["autoscale", "--attainment", "0"], "argument --attainment: must be a number in (0, 1], got '0'"),
    (["engine", "--repeats", "0"], "argument --repeats: must be an integer > 0, got '0'"),
    (["kernels", "--threads", "x"], "argument --threads: must be an integer >= 0, got 'x'"),
    (["transfer", "--preset", "nope"], "argument --preset: must be one of bench, qwen2.5-0.5b, tiny, got 'nope'"),
    (["predictions", "--lengths", "64,0"], "argument --lengths: must be integers > 0, comma-separated, got '64,0'"),
    (["serve", "--rates", "abc"], "argument --rates: must be rates > 0 in req/s, comma-separated, got 'abc'"),
    (["overload", "--rates", "2,-1"], "argument --rates: must be rates > 0 in req/s, comma-separated, got '2,-1'"),
    (["engine", "--block-size", "7"], "argument --block-size: must be 16, 32 or 64, got '7'"),
    (["kernels", "--rows", "1,x"], "argument --rows: must be integers > 0, comma-separated, got '1,x'"),
    (["kernels", "--sections", "linear,bogus"],
     "argument --sections: must be names from linear, attention, sampling, block_tables, none, comma-separated, "
     "got 'linear,bogus'"),
    (["engine", "--workloads", ","], "argument --workloads: must be names from mixed, equal, comma-separated, got ','"),
    (["handshake", "--long-at-s", "1,a"], "argument --long-at-s: must be numbers >= 0, comma-separated, got '1,a'"),
    # found by a review: each parsed, and overflowed (or looped) once the cluster was up
    (["overload", "--capacity", "inf"], "argument --capacity: must be a number > 0, got 'inf'"),
    (["soak", "--think-s", "inf"], "argument --think-s: must be a number >= 0, got 'inf'"),
    # found by a review: each failed once the model was loaded, in a traceback
    (["speculative", "--drafts", "17"], "argument --drafts: must be an integer in [1, 16], got '17'"),
    (["roofline", "--decode-tokens", "1"], "argument --decode-tokens: must be an integer >= 2, got '1'"),
])
def test_an_option_out_of_range_is_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", *argv])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"tandem bench {argv[0]}: error: {message}"


def test_a_request_the_engine_refuses_is_one_line(capsys, tmp_path):
    """Found by a review: a prompt past the model's context was a traceback."""
    argv = ["bench", "host", "--preset", "tiny", "--prompt-tokens", "99999", "--out", str(tmp_path / "host.json")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("tandem bench: prompt has 99999 tokens; the model's context is ")


def test_in_range_values_parse():
    args = build_parser().parse_args(["bench", "kernels", "--threads", "0"])
    assert args.threads == 0
    args = build_parser().parse_args(["bench", "soak", "--think-s", "0", "--cancel-share", "1"])
    assert (args.think_s, args.cancel_share) == (0.0, 1.0)


def test_an_out_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path):
    """A full run takes minutes to hours and writes its results at the end: an
    unwritable --out was a traceback then, and the run lost."""
    (tmp_path / "a-file").write_text("")
    for out, said in ((tmp_path / "a-file" / "results.json",
                       f"cannot write --out {tmp_path}/a-file/results.json: a file stands where its folder would be"),
                      (tmp_path, f"--out {tmp_path} is a folder: give a file's path (results.json)")):
        assert main(["bench", "kernels", "--sections", "none", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"tandem bench: {said}\n"
        assert captured.out == ""  # the benchmark did not run
    fresh = tmp_path / "new" / "folder" / "results.json"
    assert main(["bench", "kernels", "--sections", "none", "--out", str(fresh)]) == 0
    assert fresh.exists()  # its folder made, its results written


def test_a_soak_manifest_that_is_missing_or_not_valid_is_one_line(capsys, tmp_path):
    """A missing file was a FileNotFoundError, a RayService a KeyError, a bad setting a
    pydantic traceback once the cluster was up."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - name: t\n    import_path: cluster.app:build_app\n"
                   "    args: {model: {preset: tiny}, slo: {ttft_ms: -1}}\n")
    for manifest, said in ((tmp_path / "none.yaml", "No such file or directory"), (bad, "slo.ttft_ms")):
        assert main(["bench", "soak", "--manifest", str(manifest), "--out", str(tmp_path / "r.json")]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"tandem bench: --manifest {manifest} is not valid:") and said in captured.err
        assert "Traceback" not in captured.err and captured.out == ""
