"""`make demo`, the README's first command, as a new user runs it: in a fresh copy of the
repository (no models, no stores yet), its exit code, its output and what it leaves."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


def _fresh_copy(target: Path) -> Path:
    """The files a clone would have (tracked, plus new ones git does not ignore), and the
    project's environment (built by `make venv`; a copy would take minutes to install)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (item.decode() for item in listed)):
        source = REPO_ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / ".venv").symlink_to(REPO_ROOT / ".venv")
    return target


def _environment_is_current() -> bool:
    """Whether the shared .venv was built from today's pyproject.toml (scripts/bootstrap.sh's
    stamp): a stale one would be reinstalled by the copy's `make demo`, editable from the copy,
    and every later test would run the copy's code."""
    hashed = b"".join(
        (REPO_ROOT / name).read_bytes()
        for name in ("pyproject.toml", "requirements/cpu-constraints.txt", "scripts/bootstrap.sh")
    )
    engine = os.environ.get("HSX_VLLM", "cpu").encode()
    stamp = REPO_ROOT / ".venv" / ".hsx-stamp"
    wanted = hashlib.sha256(hashed + engine).hexdigest()[:16]
    return stamp.is_file() and stamp.read_text().strip() == wanted


def test_make_demo_from_a_fresh_copy(tmp_path: Path) -> None:
    if not _environment_is_current():
        pytest.fail("the shared .venv is older than pyproject.toml: run `make venv` first")
    clone = _fresh_copy(tmp_path / "hsx")
    assert not (clone / "models").exists() and not (clone / "stores").exists()
    env = {
        **os.environ,
        # The shared environment's hsx is installed editable from REPO_ROOT: the copy's own
        # packages come first on the path, as a clone's would.
        "PYTHONPATH": str(clone),
        "COLUMNS": "200",
    }
    env.pop("PREFECT_API_URL", None)  # no server: the demo starts its own
    demo = subprocess.run(
        ["make", "demo"], cwd=clone, env=env, capture_output=True, text=True, timeout=800
    )
    said = demo.stdout + demo.stderr
    assert demo.returncode == 0, said[-4000:]
    assert "hsx demo" in said and "verification" in said and "Traceback" not in said
    assert (clone / "models" / "tiny-llama" / "config.json").is_file()
    assert (clone / "stores" / "demo" / "commits").is_dir()
    # One tokens/s, counted over the same phase as the progress lines: the summary's figure is
    # the last progress line's (less the time of the loop's end).
    progress = [float(x) for x in re.findall(r"progress: .* tokens, (\d+) tokens/s", said)]
    final = re.search(
        r"tokens/s \(extraction: first chunk's start to last commit\)\s*│?\s*([\d.]+)", said
    )
    assert progress and final, said[-4000:]
    assert 0.5 * progress[-1] <= float(final.group(1)) <= 1.01 * progress[-1] + 1, (
        progress,
        final.group(1),
    )
