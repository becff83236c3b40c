"""Preflight wall time and peak memory on the Kimi-K2 config (61 layers, hidden 7168, 384
experts; no weights), against a baseline measured in the same run: a bare `import vllm`, the
floor any vLLM-aware check pays. Targets on this machine: < 20 s and < 4 GiB.

    .venv/bin/python bench/bench_preflight.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIMI = ROOT / "tests" / "fixtures" / "configs" / "kimi-k2"


def timed(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """(seconds, peak RSS of the child in MiB, result), in a fresh process each time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all waited-for children: run the big one last.
    return seconds, max(peak, before) / 1024, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    base_s, base_mib = min(
        (
            timed([sys.executable, "-c", "import vllm; from vllm import LLM"])[:2]
            for _ in range(args.repeats)
        ),
        key=lambda pair: pair[0],
    )
    runs = []
    for _ in range(args.repeats):
        seconds, peak, result = timed(
            [sys.executable, "-m", "flows.cli", "preflight", str(KIMI), "--json"]
        )
        report = json.loads(result.stdout)
        runs.append((seconds, peak, report))
    seconds, peak, report = min(runs, key=lambda run: run[0])
    statuses = {r["check"]: r["status"] for r in report["results"]}
    print(f"[baseline] import vllm: {base_s:.1f} s, peak RSS {base_mib:,.0f} MiB")
    print(
        f"[preflight kimi-k2] {seconds:.1f} s (ratio to import {seconds / base_s:.2f}; target < 20 s), "
        f"peak RSS {peak:,.0f} MiB (target < 4096 MiB); checks {statuses}"
    )


if __name__ == "__main__":
    main()
