"""Checks of a Prefect server that infra/prefect-up.sh runs once the stack is up: the
scheduler creates runs (a probe deployment's schedule, then removed) and its loop logs no
error; any other ERROR of the server's log is reported (the tests over a stack fail on those:
tests/prefect_stack.py reads the log with ``server_log_errors``).

Run: ``python -m flows.stack_check --server-log FILE`` (PREFECT_API_URL names the server);
exit 0 when the scheduler works, 1 with what failed.

Why: with SQLAlchemy 2.1, Prefect 3.7.7's scheduler failed every minute while everything else
worked (runs from the UI, retries, cancels): 17 minutes of a nightly deployment created no run,
and nothing but the server's log said so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid
from pathlib import Path

import httpx

PROBE_FLOW = "hsx-scheduler-check"
# A log record of the server (Prefect's format, and uvicorn's own) at ERROR or above.
_RECORD = re.compile(r"^(\d\d:\d\d:\d\d\.\d+ \| [A-Z]+ +\||[A-Z]+:  )")
_ERROR = re.compile(r"^(\d\d:\d\d:\d\d\.\d+ \| (ERROR|CRITICAL) +\||(ERROR|CRITICAL):  )")


def server_log_errors(text: str) -> list[str]:
    """Each ERROR or CRITICAL record of a Prefect server's log, with its traceback."""
    errors: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if _RECORD.match(line):
            if current is not None:
                errors.append("\n".join(current))
            current = [line] if _ERROR.match(line) else None
        elif current is not None:
            current.append(line)
    if current is not None:
        errors.append("\n".join(current))
    return errors


def error_summary(error: str) -> str:
    """The first line of a logged error and its exception (a traceback's last line)."""
    lines = [line for line in error.splitlines() if line.strip()]
    last = next((line for line in reversed(lines[1:]) if not line.startswith(" ")), "")
    return lines[0] + (f" -> {last}" if last else "")


def probe_scheduler(
    api: str, timeout_s: float, server_log: Path | None = None
) -> tuple[int, float]:
    """Create a deployment with an interval schedule and wait for the scheduler's runs; the
    deployment (and so its runs) is deleted after. Returns (runs created, seconds it took).
    Raises RuntimeError when the scheduler created none within ``timeout_s``, or as soon as
    ``server_log`` shows the scheduler failing."""
    started = time.monotonic()
    with httpx.Client(base_url=api, timeout=30) as http:
        flow = http.post("/flows/", json={"name": PROBE_FLOW})
        flow.raise_for_status()
        created = http.post(
            "/deployments/",
            json={
                "name": f"probe-{uuid.uuid4().hex[:8]}",
                "flow_id": flow.json()["id"],
                "description": "hsx's start-up check of the scheduler (deleted at once)",
                "schedules": [{"schedule": {"interval": 3600}, "active": True}],
            },
        )
        created.raise_for_status()
        deployment = created.json()["id"]
        try:
            runs = 0
            while time.monotonic() - started < timeout_s:
                counted = http.post(
                    "/flow_runs/count", json={"deployments": {"id": {"any_": [deployment]}}}
                )
                counted.raise_for_status()
                runs = int(counted.json())
                if runs:
                    return runs, time.monotonic() - started
                failing = scheduler_errors(server_log)
                if failing:
                    raise RuntimeError(
                        "expected the scheduler to create runs for a deployment with an "
                        f"interval schedule, found it failing: {error_summary(failing[0])}"
                    )
                time.sleep(0.5)
        finally:
            http.delete(f"/deployments/{deployment}")
    raise RuntimeError(
        f"expected the scheduler to create runs for a deployment with an interval schedule "
        f"within {timeout_s:.0f} s, found none"
    )


def scheduler_errors(server_log: Path | None) -> list[str]:
    if server_log is None or not server_log.exists():
        return []
    errors = server_log_errors(server_log.read_text(errors="replace"))
    return [e for e in errors if "schedule_" in e.splitlines()[0] or "scheduler" in e[:300]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--server-log", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        print(
            "stack check: expected PREFECT_API_URL naming the server, found none", file=sys.stderr
        )
        return 2
    failed = False
    try:
        runs, seconds = probe_scheduler(api, args.timeout, args.server_log)
        print(f"stack check: the scheduler created {runs} runs of a probe in {seconds:.1f} s")
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"stack check: {exc}", file=sys.stderr)
        failed = True
    scheduler = scheduler_errors(args.server_log)
    # Other errors are reported, not fatal: the stack works (a restart may log a client's
    # dropped connection); the tests fail on them (tests/integration/test_stack_operations.py).
    others = [
        e
        for e in server_log_errors(args.server_log.read_text(errors="replace"))
        if e not in scheduler
    ]
    for error in scheduler[:10]:
        print(f"stack check: ERROR in {args.server_log}: {error_summary(error)}", file=sys.stderr)
    for error in others[:10]:
        print(f"stack check: warning: {args.server_log}: {error_summary(error)}", file=sys.stderr)
    if failed or scheduler:
        print(
            "stack check: the scheduler does not run cleanly; failing with "
            '"Can\'t evaluate bulk DML statement" means SQLAlchemy 2.1 '
            "(requirements/cpu-constraints.txt pins 2.0)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
