"""Running the real ``hsx`` CLI (``python -m flows.cli``) from tests, as a user's shell does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

HSX = [sys.executable, "-m", "flows.cli"]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD_LINE = json.dumps(GOOD).encode()


def hsx(
    *args: str, env: dict[str, str] | None = None, timeout: float = 400
) -> subprocess.CompletedProcess[str]:
    """``hsx ARGS`` in the repository, 200 columns wide (rich wraps at the terminal's width)."""
    return subprocess.run(
        [*HSX, *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def extract(
    model: Path, dataset: Path, store: Path | str, *options: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return hsx(
        "extract",
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--store",
        str(store),
        *options,
        env=env,
    )


def said(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr with rich's line wrapping (and the box of click's usage errors) undone."""
    text = re.sub("[\u2500-\u257f]", " ", result.stdout + result.stderr)
    return " ".join(text.split())


def assert_nothing_written(store: Path) -> None:
    """Failed before planning: no store at all, not even its group metadata."""
    assert not (store / "commits").exists()
    assert not (store / "zarr.json").exists()
    assert not store.exists() or not any(store.iterdir()), sorted(store.rglob("*"))
