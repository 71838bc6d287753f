"""The `tandem` command line's one error type (cluster/cli.py prints it as one line,
exit code 2), apart so that its subcommands' modules raise the class `main`
catches, under `python -m cluster.cli` too (where cluster/cli.py runs as
`__main__`, and importing it again would make a second class)."""


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""
