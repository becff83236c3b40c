"""Imports go one way: flows -> tasks -> hsx -> settings; hsx never imports prefect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "hsx": {"prefect", "tasks", "flows"},
    "settings": {"prefect", "hsx", "tasks", "flows"},
    "tasks": {"flows"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_top_levels(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_hsx_does_not_load_prefect() -> None:
    code = (
        "import sys, hsx.extraction.steps, hsx.store.reader, hsx.store.zarr_store, hsx.store.verify, hsx.extraction.chunk_extraction, hsx.plan.building;"
        "bad = [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=110
    )
    assert result.returncode == 0, result.stdout + result.stderr
