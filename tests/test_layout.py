"""The package's shape, checked from its source: no import circle between modules, no import that climbs a
floor (io < merge < evaluate, audits < audited < sweep < demo < cli), no module past MAX_LINES (a generous
backstop: the guideline is one concern per module, docs/adding-a-method.md), and no merge method named in a
comparison outside its declaration in mergekit_lite/merge/methods/. Every import counts, module-level or inside
a function: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder of the repository -> the package it is installed as (pyproject's package-dir)
PACKAGES = {"mergekit_lite": "mergekit_lite", "cli": "mergekit_lite.cli", "audits": "mergekit_lite.audits"}
MAX_LINES = 1000
METHODS_PACKAGE = "mergekit_lite.merge.methods"
# floor of each module prefix (the longest matching prefix wins); a module may import its own floor or lower
FLOORS = {
    "mergekit_lite.errors": 0,
    "mergekit_lite.interrupts": 0,
    "mergekit_lite.threads": 0,
    "mergekit_lite": 0,
    "mergekit_lite.io": 1,
    "mergekit_lite.toy": 1,
    "mergekit_lite.merge": 2,
    "mergekit_lite.evaluate": 3,
    "mergekit_lite.audits": 3,
    "mergekit_lite.audited": 4,
    "mergekit_lite.sweep": 5,
    "mergekit_lite.demo": 6,
    "mergekit_lite.cli": 7,
}


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """Our modules `path` imports anywhere in it: `from a.b import c` is a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import a` in package p.q is p.q.a; `from ..b import c` is p.b.c
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def floor(name: str) -> int:
    prefix = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[prefix]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, name, set(found)) for name, path in found.items()}


def test_every_module_has_a_floor(graph):
    for name in graph:
        assert any(name == p or name.startswith(p + ".") for p in FLOORS), name


def test_no_import_circle(graph):
    """Depth-first search for a back edge; the circle is named in the failure."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(name):
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert circles == []


def test_no_upward_import(graph):
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if floor(target) > floor(name) and not (name == "mergekit_lite" or target == "mergekit_lite")
    ]
    assert upward == []


def test_sweep_orchestration_is_imported_by_no_sweep_module(graph):
    """report and distributed read results and evaluators; only the package entry point imports run."""
    importers = sorted(name for name, targets in graph.items() if "mergekit_lite.sweep.run" in targets)
    assert importers == ["mergekit_lite.sweep"]


def test_no_long_module():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: lines for name, lines in long.items() if lines > MAX_LINES} == {}


def method_name_comparisons(source: str, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in, not in) with a merge method's name as a string literal, alone or in a literal
    tuple, list or set: what code outside the registry asks a `Method` instead."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            elements = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            found += [
                f"line {node.lineno}: {element.value!r}"
                for element in elements
                if isinstance(element, ast.Constant) and element.value in names
            ]
    return found


def test_no_method_name_is_compared_outside_the_registry():
    """A method is declared in one module of merge/methods/; the rest of the code asks it (`Method` attributes)."""
    from mergekit_lite.merge.methods import NAMES

    outside = {
        name: path
        for name, path in modules().items()
        if name != METHODS_PACKAGE and not name.startswith(METHODS_PACKAGE + ".")
    }
    found = {name: method_name_comparisons(path.read_text(), set(NAMES)) for name, path in outside.items()}
    assert {name: comparisons for name, comparisons in found.items() if comparisons} == {}


def test_the_comparison_count_sees_every_form():
    """The counter itself: ==, in with a tuple, != with the name on the left; not a default value or a dict key."""
    source = (
        'if method == "ties": pass\nif m in ("slerp", "x"): pass\nif "lines" != m: pass\n'
        'settings = {"method": "linear"}\ndef f(baseline="linear"): pass\n'
    )
    assert method_name_comparisons(source, {"ties", "slerp", "lines", "linear"}) == [
        "line 1: 'ties'",
        "line 2: 'slerp'",
        "line 3: 'lines'",
    ]


def test_walker_sees_lazy_and_relative_imports(tmp_path):
    """The walker itself: a function-level import and a relative import are both edges."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n    return g\n")
    (package / "b.py").write_text("from . import a\nfrom .c import h\n")
    (package / "c.py").write_text("h = 1\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert imported(package / "a.py", "pkg.a", known) == {"pkg.b"}
    assert imported(package / "b.py", "pkg.b", known) == {"pkg.a", "pkg.c"}


def test_the_wheel_ships_every_package():
    """pyproject's package list is what pip installs: every folder of ours with an `__init__.py` must be in it,
    under the name it is imported as, and the folders outside mergekit_lite/ mapped onto those names."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    ours = {module_name(path) for package in PACKAGES for path in (ROOT / package).rglob("__init__.py")}
    assert ours == set(setuptools["packages"])
    assert setuptools["package-dir"] == {name: folder for folder, name in PACKAGES.items() if folder != name}


def test_the_package_imports_none_of_its_modules_until_asked():
    """`import mergekit_lite` is cheap (the CLI's --help imports it): the API's names load on first use, and each
    names what it says."""
    import subprocess
    import sys

    program = (
        "import sys, mergekit_lite\n"
        "print(sorted(m for m in sys.modules if m.startswith('mergekit_lite.')))\n"
        "for name in mergekit_lite.__all__:\n"
        "    assert getattr(mergekit_lite, name).__name__ == name, name\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
