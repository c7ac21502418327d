"""MkDocs hooks: the pages that must not be typed by hand are generated at build time.

- ``cli.md``: every ``jaxmem`` command and option, from the argparse parsers themselves.
- ``benchmarks.md``: the headline figures and every record under ``benchmarks/results``, read from the
  records (and ``benchmarks/check.py``'s checks), with the date each was committed.
- ``concepts/policies.md``'s table of named policies, from ``jaxmem.policy.PRESET_HELP`` and the
  generated policies' names (the ``{{ policies }}`` marker).

A page generated here cannot drift from the code or the records: ``mkdocs build --strict`` (run by
``tests/test_docs.py``) rebuilds it every time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------- CLI
def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
            if action.nargs != 0 and action.metavar != "":
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
        if action.choices and not isinstance(action.choices, dict):
            what = f"{_cell(action.help or '')} (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        else:
            what = _cell(action.help or "")
        rows.append(f"| {name} | {shown} | {what} |")
    return rows


def _command_sections(parser: argparse.ArgumentParser, prog: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{prog}`", ""]
    if parser.description:
        out += [parser.description.strip().replace("\n", " "), ""]
    rows = _option_rows(parser)
    if rows:
        out += ["| option | default | what it does |", "|---|---|---|", *rows, ""]
    if parser.epilog:  # the examples and notes `--help` ends with
        out += ["```text", parser.epilog.strip("\n"), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if helps.get(name) and not sub.description:
                    sub.description = helps[name]
                out += _command_sections(sub, f"{prog} {name}", min(level + 1, 4))
    return out


def cli_page() -> str:
    from jaxmem.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")
    parser = build_parser()
    head = [
        "# Command-line reference",
        "",
        "Generated from the `jaxmem` argument parsers when these docs are built, so it lists exactly the",
        "options the installed `jaxmem` takes. `jaxmem COMMAND --help` prints the same in a terminal.",
        "",
    ]
    return "\n".join(head + _command_sections(parser, "jaxmem", 2)) + "\n"


# ----------------------------------------------------------------------------------------- records
def _load_check_module():
    """benchmarks/check.py, imported as the tests import it (its folder on the path)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import check

    return check


