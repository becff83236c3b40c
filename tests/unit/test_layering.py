"""The code's layering, enforced (docs/DESIGN.md, "Map"): flows -> tasks -> hsx -> settings, and
inside hsx one order of packages, each importing only those before it. Read from the source
with ``ast`` (lazy imports inside functions count: they are imports all the same)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# hsx's packages in order; a module may import its own package and those listed before it. The
# leaf modules (errors, interrupt, timings) come first: everything may use them.
HSX_ORDER = (
    "hsx.errors",
    "hsx.interrupt",
    "hsx.timings",
    "hsx.model",
    "hsx.data",
    "hsx.plan",
    "hsx.store",
    "hsx.trainers",
    "hsx.audit",
    "hsx.engine",
    "hsx.extraction",
    "hsx.regeneration",
    "hsx.preflight",
    "hsx.serve",
)
# The top-level layers: a layer may import itself and those after it.
LAYERS = ("flows", "tasks", "hsx", "settings")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) of every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def _hsx_package(module: str) -> str | None:
    """The entry of HSX_ORDER a module of hsx belongs to."""
    for package in sorted(HSX_ORDER, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def _target(module: str, name: str | None, known: set[str]) -> str:
    """``from hsx.store import zarr_store`` imports the module hsx.store.zarr_store."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    return module


def test_every_hsx_module_belongs_to_a_package_of_the_order() -> None:
    loose = [
        _module_name(p)
        for p in _sources("hsx")
        if _module_name(p) != "hsx" and _hsx_package(_module_name(p)) is None
    ]
    assert loose == [], f"expected every hsx module in a package of HSX_ORDER, found {loose}"


def test_hsx_packages_import_only_those_before_them() -> None:
    known = {_module_name(p) for p in _sources("hsx")}
    wrong = []
    for path in _sources("hsx"):
        here = _hsx_package(_module_name(path))
        if here is None:
            continue
        for line, module, name in _imports(path):
            if not module.startswith("hsx"):
                continue
            there = _hsx_package(_target(module, name, known))
            if there is not None and HSX_ORDER.index(there) > HSX_ORDER.index(here):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {there}")
    assert wrong == [], "expected imports of earlier packages only, found:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_those_below_them(layer: str) -> None:
    allowed = set(LAYERS[LAYERS.index(layer) :])
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(layer)
        for line, module, _ in _imports(path)
        if module.split(".")[0] in set(LAYERS) - allowed
    ]
    assert wrong == [], f"expected {layer} to import only {sorted(allowed)}, found:\n" + "\n".join(
        wrong
    )


def test_hsx_never_imports_prefect() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _sources("hsx", "settings")
        for line, module, _ in _imports(path)
        if module.split(".")[0] == "prefect"
    ]
    assert wrong == [], f"expected hsx and settings free of prefect, found imports at {wrong}"


def _module_graph(folder: str) -> dict[str, set[str]]:
    known = {_module_name(p) for p in _sources(folder)}
    graph: dict[str, set[str]] = {}
    for path in _sources(folder):
        here = _module_name(path)
        for _, module, name in _imports(path):
            target = _target(module, name, known)
            if target in known and target != here:
                graph.setdefault(here, set()).add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if not state.get(nxt) and (found := visit(nxt, stack)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node) and (found := visit(node, [])):
            return found
    return None


@pytest.mark.parametrize("folder", ["hsx", "flows", "tasks"])
def test_no_import_cycle_between_modules(folder: str) -> None:
    cycle = _cycle(_module_graph(folder))
    assert cycle is None, f"expected no import cycle in {folder}, found {' -> '.join(cycle or [])}"


def test_no_private_name_imported_across_modules() -> None:
    known = {_module_name(p) for p in _sources("hsx", "flows", "tasks", "settings")}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {module}"
        for path in _sources("hsx", "flows", "tasks", "settings")
        for line, module, name in _imports(path)
        if name
        and name.startswith("_")
        and not name.startswith("__")
        and module in known
        and module != _module_name(path)
    ]
    assert wrong == [], "expected no private name imported across modules, found:\n" + "\n".join(
        wrong
    )


def test_no_global_statement_in_hsx() -> None:
    """Process-wide state that changes at run time is a bug waiting for the second run in the
    same process: a run's resources belong to objects the run builds (HostPipeline, ...)."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _sources("hsx")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    ]
    assert found == [], f"expected no `global` statement in hsx, found {found}"


def test_importing_hsx_does_not_load_prefect() -> None:
    """At run time too (an import hidden behind a string would escape the source check)."""
    code = (
        "import sys, hsx.extraction.run, hsx.extraction.steps, hsx.store.reader, "
        "hsx.store.verify, hsx.plan.building, hsx.engine.homes, hsx.preflight.servers, hsx.audit;"
        "bad = [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=110
    )
    assert result.returncode == 0, result.stdout + result.stderr
