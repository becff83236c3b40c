"""The parts of the Prefect stack's operation that run without a stack: the server log's ERROR
reader, SQLite transactions begun IMMEDIATE, a stopping worker's pieces (its flow-run
processes, no new runs, its grace against the unit files' stop timeouts), and `hsx runs`' count.
The whole of it runs in tests/integration/test_stack_operations.py."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# The server's log as infra/prefect-up.sh writes it (Prefect's format; records from 2026-12-07).
SERVER_LOG = """\
Check out the dashboard at http://127.0.0.1:4391

20:48:04.100 | INFO    | prefect.server - started
20:48:04.485 | ERROR   | docket.dependencies - schedule_recent_deployments(){x}
Traceback (most recent call last):
  File "scheduler.py", line 348, in schedule_recent_deployments
sqlalchemy.exc.InvalidRequestError: Can't evaluate bulk DML statement
20:48:05.000 | WARNING | prefect.server - a warning
20:48:06.000 | ERROR   | prefect.server.utilities.worker_channel - heartbeat persistence failed
ERROR:    Exception in ASGI application
"""


def test_the_server_log_reader_finds_each_error_with_its_traceback() -> None:
    from flows.stack_check import error_summary, server_log_errors

    errors = server_log_errors(SERVER_LOG)
    assert len(errors) == 3, errors
    assert errors[0].splitlines()[-1].startswith("sqlalchemy.exc.InvalidRequestError")
    assert error_summary(errors[0]).endswith(
        "-> sqlalchemy.exc.InvalidRequestError: Can't evaluate bulk DML statement"
    )
    assert "heartbeat persistence failed" in errors[1] and "WARNING" not in "".join(errors)
    assert server_log_errors("20:48:04.100 | INFO    | prefect.server - started\n") == []


def test_the_start_up_check_fails_on_the_schedulers_errors_alone(tmp_path: Path) -> None:
    from flows.stack_check import scheduler_errors

    log = tmp_path / "server.log"
    log.write_text(SERVER_LOG)
    (error,) = scheduler_errors(log)
    assert "schedule_recent_deployments" in error
    assert scheduler_errors(tmp_path / "absent.log") == []


def test_the_servers_sqlite_transactions_take_the_write_lock_at_once(tmp_path: Path) -> None:
    """Prefect's deferred transaction reads, then writes; in WAL mode SQLite refuses the write
    at once ("database is locked") when another connection wrote since. Begun IMMEDIATE
    (flows/server_launch.py) it holds the write lock from its first statement: another writer
    waits, none is refused mid-transaction."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    from flows.server_launch import immediate_sqlite_transactions

    path = tmp_path / "prefect.db"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()

    async def other_writer_inside_a_transaction() -> str:
        config = AioSqliteConfiguration(connection_url=f"sqlite+aiosqlite:///{path}")
        engine = await config.engine()
        session = await config.session(engine)
        async with session:
            async with config.begin_transaction(session):
                await session.execute(__import__("sqlalchemy").text("SELECT x FROM t"))
                try:
                    with sqlite3.connect(path, timeout=0.1) as other:
                        other.execute("INSERT INTO t VALUES (1)")
                    return "written"
                except sqlite3.OperationalError as exc:
                    return str(exc)
            await engine.dispose()

    assert asyncio.run(other_writer_inside_a_transaction()) == "written"  # Prefect's DEFERRED
    original = AioSqliteConfiguration.begin_transaction
    try:
        assert immediate_sqlite_transactions()
        assert asyncio.run(other_writer_inside_a_transaction()) == "database is locked"
    finally:
        AioSqliteConfiguration.begin_transaction = original  # type: ignore[method-assign]


def test_a_stopping_worker_submits_no_new_run() -> None:
    from flows.worker_launch import runs_to_submit

    entries = [SimpleNamespace(flow_run=SimpleNamespace(id=uuid.uuid4()))]
    assert runs_to_submit(None, entries) == entries
    assert runs_to_submit(None, entries, stopping=True) == []


