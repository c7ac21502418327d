"""The package layering holds: each layer imports only layers strictly below it.

Floors, lowest first: errors/layout -> util -> schedule/data -> policy -> models -> pipeline/roam ->
memory/verify -> search/profiler -> config -> train -> elastic -> cli. Packages on one floor do not
import each other. No package imports the CLI, another package's underscore modules, or an
underscore name from another package (only the names its public ``__init__`` offers). Inside a
package, modules import each other without a cycle, function-level imports included (an import
under ``if TYPE_CHECKING:`` is for annotations and runs never). Packages a CLI command touches before
it sets up devices import no JAX.
"""

import ast
import collections
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxmem"

FLOORS = {
    "_errors": 0,
    "layout": 0,
    "_util": 0.5,
    "targets": 0.6,  # compile targets: compile-only devices of an accelerator (JAX imported when asked)
    "schedule": 1,
    "data": 1,
    "policy": 2,
    "models": 3,
    "pipeline": 4,
    "roam": 4,
    "memory": 5,
    "verify": 5,
    "search": 6,
    "profiler": 6,
    "config": 6.5,  # resolves policies (a generated one through search) and checks hardware names (memory)
    "train": 7,
    "elastic": 8,
    "cli": 9,
    "__main__": 10,
}

# Imported by the CLI before it sets the device count: JAX must not start here (XLA_FLAGS would come
# too late), nor in `import jaxmem` itself.
LIGHT = ("jaxmem", "jaxmem.schedule", "jaxmem.policy", "jaxmem.config", "jaxmem.data", "jaxmem.search",
         "jaxmem.memory", "jaxmem.cli", "jaxmem._util", "jaxmem.layout", "jaxmem.targets")  # fmt: skip


def _type_checking_lines(tree) -> set[int]:
    """Line numbers of the statements under ``if TYPE_CHECKING:``."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path, root):
    """``(line, module, names, runtime)`` for every ``jaxmem.*`` import in ``path`` (relative ones
    resolved; ``names``: what a ``from`` import takes; ``runtime``: not only for type checkers)."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_lines(tree)
    for node in ast.walk(tree):
        runtime = getattr(node, "lineno", 0) not in typing_only
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("jaxmem"):
                names = [alias.name for alias in node.names]
                yield node.lineno, module, names, runtime
                for name in names:  # ``from jaxmem import _util``, ``from jaxmem.train import _loop``
                    yield node.lineno, f"{module}.{name}", [], runtime
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxmem"):
                    yield node.lineno, alias.name, [], runtime


def _package(path, root):
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _modules(root):
    """Every module of the tree as ``(dotted name, path)``; a package's ``__init__`` by the package's name."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _violations(root=ROOT):
    found = []
    known = {name for name, _ in _modules(root)}
    for path in sorted(root.rglob("*.py")):
        pkg = _package(path, root)
        if pkg == "__init__":
            continue
        for line, module, names, _ in _imports(path, root):
            if module not in known and module.rsplit(".", 1)[0] in known:
                continue  # ``from jaxmem.x import name``'s name: judged with its module below
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
            private = [n for n in names if n.startswith("_") and f"{module}.{n}" not in known]
            if private:
                found.append(f"{where}: private name(s) {', '.join(private)} of another package")
            if pkg not in FLOORS or target not in FLOORS:
                found.append(f"{where}: package without a floor; add it to FLOORS")
            elif FLOORS[target] > FLOORS[pkg]:
                found.append(f"{where}: {pkg} (floor {FLOORS[pkg]}) imports upward")
            elif FLOORS[target] == FLOORS[pkg]:
                found.append(f"{where}: {pkg} and {target} share floor {FLOORS[pkg]}; one must sit below the other")
    return found


def _cycles(root=ROOT) -> list[list[str]]:
    """Import cycles among the modules of one package (runtime imports, function-level ones included)."""
    modules = dict(_modules(root))
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        pkg = name.split(".")[:2]
        for _, module, _, runtime in _imports(path, root):
            if runtime and module in modules and module != name and module.split(".")[:2] == pkg:
                if module != ".".join(pkg):  # a package's own __init__ re-exports; modules import from its parts
                    edges[name].add(module)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(modules):
        if node not in state:
            visit(node, [])
    return cycles


def test_every_package_has_a_floor():
    packages = {_package(p, ROOT) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages <= set(FLOORS), sorted(packages - set(FLOORS))


def test_no_upward_same_floor_cli_or_private_imports():
    assert _violations() == []


def test_no_import_cycle_inside_a_package():
    assert _cycles() == []


def test_the_light_packages_import_no_jax():
    code = f"import sys\nfor m in {LIGHT!r}:\n    __import__(m)\n    assert 'jax' not in sys.modules, m"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_check_can_fail(tmp_path):
    """The checker flags a planted upward, same-floor, CLI and private import, and a cycle."""
    fake = tmp_path / "jaxmem"
    for pkg in ("policy", "search", "profiler"):
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "policy" / "bad.py").write_text(
        "from jaxmem.train import Trainer\n"
        "from jaxmem.cli import main\n"
        "from jaxmem.schedule._validate import lockstep_ticks\n"
        "from ..models._interface import StagedModel\n"
        "from jaxmem.memory import _tree_bytes\n"
    )
    (fake / "search" / "peer.py").write_text("from jaxmem.profiler import AdaptiveProfiler\n")
    (fake / "profiler" / "_a.py").write_text("def f():\n    from jaxmem.profiler._b import g\n")
    (fake / "profiler" / "_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxmem.profiler._c import h\n"
        "from jaxmem.profiler._a import f\n"
    )
    (fake / "profiler" / "_c.py").write_text("from jaxmem.profiler._b import g\n")
    found = _violations(fake)
    assert any("imports upward" in v and "jaxmem.train" in v for v in found)
    assert any("only the CLI" in v for v in found)
    assert any("schedule._validate" in v for v in found)
    assert any("models._interface" in v for v in found)
    assert any("private name(s) _tree_bytes" in v for v in found)
    assert any("search and profiler share floor" in v for v in found)
    cycles = _cycles(fake)  # _a <-> _b through a function-level import; _b -> _c only for type checkers
    assert cycles == [["jaxmem.profiler._a", "jaxmem.profiler._b", "jaxmem.profiler._a"]]


def test_the_top_level_offers_the_verbs_a_user_needs():
    import importlib

    import jaxmem

    for name, module in jaxmem._LAZY.items():
        own = "search" if name == "plan" else name
        assert getattr(jaxmem, name) is getattr(importlib.import_module(module), own), name
    assert jaxmem.Pipeline.__name__ == "Pipeline" and callable(jaxmem.plan)
