"""The package layering holds: each layer imports only layers below it.

Floors, lowest first: errors/util/layout -> schedule -> policy -> models ->
pipeline -> verify -> memory (cost) -> search/profiler/roam -> data/config ->
train -> elastic -> cli. No package imports the CLI, and no package imports
another package's underscore modules (only its public ``__init__``).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxmem"

FLOORS = {
    "_errors": 0,
    "_util": 0,
    "layout": 0,
    "schedule": 1,
    "policy": 2,
    "models": 3,
    "pipeline": 4,
    "verify": 4.5,
    "memory": 5,
    "search": 6,
    "profiler": 6,
    "roam": 6,
    "data": 6.5,
    "config": 6.5,
    "train": 7,
    "elastic": 8,
    "cli": 9,
    "__main__": 9,
}


def _imports(path, root):
    """(line, module) for every ``jaxmem.*`` import in ``path``, relative ones resolved."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("jaxmem"):
                yield node.lineno, module
                for alias in node.names:  # ``from jaxmem import _util``
                    if module == "jaxmem":
                        yield node.lineno, f"jaxmem.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxmem"):
                    yield node.lineno, alias.name


def _package(path, root):
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _violations(root=ROOT):
    found = []
    for path in sorted(root.rglob("*.py")):
        pkg = _package(path, root)
        if pkg == "__init__":
            continue
        for line, module in _imports(path, root):
            parts = module.split(".")
            if len(parts) < 2:
                continue
            target = parts[1]
            where = f"{path.relative_to(root.parent)}:{line} imports {module}"
            if target == pkg or target == "__version__":
                continue
            if target == "cli" and pkg != "__main__":
                found.append(f"{where}: only the CLI may import the CLI")
            if len(parts) > 2 and parts[2].startswith("_"):
                found.append(f"{where}: a private module of another package")
            if pkg not in FLOORS or target not in FLOORS:
                found.append(f"{where}: package without a floor; add it to FLOORS")
            elif FLOORS[target] > FLOORS[pkg]:
                found.append(f"{where}: {pkg} (floor {FLOORS[pkg]}) imports upward")
    return found


def test_every_package_has_a_floor():
    packages = {_package(p, ROOT) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages <= set(FLOORS), sorted(packages - set(FLOORS))


def test_no_upward_cli_or_private_imports():
    assert _violations() == []


def test_the_check_can_fail(tmp_path):
    """The checker flags a planted upward, CLI and private import."""
    fake = tmp_path / "jaxmem"
    (fake / "policy").mkdir(parents=True)
    (fake / "policy" / "bad.py").write_text(
        "from jaxmem.train import Trainer\n"
        "from jaxmem.cli import main\n"
        "from jaxmem.schedule._validate import lockstep_ticks\n"
        "from ..models._interface import StagedModel\n"
    )
    found = _violations(fake)
    assert any("imports upward" in v and "jaxmem.train" in v for v in found)
    assert any("only the CLI" in v for v in found)
    assert any("schedule._validate" in v for v in found)
    assert any("models._interface" in v for v in found)