def test_the_stop_grace_comes_from_the_environment() -> None:
    from flows.worker_launch import STOP_GRACE_S, stop_grace_s

    assert stop_grace_s({}) == STOP_GRACE_S == 60.0
    assert stop_grace_s({"HSX_WORKER_STOP_GRACE_S": "5"}) == 5.0
    with pytest.raises(SystemExit, match=r"expected seconds .*found 'soon'"):
        stop_grace_s({"HSX_WORKER_STOP_GRACE_S": "soon"})


def test_the_worker_finds_its_flow_run_processes_and_sees_them_end() -> None:
    from flows.worker_launch import flow_run_processes, process_ended

    run = uuid.uuid4()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "PREFECT__FLOW_RUN_ID": str(run)},
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in flow_run_processes(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = flow_run_processes(os.getpid())
        assert found.get(child.pid) == run and other.pid not in found
        assert not process_ended(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while not process_ended(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_ended(child.pid)  # a zombie not reaped yet has ended
    finally:
        for process in (child, other):
            process.kill()
            process.wait()


def test_the_units_stop_timeouts_outlast_the_workers_grace() -> None:
    """systemd and compose SIGKILL the whole worker after their stop timeout: it must leave the
    worker's grace for its runs and its own stop; systemd must signal start-worker.sh alone."""
    from flows.worker_launch import STOP_GRACE_S

    unit = (ROOT / "infra" / "systemd" / "hsx-worker.service").read_text()
    (timeout,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert int(timeout) >= STOP_GRACE_S + 20
    assert re.search(r"^KillMode=mixed$", unit, re.M)
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    grace = compose["services"]["worker"]["stop_grace_period"]
    assert int(grace.removesuffix("s")) >= STOP_GRACE_S + 20


def test_hsx_runs_says_how_many_it_shows_of_how_many() -> None:
    from flows.runs_cli import shown_of

    assert shown_of(20, 211) == "the newest 20 of 211 runs (--limit N for more, --limit 0 for all)"
    assert shown_of(3, 3) == "3 runs"
    assert shown_of(1, 1) == "1 run"


def test_a_stopping_worker_kills_a_run_that_outlasts_its_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flow-run process that ignores SIGTERM is killed once the grace is over and its run is
    marked Crashed; one that ends in time keeps the state it reported. (The API calls are
    recorded here; tests/integration/test_stack_operations.py makes them against a server.)"""
    from flows import worker_launch

    crashed: list[tuple[uuid.UUID, str]] = []
    closed: list[uuid.UUID] = []
    monkeypatch.setattr(
        worker_launch, "crash_if_unfinished", lambda run, why: crashed.append((run, why))
    )
    monkeypatch.setattr(worker_launch, "close_stale_task_runs", lambda run, at: closed.append(run))
    stubborn, polite = uuid.uuid4(), uuid.uuid4()
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code + "print('ready', flush=True); time.sleep(60)"],
            env={**os.environ, "PREFECT__FLOW_RUN_ID": str(run)},
            stdout=subprocess.PIPE,
        )
        for run, code in ((stubborn, ignore_term), (polite, "import time; "))
    ]
    said: list[str] = []
    try:
        for child in children:  # their handlers are set
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        started = time.monotonic()
        worker_launch.WorkerStop(grace_s=1.0, say=said.append).stop_flow_runs("SIGTERM")
        assert time.monotonic() - started < 10
        assert all(worker_launch.process_ended(c.pid) for c in children)
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert children[0].returncode == -9 and children[1].returncode == -15
    assert any(f"flow run {stubborn} did not end within 1 s: SIGKILL" in s for s in said), said
    assert any("1 of 2 flow runs ended" in s for s in said), said
    reasons = dict(crashed)
    assert "did not end within 1 s: killed" in reasons[stubborn]
    assert "ended without an end" in reasons[polite]  # crash_if_unfinished keeps a final state
    assert sorted(closed, key=str) == sorted([stubborn, polite], key=str)
