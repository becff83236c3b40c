"""The Prefect stack as a team leaves it running (infra/prefect-up.sh, infra/start-worker.sh, a
real server on SQLite and on PostgreSQL): a schedule creates runs and a worker completes one; a
worker's SIGTERM (what systemctl stop and docker stop send) ends the extraction it runs
Cancelled with its record; a flow-run process killed mid-task leaves no task Running; and over
all of it the server's log holds no ERROR."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.store.zarr_store import ExtractionStore
from tests.cli import hsx
from tests.conftest import REPO_ROOT
from tests.prefect_stack import TERMINAL, Stack, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    with running_stack(str(request.param)) as running:
        yield running


def _wait_for(what: str, check: Any, timeout: float, period: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(period)
    raise AssertionError(f"expected {what} within {timeout:.0f} s, found none")


def _runs_of(stack: Stack, deployment: str) -> list[dict[str, Any]]:
    response = stack.call(
        "POST", "/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment]}}}
    )
    return list(response.json())


def _flow_run_process(run_id: str) -> int:
    """The pid of the process the worker started for this flow run (PREFECT__FLOW_RUN_ID in its
    environment; the topmost such process)."""
    named: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                named[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    top = [pid for pid, parent in named.items() if parent not in named]
    assert len(top) == 1, f"expected one process for flow run {run_id}, found {named}"
    return top[0]


def _open_tasks(stack: Stack, run_id: str) -> list[str]:
    return [
        f"{t['name']} {t['state_type']}"
        for t in stack.task_runs(run_id)
        if t["state_type"] not in TERMINAL
    ]


def test_a_schedule_creates_runs_and_a_worker_completes_one(stack: Stack) -> None:
    """A deployment on a 5 s interval, as the UI's schedule form makes it (the preflight flow
    without its probe: seconds of work): the scheduler creates its runs, the worker completes
    one; paused, it leaves no run behind but the finished ones."""
    deployed = stack.call(
        "GET", f"/deployments/{stack.deployment_id('hsx-preflight', 'preflight')}"
    )
    source = deployed.json()
    body = {
        key: source[key]
        for key in (
            "flow_id",
            "entrypoint",
            "path",
            "pull_steps",
            "job_variables",
            "work_pool_name",
            "enforce_parameter_schema",
            "tags",
        )
    }
    body |= {
        "name": "preflight-every-5s",
        "parameters": {**source["parameters"], "probe": False},
        "schedules": [{"schedule": {"interval": 5}, "active": True}],
    }
    created_at = time.monotonic()
    deployment = str(stack.call("POST", "/deployments/", json=body).json()["id"])
    scheduled = _wait_for(
        "two runs created by the scheduler",
        lambda: [r for r in _runs_of(stack, deployment) if r["auto_scheduled"]][1:],
        timeout=60,
    )
    print(f"scheduler: runs created {time.monotonic() - created_at:.1f} s after the deployment")
    assert scheduled
    started = _wait_for(
        "a scheduled run taken by the worker",
        lambda: [r for r in _runs_of(stack, deployment) if r["state_type"] != "SCHEDULED"],
        timeout=120,
    )
    # No more runs: pausing deletes the scheduled ones; the one the worker holds goes on.
    stack.call("POST", f"/deployments/{deployment}/pause_deployment")
    run = stack.wait(started[0]["id"], timeout=300)
    assert run["state_type"] == "COMPLETED", run["state"]
    assert run["auto_scheduled"] and run["deployment_id"] == deployment
    print(f"scheduler: a scheduled run completed {time.monotonic() - created_at:.1f} s after")
    _wait_for(
        "every run of the paused deployment finished",
        lambda: all(r["state_type"] in TERMINAL for r in _runs_of(stack, deployment)),
        timeout=300,
    )
    left = _runs_of(stack, deployment)
    assert left and all(r["state_type"] == "COMPLETED" for r in left), [r["state"] for r in left]


def test_a_workers_sigterm_ends_its_run_cancelled_with_its_record(
    stack: Stack, tmp_path: Path
) -> None:
    """One SIGTERM to infra/start-worker.sh while an extraction runs (systemctl stop and docker
    stop send that one): the run ends Cancelled, its store record says what it committed,
    abandoned and never started and why, no task is left Running, `hsx runs` shows it, and
    the worker is gone within the unit file's stop timeout."""
    store = str(tmp_path / "stopped.zarr")
    settings = {  # ~60 chunks one at a time; storage chunks sized to them (logged)
        "store": store,
        "run": {"preflight": False},
        "layout": {"work_chunk_tokens": 512},
        "pipeline": {"chunks_in_flight": 1},
    }
    run_id = stack.run("hsx-extract", "extract", {"settings": settings})
    commits = Path(store) / "commits"
    _wait_for(  # mid-run: a chunk in flight, most not started
        "three commits",
        lambda: commits.is_dir() and len(list(commits.glob("chunk-*.json"))) >= 3,
        timeout=300,
        period=0.2,
    )
    script = stack.workers[0]
    stopped_at = time.monotonic()
    os.kill(script.pid, signal.SIGTERM)  # to the script alone, as KillMode=mixed does
    final = stack.wait(run_id, timeout=120)
    cancelled_s = time.monotonic() - stopped_at
    unit = (REPO_ROOT / "infra" / "systemd" / "hsx-worker.service").read_text()
    (timeout_stop_s,) = [int(v) for v in re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M)]
    assert script.wait(timeout=timeout_stop_s) == 0
    exited_s = time.monotonic() - stopped_at
    print(
        f"worker stop: run Cancelled after {cancelled_s:.1f} s, worker gone after {exited_s:.1f} s"
    )
    assert final["state_type"] == "CANCELLED", final["state"]
    assert "SIGTERM received" in final["state"]["message"]
    assert not _open_tasks(stack, run_id)

    opened = ExtractionStore.open(store)
    assert opened.rows_per_chunk == 512  # not 8,192-row (16 MiB) objects per 512-token chunk
    planned = len(opened.work_chunks)
    committed = [c for c in opened.committed_chunks().values() if c.run_id == run_id]
    (record,) = [r for r in opened.run_records() if r["run_id"] == run_id]
    print(f"worker stop: the record: {json.dumps(record, default=str)[:1500]}")
    assert record["status"] == "interrupted" and record["reason"] == "SIGTERM received"
    assert record["ended_at"]
    assert record["chunks_extracted_now"] == len(committed) > 0
    assert record["tokens_extracted_now"] == sum(c.tokens for c in committed)
    accounted = {c.chunk_index for c in committed}
    accounted |= set(record["chunks_abandoned"]) | set(record["chunks_not_started"])
    assert accounted == set(range(planned)), record

    listed = json.loads(hsx("runs", "--json", env=stack.env).stdout)
    (row,) = [r for r in listed if r["id"] == run_id]
    assert row["state"] == "Cancelled" and row["store"] == store
    assert row["committed"] == len(committed) and row["model"].endswith("tiny-llama")
    table = hsx("runs", "--limit", "1", env=stack.env)
    assert re.search(r"the newest 1 of \d+ runs", table.stdout), table.stdout
    logs = stack.call(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    assert any("below the automatic layout.rows_per_chunk" in log["message"] for log in logs)
    # The run's page: Prefect's progress bar where the run stopped, the tokens/s plot.
    artifacts = stack.call(
        "POST", "/artifacts/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}
    ).json()
    (progress,) = [a for a in artifacts if a["type"] == "progress"]
    assert 0 < float(progress["data"]) < 100
    (plot,) = [a for a in artifacts if a["key"] == "hsx-extract-throughput"]
    assert plot["type"] == "rich" and plot["data"]["html"].startswith("<svg")
    assert f"{len(committed)} chunks" in plot["description"]
    # The next tests need a worker: a node's supervisor would start it again.
    stack.start_worker({}, stack.home / "worker-after-stop.log")


def test_a_killed_flow_run_leaves_no_task_running(stack: Stack) -> None:
    """A flow-run process killed (SIGKILL: the OOM killer, a node's reboot) while a task runs:
    the worker reports the run Crashed and closes the task it left Running."""
    run_id = stack.run("hsx-preflight", "preflight", {"probe": False})
    _wait_for(
        "a running task",
        lambda: [t for t in stack.task_runs(run_id) if t["state_type"] == "RUNNING"],
        timeout=300,
        period=0.2,
    )
    os.kill(_flow_run_process(run_id), signal.SIGKILL)
    final = stack.wait(run_id, timeout=120)
    assert final["state_type"] == "CRASHED", final["state"]
    _wait_for("no task left Running", lambda: not _open_tasks(stack, run_id), timeout=30)
    closed = [t for t in stack.task_runs(run_id) if t["state_type"] == "CRASHED"]
    assert closed and "process ended while it ran" in closed[0]["state"]["message"]


def test_the_servers_log_holds_no_error(stack: Stack) -> None:
    """Over every test above (schedules, runs, a worker's stop, a killed run): no ERROR in the
    server's log (SQLite's "database is locked" tracebacks, a failing scheduler)."""
    errors = stack.server_errors()
    assert not errors, f"{len(errors)} ERROR records in {stack.server_log}:\n" + "\n".join(
        errors[:5]
    )