def _committed(path: str) -> str:
    """When and in which commit a record was last written: the release its figures are of."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct %h", "--", path], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not out:
        return "not committed yet"
    return f"{time.strftime('%Y-%m-%d', time.gmtime(int(out[0])))} in commit `{out[1]}`"


def _scalars(record: dict) -> list[str]:
    skip = {"benchmark", "command", "note", "jax", "xla_flags"}
    out = []
    for key, value in record.items():
        if key in skip or isinstance(value, dict | list) or value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        out.append(f"{key} = {_cell(value)}")
    return out


def benchmarks_page() -> str:
    check = _load_check_module()
    out = [
        "# Benchmarks and their records",
        "",
        "Generated from `benchmarks/results/*.json` and `benchmarks/check.py` when these docs are built:",
        "no figure on this page is typed by hand. Each record says the command that made it; a record is",
        "*stale* when the code it measures was committed after it (`python benchmarks/check.py --stale`),",
        "and its figures are then the earlier release's until the benchmark is rerun. Timing figures were",
        "measured on the 2-core development machine and vary by 10-30% between runs there; byte figures",
        "for a GPU or TPU come from that target's compiler (see [Targets](guides/targets.md)).",
        "",
        "## Headline figures",
        "",
        "`python benchmarks/check.py` reruns each of these small and compares it with its record.",
        "",
        "| figure | system | recorded | bar | record | committed | stale |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in check.CHECKS:
        record = json.loads((check.RESULTS / c.record).read_text())
        try:
            figure = f"{c.figure(record):.4g}"
        except (KeyError, StopIteration, TypeError):
            figure = "not in record"
        bar = "" if c.bar is None else f"{c.bar[0]} {c.bar[1]:g}"
        stale = check.staleness(c)
        verdict = f"yes ({stale['commits_since_record']} commits since)" if stale["stale"] else "no"
        committed = stale["record_committed"]
        out.append(f"| {_cell(c.name)} | {c.system} | {figure} | {bar} | `{c.record}` | {committed} | {verdict} |")
    out += ["", "## Every record", ""]
    for path in sorted(check.RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        out += [f"### `{path.name}`", ""]
        if not isinstance(record, dict):
            out += ["(a list of rows; see the file)", ""]
            continue
        command = record.get("command")
        if command:
            out += ["```bash", command if isinstance(command, str) else " ".join(command), "```", ""]
        else:
            script = record.get("benchmark")
            said = f"`benchmarks/{script}.py`" if script else "its benchmark script"
            out += [f"Made by {said}; the record does not store its command line.", ""]
        out.append(f"Recorded {_committed(f'benchmarks/results/{path.name}')}.")
        facts = _scalars(record)
        if facts:
            out += ["", "- " + "\n- ".join(f"`{f}`" for f in facts)]
        out.append("")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- policies
def policies_table() -> str:
    from jaxmem.config import GENERATED_POLICIES
    from jaxmem.policy import PRESET_HELP

    rows = ["| policy | kind | what it keeps |", "|---|---|---|"]
    rows += [f"| `{name}` | preset | {_cell(text)} |" for name, text in PRESET_HELP.items()]
    rows += [
        f"| `{name}` | generated under `--budget` | see [ChronosPipe](../guides/chronospipe.md) |"
        for name in GENERATED_POLICIES
    ]
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ API
API_PAGES = {  # page -> (title, packages); each package's public names are those it re-exports
    "jaxmem": ("jaxmem", ("jaxmem",)),
    "train": ("Training", ("jaxmem.train", "jaxmem.config")),
    "schedule": ("Schedules", ("jaxmem.schedule",)),
    "pipeline": ("Pipeline executor", ("jaxmem.pipeline",)),
    "policy": ("Policies", ("jaxmem.policy",)),
    "memory": ("Ledger and time model", ("jaxmem.memory",)),
    "search": ("Planner", ("jaxmem.search",)),
    "profiler": ("Profiler", ("jaxmem.profiler",)),
    "roam": ("ROAM", ("jaxmem.roam", "jaxmem.layout")),
    "elastic": ("Elastic", ("jaxmem.elastic",)),
    "models": ("Models", ("jaxmem.models",)),
    "data": ("Data", ("jaxmem.data",)),
    "targets": ("Targets", ("jaxmem.targets",)),
    "verify": ("Verify", ("jaxmem.verify",)),
}


def public_names(package: str) -> list[str]:
    """A package's public API as its source declares it: ``__all__`` where it has one, else the names
    it re-exports (``from jaxmem.x._y import Name as Name``) and its own public definitions, in order."""
    import ast

    parts = package.split(".")
    path = ROOT.joinpath(*parts)
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(source.read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
        if isinstance(node, ast.ImportFrom):
            names += [a.name for a in node.names if a.asname == a.name and not a.name.startswith("_")]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            names.append(node.name)
    return list(dict.fromkeys(names))


def api_page(title: str, packages: tuple[str, ...]) -> str:
    out = [f"# {title}", ""]
    for package in packages:
        members = public_names(package)
        out += [f"::: {package}", "    options:", "      members:"]
        out += [f"        - {name}" for name in members] or ["        - __none__"]
        out.append("")
    return "\n".join(out)


GENERATED = {"cli.md": cli_page, "benchmarks.md": benchmarks_page}


def on_files(files, config):
    for name, make in GENERATED.items():
        files.append(File.generated(config, name, content=make()))
    for name, (title, packages) in API_PAGES.items():
        files.append(File.generated(config, f"api/{name}.md", content=api_page(title, packages)))
    return files


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):(<code>)~?")


def on_page_content(html, page, config, files):
    """Docstrings cite names the Sphinx way (``:func:`~jaxmem.x.y```); show the name, not the role."""
    return _ROLE.sub(r"\1", html)


def on_page_markdown(markdown, page, config, files):
    if "{{ policies }}" in markdown:
        markdown = markdown.replace("{{ policies }}", policies_table())
    return markdown
