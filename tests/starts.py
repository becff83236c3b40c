"""The expensive starts of a test run, counted across every process it spawns: vLLM engine cores
(in this process, in child processes, in `hsx serve` and flow-run processes), `hsx serve`
servers, Prefect servers (stacks and the test harness) and workers. A pytest plugin
(registered in tests/conftest.py): tests/start_counter/sitecustomize.py records each event in
``TESTS_START_LOG``; the terminal summary prints the totals and the tests that started most.

Counting only; nothing a test does changes. Read by .ci/run's summary and by a review of a
growing suite (bench/ci-times.md keeps the figures of green runs)."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

COUNTER_SITE = Path(__file__).resolve().parent / "start_counter"
LOG_VARIABLE = "TESTS_START_LOG"


def kind_of_process(argv: list[str]) -> str | None:
    """What a started Python process is, from its command line (None: not counted)."""
    line = " ".join(argv)
    if "flows.cli" in argv:
        return (
            "hsx serve"
            if argv[argv.index("flows.cli") + 1 : argv.index("flows.cli") + 2] == ["serve"]
            else "hsx CLI"
        )
    if "vllm.entrypoints" in line:
        return "vLLM server"
    if "uvicorn" in line and "prefect.server" in line:
        return "Prefect temporary server"
    if ("prefect" in line or "flows.server_launch" in line) and "server start" in line:
        return "Prefect server (stack)"
    if "worker start" in line:
        return "Prefect worker"
    return None


def tally(lines: list[dict[str, Any]]) -> tuple[Counter[str], float, Counter[str]]:
    """(starts by kind, engine seconds, engine starts by test)."""
    starts: Counter[str] = Counter()
    by_test: Counter[str] = Counter()
    engine_seconds = 0.0
    seen: set[int] = set()
    current: list[tuple[float, str]] = []  # (start time, test id) in order
    for event in lines:
        if event["kind"] == "test":
            current.append((event["t"], event["test"]))
    for event in lines:
        if event["kind"] == "engine":
            starts["vLLM engine core"] += 1
            engine_seconds += float(event.get("seconds", 0.0))
            owner = [test for t, test in current if t <= event["t"]]
            by_test[owner[-1] if owner else "(before any test)"] += 1
        elif event["kind"] == "process" and event["pid"] not in seen:
            # Once per pid: the CLI re-executes itself (to preload tcmalloc) under the same pid.
            kind = kind_of_process(list(event["argv"]))
            if kind is not None:
                seen.add(event["pid"])
                starts[kind] += 1
    return starts, engine_seconds, by_test


class StartCounter:
    def __init__(self, log: Path) -> None:
        self.log = log

    def events(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        events = []
        for raw in self.log.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # a line cut by a killed process
        return events

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int, str]) -> None:
        import time

        with self.log.open("a") as out:
            out.write(json.dumps({"kind": "test", "test": nodeid, "t": time.time()}) + "\n")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        starts, engine_seconds, by_test = tally(self.events())
        write = terminalreporter.write_line
        terminalreporter.section("expensive starts (tests/starts.py)")
        for kind, count in sorted(starts.items()):
            extra = f" ({engine_seconds:.0f} s building them)" if kind == "vLLM engine core" else ""
            write(f"{kind}: {count}{extra}")
        if not starts:
            write("none")
        if by_test:
            write("most engine starts: " + ", ".join(f"{t} {n}" for t, n in by_test.most_common(8)))


def install(config: pytest.Config) -> None:
    """Count this session's starts: the log file, this folder on every child's PYTHONPATH, and
    the engine hook in this process too (its sitecustomize already ran without it)."""
    log = os.environ.get(LOG_VARIABLE)
    if not log:
        handle, log = tempfile.mkstemp(prefix="hsx-test-starts-", suffix=".jsonl")
        os.close(handle)
        os.environ[LOG_VARIABLE] = log
    paths = [str(COUNTER_SITE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "hsx_test_start_counter", COUNTER_SITE / "sitecustomize.py"
    )
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    config.pluginmanager.register(StartCounter(Path(log)), "hsx-start-counter")
