"""Every flag and subcommand the `jaxmem ...` commands of the README and the docs pages name exists: a
flag renamed or never added fails here (the README once showed `jaxmem memory ... --split-backward`, a flag that command
did not have). Commands the prose names in part (`jaxmem plan --hardware cpu`) may leave out
required arguments; only unknown flags, subcommands and choices fail."""

import contextlib
import io
import re
import shlex

import pytest
from docs_text import all_text

from jaxmem.cli import build_parser

README = all_text()
FENCED = re.compile(r"```[a-z]*\n(.*?)```", flags=re.S)


def _commands() -> list[str]:
    found = []
    for block in FENCED.findall(README):  # continuation lines joined, comments dropped
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().removeprefix("$ ")
            if line.startswith("jaxmem "):
                found.append(line)
    prose = FENCED.sub("", README).split("`")
    found += [" ".join(span.split()) for span in prose[1::2] if span.startswith("jaxmem ")]
    found = [part.strip() for c in found for part in c.split("&&") if part.strip().startswith("jaxmem ")]
    # Placeholders (FILE, S, [--format hf]) and elisions are not commands to parse.
    return sorted({c for c in found if not re.search(r"\.\.\.|<|\[|\b[A-Z]+\b", c)})


COMMANDS = _commands()


def test_the_readme_shows_commands():
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_names_only_what_exists(command):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(shlex.split(command)[1:])
        except SystemExit:
            pass
    for unknown in ("unrecognized arguments", "invalid choice", "ambiguous option"):
        assert unknown not in err.getvalue(), f"`{command}`: {err.getvalue()}"
