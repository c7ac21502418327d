"""Run every `console` example of the README and the docs pages and check that the command still prints
what the page shows.

    python docs/check_examples.py             # every example (about 10 minutes on the 2-core machine)
    python docs/check_examples.py --list      # the examples, by page
    python docs/check_examples.py --only "schedule simulate"

A console example is a fenced block of language ``console``: lines starting with ``$ `` are commands
(a trailing backslash continues one), the lines after a command are what it printed. A shown line
must appear in the command's output (stdout and stderr together), in the order shown; a line that is
just ``...`` stands for lines left out, and ``...`` inside a line for text left out of it (a speed,
a time). Whitespace runs compare as one space. So a figure a page quotes from a command's output --
a loss, a byte count, a number of candidates -- is the figure the command prints today, and two
pages that quote one command cannot disagree.

Commands run in a temporary directory with ``JAX_PLATFORMS=cpu`` and ``COLUMNS=80`` (the width the
tables were captured at), and without ``XLA_FLAGS`` (the test suite's flags change the numerics).
Exit status 1 if any example does not hold. `tests/test_docs.py` runs the quick ones in the suite;
this script is the whole check.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
CONSOLE = re.compile(r"^```console\n(.*?)^```", flags=re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Example:
    page: str
    command: str
    shown: tuple[str, ...]

    def argv(self) -> list[str]:
        return shlex.split(self.command)


def examples(pages=PAGES) -> list[Example]:
    found = []
    for page in pages:
        for block in CONSOLE.findall(page.read_text()):
            command, shown = None, []
            lines = block.replace("\\\n", " ").splitlines()
            for line in [*lines, "$ "]:
                if line.startswith("$ "):
                    if command:
                        found.append(Example(str(page.relative_to(ROOT)), command, tuple(shown)))
                    command, shown = line[2:].strip(), []
                else:
                    shown.append(line)
    return found


def _normal(line: str) -> str:
    return " ".join(line.split())


def _pattern(line: str) -> re.Pattern:
    parts = [re.escape(part) for part in _normal(line).split("...")]
    return re.compile("^" + ".*".join(parts) + "$")


def mismatch(shown: tuple[str, ...], output: str) -> str | None:
    """None if every shown line is in the output in order, else the first shown line that is not."""
    printed = [_normal(line) for line in output.replace("\r", "\n").splitlines()]
    at = 0
    for line in shown:
        if _normal(line) in ("...", ""):
            continue
        pattern = _pattern(line)
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        if at == len(printed):
            return line
        at += 1
    return None


def user_env() -> dict[str, str]:
    """The environment a command runs in as a user runs it here: this process's, without ``XLA_FLAGS``
    (the test suite sets its own, which change the numerics), on the CPU, tables 80 columns wide."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu", "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}


def run(example: Example, timeout: float) -> dict:
    env = user_env()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run(
                example.argv(),
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one stream, in the order it was printed
                text=True,
                timeout=timeout,
                check=False,
            )
            output, status = done.stdout, done.returncode
        except subprocess.TimeoutExpired:
            output, status = f"(timed out after {timeout:.0f} s)", None
    missing = mismatch(example.shown, output)
    return {
        "page": example.page,
        "command": example.command,
        "seconds": round(time.perf_counter() - start, 1),
        "status": status,
        "holds": missing is None and status == 0,
        "missing": missing,
        "output_tail": output.splitlines()[-5:],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the examples and exit")
    parser.add_argument("--only", help="run only examples whose command contains this text")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command (default 900)")
    args = parser.parse_args(argv)
    chosen = [e for e in examples() if not args.only or args.only in e.command]
    if args.list:
        for e in chosen:
            print(f"{e.page}: $ {e.command}  ({len(e.shown)} lines shown)")
        return 0
    if not chosen:
        print("no example matches", file=sys.stderr)
        return 2
    failed = 0
    for i, e in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {e.page}: $ {e.command}", flush=True)
        result = run(e, args.timeout)
        if result["holds"]:
            print(f"  holds ({result['seconds']} s)")
            continue
        failed += 1
        why = f"exit status {result['status']}" if result["missing"] is None else f"not printed: {result['missing']!r}"
        print(f"  DOES NOT HOLD ({result['seconds']} s): {why}")
        for line in result["output_tail"]:
            print(f"    | {line}")
    print(f"{len(chosen) - failed} of {len(chosen)} examples hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
