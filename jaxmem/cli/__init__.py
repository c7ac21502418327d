"""The `jaxmem` command line; each subcommand module imports JAX only if it needs it."""

from __future__ import annotations

import argparse
import sys

from jaxmem._errors import JaxmemError, settings_phrased_by
from jaxmem.cli._flags import flag

__all__ = ["main"]

_DESCRIPTION = """\
jaxmem trains language models that do not fit in accelerator memory: pipeline schedules as data,
recompute/offload policies per stage, an honest memory ledger, and planners that pick them under a
budget. Run `jaxmem COMMAND --help` for one command's options."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in two lines (what is wrong, where the options are), not the whole usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from jaxmem.cli import schedule as schedule_cli

    parser = _Parser(prog="jaxmem", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    schedule_cli.add_parser(sub)
    for module_name in _optional_commands():
        module = __import__(f"jaxmem.cli.{module_name}", fromlist=["add_parser"])
        module.add_parser(sub)
    return parser


def _optional_commands() -> list[str]:
    """Subcommand modules beyond ``schedule``; each defines ``add_parser(subparsers)``."""
    import importlib.util

    names = ["train", "export", "verify", "memory", "plan", "roam", "launch", "elastic"]
    return [n for n in names if importlib.util.find_spec(f"jaxmem.cli.{n}") is not None]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from jaxmem import __version__

        print(__version__)
        return 0
    if not getattr(args, "run", None):
        if args.command is None:
            parser.print_help()
            return 0
        # A command of several actions, given none: one line, not the whole usage.
        print(f"error: jaxmem {args.command} needs an action; see jaxmem {args.command} --help", file=sys.stderr)
        return 2
    from jaxmem.cli._common import prefer_cpu_when_alone

    prefer_cpu_when_alone()
    try:
        with settings_phrased_by(flag):  # the library's errors name its settings by their flags
            return int(args.run(args) or 0)
    except JaxmemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
