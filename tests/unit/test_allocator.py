"""The CLI re-executes itself once with tcmalloc preloaded, where it is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.allocator import preload_env, tcmalloc_path

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
PROBE = "from flows.allocator import reexec_with_tcmalloc as r; r(); import os; print(os.environ.get('LD_PRELOAD', ''))"


def test_preload_env_respects_opt_out_and_existing_preload() -> None:
    assert preload_env({"HSX_ALLOCATOR": "system"}).get("LD_PRELOAD") is None
    library = tcmalloc_path()
    if library is None:
        assert preload_env({}) == {}
    else:
        assert preload_env({"LD_PRELOAD": "/x.so"})["LD_PRELOAD"] == f"{library}:/x.so"
        assert preload_env({"LD_PRELOAD": library})["LD_PRELOAD"] == library  # not twice


@pytest.mark.skipif(tcmalloc_path() is None, reason="libtcmalloc-minimal4 not installed")
def test_process_reexecutes_with_tcmalloc() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "HSX_REEXECUTED", "HSX_ALLOCATOR")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=100,
    )
    assert tcmalloc_path() in out.stdout, out.stderr
    off = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "HSX_ALLOCATOR": "system"},
        timeout=100,
    )
    assert off.stdout.strip() == ""
