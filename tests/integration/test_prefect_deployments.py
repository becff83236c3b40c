"""Operating hsx as a team does, against a real Prefect server: infra/prefect-up.sh on a free
127.0.0.1 port with a fresh database (SQLite; PostgreSQL from Debian's package), the deployments
of infra/prefect.yaml, a real process worker (infra/start-worker.sh), and runs of the three
deployments triggered through the REST API with partial parameters, as the UI and scripts do.
A chunk that fails for real is retried with the very call the UI's Retry makes (set_state
AwaitingRetry) and only that chunk runs again; `hsx runs`, `hsx runs show` and `hsx info` report
both attempts. Schedules fire, a worker's stop ends its run Cancelled with a record, and the
server's log stays free of ERROR (the module's last tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.store.reader import HiddenStatesReader
from hsx.store.zarr_store import ExtractionStore
from tests.cli import hsx
from tests.conftest import REPO_ROOT
from tests.prefect_stack import TERMINAL, Stack, running_stack
from tests.servers import READY, ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """One stack per database for the module (each start: prefect-up.sh, nine deployments, a
    worker). Tests whose subject is not the database run on one of them (``ON_SQLITE``,
    ``ON_POSTGRES``): SQLite is the stack a user starts first, PostgreSQL the one a team
    shares; the broad run of every deployment runs on both."""
    with running_stack(str(request.param)) as running:
        yield running


# Tests whose subject is hsx's behaviour under Prefect, not the database behind it.
ON_SQLITE = pytest.mark.parametrize("stack", ["sqlite"], indirect=True)
ON_POSTGRES = pytest.mark.parametrize("stack", ["postgres"], indirect=True)


def test_the_ui_shows_the_api_of_its_own_port(stack: Stack) -> None:
    settings = httpx.get(f"http://127.0.0.1:{stack.port}/ui-settings", timeout=30).json()
    assert settings["api_url"] == stack.api
    names = {d["name"]: d for d in stack.call("POST", "/deployments/filter", json={}).json()}
    assert set(names) == {
        "extract",
        "extract-served",
        "extract-fanout",
        "extract-item",
        "preflight",
        "verify",
        "export",
        "regenerate",
        "regenerate-extract",
        "audit",
    }
    assert names["verify"]["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    extract = names["extract"]["parameters"]["settings"]
    assert extract["model"] == f"{REPO_ROOT}/models/tiny-llama"  # usable as it is


@ON_POSTGRES
def test_regenerate_then_extract_runs_from_its_deployment(stack: Stack, tmp_path: Path) -> None:
    """The deployment with partial parameters for both jobs: the worker's flow run starts its
    own `hsx serve`, regenerates greedily through it, extracts through it, and stops it."""
    out, store = tmp_path / "regenerated", tmp_path / "regenerated.zarr"
    run_id = stack.run(
        "hsx-regenerate-extract",
        "regenerate-extract",
        {
            "settings": {"out": str(out), "data": {"max_samples": 4}},
            "extract": {"store": str(store)},
        },
    )
    done = stack.wait(run_id, timeout=600)
    assert done["state_type"] == "COMPLETED", done["state"]["message"]
    opened = ExtractionStore.open(str(store))
    assert sorted(opened.committed_chunks()) == [c.index for c in opened.work_chunks]
    rows = sum(len(p.read_text().splitlines()) for p in (out / "data").glob("part-*.jsonl"))
    assert HiddenStatesReader(str(store)).num_samples == rows > 0
    logs = list(stack.home.rglob("hsx-serve-*.log"))  # the run's own server, one load
    assert len(logs) == 1 and logs[0].read_text().count("hsx serve: loading") == 1
    verified = hsx("verify", str(store), env=stack.env)
    assert verified.returncode == 0, verified.stdout[-2000:]


def test_three_deployments_run_with_partial_parameters(stack: Stack, tmp_path: Path) -> None:
    store = str(tmp_path / "partial.zarr")
    preflight = stack.run("hsx-preflight", "preflight", {"probe": False})
    extract = stack.run(
        "hsx-extract",
        "extract",
        # Only what changes: the deployment's model, dataset and run settings stay.
        {"settings": {"store": store, "data": {"max_samples": 24}, "run": {"preflight": False}}},
    )
    checked = stack.wait(preflight)
    assert checked["state_type"] == "COMPLETED", checked["state"]["message"]
    finished = stack.wait(extract)
    assert finished["state_type"] == "COMPLETED", finished["state"]["message"]
    verify = stack.run("hsx-verify", "verify", {"store": store})
    verified = stack.wait(verify)
    assert verified["state_type"] == "COMPLETED", verified["state"]["message"]
    exported = stack.wait(
        stack.run("hsx-export", "export", {"store": store, "out": str(tmp_path / "exported")})
    )
    assert exported["state_type"] == "COMPLETED", exported["state"]["message"]
    assert (tmp_path / "exported" / "hsx-export.json").is_file()  # the deployment's speculators
    regenerated = tmp_path / "regenerated"
    partial = {"out": str(regenerated), "data": {"max_samples": 4}, "generation": {"max_tokens": 8}}
    regeneration = stack.wait(stack.run("hsx-regenerate", "regenerate", {"settings": partial}))
    assert regeneration["state_type"] == "COMPLETED", regeneration["state"]["message"]
    manifest = json.loads((regenerated / "hsx-regeneration.json").read_text())
    assert manifest["frozen_inputs"]["sampling"] == {"temperature": 0.7}  # the deployment's
    assert manifest["conversations"] == 4 and len(list((regenerated / "commits").iterdir())) == 1
    runs = json.loads(hsx("runs", "--json", env=stack.env).stdout)
    (row,) = [r for r in runs if r["id"] == regeneration["id"]]  # `hsx runs` lists it
    assert row["state"] == "Completed" and row["store"] == str(regenerated)
    assert row["committed"] == 1 and float(row["tokens_per_s"]) > 0

    opened = ExtractionStore.open(store)
    assert opened.meta["settings"]["run"]["retries"] == 2  # the deployment's, merged
    assert opened.meta["num_samples"] == 24  # the run's
    (record,) = opened.run_records()
    assert record["run_id"] == extract and record["attempt"] == 1
    assert record["status"] == "completed" and record["ended_at"]
    tags = set(stack.flow_run(extract)["tags"])
    assert {"hsx", "extract", "model:tiny-llama", "dataset:sample_conversations.jsonl"} <= tags

    # A misspelt key in a run's parameters fails the run naming it and the closest known one.
    typo = stack.run("hsx-extract", "extract", {"settings": {"engine": {"max_model_lenn": 9}}})
    failed = stack.wait(typo)
    assert failed["state_type"] == "FAILED"
    assert "max_model_lenn" in failed["state"]["message"] and "max_model_len" in (
        failed["state"]["message"].replace("max_model_lenn", "")
    )


@ON_SQLITE
def test_a_failed_chunk_is_retried_from_the_ui_alone_and_both_attempts_are_kept(
    stack: Stack, tmp_path: Path
) -> None:
    from hsx.extraction.steps import plan_and_create_store, resolve_settings
    from settings import HsxSettings, merge_partial

    started = time.time()
    store = str(tmp_path / "retried.zarr")
    partial = {
        "store": store,
        "data": {"max_samples": 60},
        "layout": {"rows_per_chunk": 256, "min_work_chunk_tokens": 1024},  # 6 work chunks
        "run": {"preflight": False, "retries": 1, "retry_delay_seconds": 0},
    }
    # The store as the run will plan it, with a directory where chunk 1's first hidden-state
    # object must go: every write of chunk 1 fails for real.
    deployed = stack.call("GET", f"/deployments/{stack.deployment_id('hsx-extract', 'extract')}")
    defaults = deployed.json()["parameters"]["settings"]
    settings = resolve_settings(HsxSettings.model_validate(merge_partial(defaults, partial)))
    plan_and_create_store(settings)
    opened = ExtractionStore.open(store)
    chunk = opened.work_chunks[1]
    blocker = Path(store) / "hidden_states" / f"c.{chunk.row_start // opened.rows_per_chunk}.0.0"
    blocker.mkdir()

    run_id = stack.run("hsx-extract", "extract", {"settings": partial})
    first = stack.wait(run_id)
    assert first["state_type"] == "FAILED" and "chunk 1: " in first["state"]["message"]
    planned = len(opened.work_chunks)
    assert sorted(opened.committed_chunks()) == [i for i in range(planned) if i != 1]

    blocker.rmdir()
    stack.retry_like_the_ui(run_id)
    second = stack.wait(run_id)
    assert second["state_type"] == "COMPLETED", second["state"]["message"]
    assert second["run_count"] == 2

    commits = opened.committed_chunks()
    assert sorted(commits) == list(range(planned))
    attempts = {i: (c.extra or {}).get("flow_run_attempt") for i, c in commits.items()}
    assert attempts[1] == 2 and all(a == 1 for i, a in attempts.items() if i != 1), attempts
    records = sorted(
        (r for r in opened.run_records() if r["run_id"] == run_id), key=lambda r: r["attempt"]
    )
    assert [(r["attempt"], r["status"]) for r in records] == [(1, "failed"), (2, "completed")]
    assert "1" in records[0]["summary"]["chunk_errors"]
    assert records[1]["summary"]["chunks_extracted_now"] == 1  # only chunk 1 ran again
    chunk_1_runs = [t for t in stack.task_runs(run_id) if t["name"] == "extract-chunk-000001"]
    assert sum(t["run_count"] for t in chunk_1_runs) == 3  # 2 in attempt 1, 1 in attempt 2

    listed = hsx("runs", "--json", env=stack.env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (row,) = [r for r in json.loads(listed.stdout) if r["id"] == run_id]
    assert (
        row["state"] == "Completed" and row["attempts"] == 2 and row["committed"] == planned
    )  # both attempts: planned - 1, then 1
    assert row["store"] == store and row["model"].endswith("tiny-llama")

    shown = hsx("runs", "show", run_id[:8], "--json", env=stack.env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    details = json.loads(shown.stdout)
    assert [(a["attempt"], a["status"]) for a in details["attempts"]] == [
        (1, "failed"),
        (2, "completed"),
    ]
    (failed_task,) = [
        t for t in details["failed_or_retried_tasks"] if t["task"] == "extract-chunk-000001"
    ] or [None]
    assert failed_task is not None and failed_task["failures"], details
    assert "Traceback (most recent call last)" in failed_task["failures"][0]
    assert "IsADirectoryError" in failed_task["failures"][0]

    info = hsx("info", store, env=stack.env)
    assert info.returncode == 0, info.stdout + info.stderr
    text = " ".join(info.stdout.split())
    assert (
        f"run {run_id} attempt 1: failed" in text and f"run {run_id} attempt 2: completed" in text
    )

    # Results are not persisted: what Prefect keeps regardless (a failed state's exception: the
    # failed chunk's and the failed attempt's) lies in the server's Prefect home, nothing under
    # ~/.prefect/storage; and no serializer warning in the logs (every failed chunk had one).
    stored = [p for p in (stack.home / "storage").rglob("*") if p.is_file()]
    assert len(stored) <= 3, stored
    outside = Path.home() / ".prefect" / "storage"
    assert not [p for p in outside.rglob("*") if p.is_file() and p.stat().st_mtime >= started]
    logs = stack.call(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    assert logs and not [
        log["message"] for log in logs if re.search(r"pickl|serializ", log["message"], re.I)
    ]


@ON_SQLITE
def test_a_run_that_fails_before_its_store_exists_keeps_a_record_beside_it(
    stack: Stack, tmp_path: Path
) -> None:
    store = str(tmp_path / "never.zarr")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no reply"}]}\n')
    run_id = stack.run(
        "hsx-extract",
        "extract",
        {"settings": {"store": store, "dataset": str(bad), "run": {"preflight": False}}},
    )
    failed = stack.wait(run_id)
    assert failed["state_type"] == "FAILED" and "bad.jsonl:1" in failed["state"]["message"]
    assert not Path(store).exists()
    (record_path,) = (tmp_path / "never.zarr.runs").glob("*.json")
    record = json.loads(record_path.read_text())
    assert record["run_id"] == run_id and record["failed_in"] == "plan"
    assert "bad.jsonl:1" in record["error"]
    info = hsx("info", store, env=stack.env)
    assert info.returncode == 1 and "failed in plan" in info.stdout, info.stdout + info.stderr


def _start_a_long_extraction(stack: Stack, store: str) -> str:
    """An extraction of ~60 chunks one at a time (tens of seconds, while a Cancel or a stop
    takes a few; storage chunks sized to the 512-token work chunks, logged): its flow run id."""
    settings = {
        "store": store,
        "run": {"preflight": False},
        "layout": {"work_chunk_tokens": 512},
        "pipeline": {"chunks_in_flight": 1},
    }
    return stack.run("hsx-extract", "extract", {"settings": settings})


@ON_SQLITE
def test_a_ui_cancel_ends_cancelled_with_an_honest_record(stack: Stack, tmp_path: Path) -> None:
    """The UI's Cancel of a worker-run extraction (Cancelling, then the runner's SIGTERM): the run
    ends Cancelled, nothing half-committed, and the store's record and `hsx runs` say what this
    attempt committed (chunks and tokens), what it abandoned, and how to finish."""
    from hsx.store.verify import verify_store

    store = str(tmp_path / "cancelled.zarr")
    run_id = _start_a_long_extraction(stack, store)
    commits = Path(store) / "commits"
    deadline = time.monotonic() + 300
    while not (commits.is_dir() and any(commits.glob("chunk-*.json"))):
        state = stack.flow_run(run_id)["state_type"]
        assert time.monotonic() < deadline and state in {"SCHEDULED", "PENDING", "RUNNING"}, state
        time.sleep(0.2)
    stack.call(
        "POST",
        f"/flow_runs/{run_id}/set_state",
        json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True},
    )
    final = stack.wait(run_id, timeout=120)
    assert final["state_type"] == "CANCELLED", final["state"]
    opened = ExtractionStore.open(store)
    planned = len(opened.work_chunks)
    committed = [c for c in opened.committed_chunks().values() if c.run_id == run_id]
    assert 0 < len(committed) < planned
    report = verify_store(opened)
    assert report.state == "INCOMPLETE" and report.intact  # none half-committed
    (record,) = [r for r in opened.run_records() if r["run_id"] == run_id]
    assert record["status"] == "cancelled" and record["reason"] == "cancelled from Prefect"
    assert record["chunks_extracted_now"] == len(committed)
    assert record["tokens_extracted_now"] == sum(c.tokens for c in committed) > 0
    assert record["resume"].startswith("retry the run")
    accounted = {c.chunk_index for c in committed}
    accounted |= set(record["chunks_abandoned"]) | set(record["chunks_not_started"])
    assert accounted == set(range(planned)), record
    listed = hsx("runs", "--json", env=stack.env)
    (row,) = [r for r in json.loads(listed.stdout) if r["id"] == run_id]
    assert row["state"] == "Cancelled" and row["store"] == store
    assert row["committed"] == len(committed) and row["model"].endswith("tiny-llama")


@ON_POSTGRES
def test_a_ui_cancel_of_a_regeneration_ends_cancelled_and_a_retry_finishes_it(
    stack: Stack, tmp_path: Path
) -> None:
    """The UI's Cancel of a worker-run regeneration: the run ends Cancelled (not Failed), the
    chunks committed before it verify, none is half-written, `hsx runs` says so; the UI's Retry
    of the same run then regenerates only the rest."""
    from hsx.regeneration.output import RegeneratedOutput

    out = tmp_path / "cancelled-regeneration"
    chunks = 30  # of 2 conversations, 3 at a time: tens of seconds, while a Cancel takes a few
    settings = {
        "out": str(out),
        "data": {"max_samples": 2 * chunks},
        "generation": {"max_tokens": 64, "conversations_per_chunk": 2},
    }
    run_id = stack.run("hsx-regenerate", "regenerate", {"settings": settings})
    deadline = time.monotonic() + 300
    while not ((out / "commits").is_dir() and any((out / "commits").iterdir())):
        state = stack.flow_run(run_id)["state_type"]
        assert time.monotonic() < deadline and state in {"SCHEDULED", "PENDING", "RUNNING"}, state
        time.sleep(0.2)
    stack.call(
        "POST",
        f"/flow_runs/{run_id}/set_state",
        json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True},
    )
    final = stack.wait(run_id, timeout=120)
    assert final["state_type"] == "CANCELLED", final["state"]
    # The worker reports its own "cancelled successfully" once the flow process has exited, over
    # the flow's Cancelled (and over a Retry sent before it): wait for it, as a user would see.
    deadline = time.monotonic() + 30
    while "cancelled successfully" not in str(stack.flow_run(run_id)["state"]["message"]):
        assert time.monotonic() < deadline, stack.flow_run(run_id)["state"]
        time.sleep(0.5)
    output = RegeneratedOutput(str(out))
    committed = output.committed_indices()
    assert 0 < len(committed) < chunks
    assert output.verify() == []  # every committed part verifies; no part without its commit
    parts = {int(p.name[5:11]) for p in (out / "data").glob("part-*.jsonl")}
    assert committed <= parts  # (a part without its commit counts for nothing)
    before = output.committed()
    runs = json.loads(hsx("runs", "--json", env=stack.env).stdout)
    (row,) = [r for r in runs if r["id"] == run_id]
    assert row["state"] == "Cancelled" and row["store"] == str(out)
    assert row["committed"] == len(committed)
    (attempt,) = json.loads(hsx("runs", "show", run_id, "--json", env=stack.env).stdout)["attempts"]
    assert attempt["status"] == "cancelled" and attempt["reason"] == "cancelled from Prefect"
    assert attempt["chunks_committed_now"] == len(committed)

    stack.retry_like_the_ui(run_id)
    retried = stack.wait(run_id, timeout=600)
    assert retried["state_type"] == "COMPLETED", retried["state"]["message"]
    after = output.committed()
    assert set(after) == set(range(chunks)) and output.verify() == []
    assert {i: after[i] for i in before} == before  # the cancelled attempt's chunks kept
    shown = json.loads(hsx("runs", "show", run_id, "--json", env=stack.env).stdout)
    assert [a["status"] for a in shown["attempts"]] == ["cancelled", "completed"]
    assert shown["attempts"][1]["chunks_committed_now"] == chunks - len(committed)


def _flow_run_process(run_id: str) -> int:
    """The pid of the process the worker started for this flow run: the topmost process whose
    environment or command line names the run (its engine's processes inherit it)."""
    named: dict[int, int] = {}  # pid -> parent pid
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            text = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
            if run_id.encode() in text:
                stat = (entry / "stat").read_text()
                named[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    top = [pid for pid, parent in named.items() if parent not in named]
    assert len(top) == 1, f"expected one process for flow run {run_id}, found {named}"
    return top[0]


@ON_POSTGRES
def test_a_server_restart_keeps_a_running_extractions_concurrency_lease(
    stack: Stack, tmp_path: Path
) -> None:
    """The `extract` deployment's concurrency_limit (one engine per node) holds a lease that the
    run renews every 225 s. infra/prefect-up.sh keeps leases on disk: after a server restart
    mid-run the lease renews (with Prefect's in-memory default it is gone: 410 Gone, measured,
    and Prefect crashes the run), and the run completes. The run is held
    (SIGSTOP) across the restart, which outlasts its work; the renewal is the run's own call,
    made here at once rather than 225 s later."""
    store = str(tmp_path / "leased.zarr")
    settings = {  # ~60 chunks one at a time
        "store": store,
        "run": {"preflight": False},
        "layout": {"work_chunk_tokens": 512},
        "pipeline": {"chunks_in_flight": 1},
    }
    run_id = stack.run("hsx-extract", "extract", {"settings": settings})
    deadline = time.monotonic() + 300
    commits = Path(store) / "commits"
    while not (commits.is_dir() and any(commits.glob("chunk-*.json"))):
        state = stack.flow_run(run_id)["state_type"]
        assert time.monotonic() < deadline and state in {"SCHEDULED", "PENDING", "RUNNING"}, state
        time.sleep(0.2)
    lease = stack.flow_run(run_id)["state"]["state_details"]["deployment_concurrency_lease_id"]
    assert lease, "expected the extract deployment's run to hold a concurrency lease"
    assert (stack.home / "concurrency_leases" / f"{lease}.json").is_file()
    held = _flow_run_process(run_id)
    os.kill(held, signal.SIGSTOP)
    try:
        stack.restart_server(outage_s=2.0)
        assert stack.flow_run(run_id)["state_type"] == "RUNNING"
        renewed = stack.http.post(
            f"/v2/concurrency_limits/leases/{lease}/renew", json={"lease_duration": 300}
        )
        assert renewed.status_code == 204, (renewed.status_code, renewed.text)
    finally:
        os.kill(held, signal.SIGCONT)
    final = stack.wait(run_id, timeout=600)
    assert final["state_type"] == "COMPLETED", final["state"]
    assert not (stack.home / "concurrency_leases" / f"{lease}.json").exists()  # released


@ON_SQLITE
def test_hsx_runs_pages_through_every_run(stack: Stack) -> None:
    """Prefect answers 200 items a call: `hsx runs` and `hsx runs show` read every page."""
    flow = stack.call("POST", "/flows/", json={"name": "hsx-verify"}).json()["id"]
    created = [
        stack.call(
            "POST", "/flow_runs/", json={"flow_id": flow, "name": f"paged-{number:03d}"}
        ).json()["id"]
        for number in range(205)
    ]
    listed = hsx("runs", "--limit", "0", "--json", env=stack.env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    ids = {row["id"] for row in json.loads(listed.stdout)}
    assert set(created) <= ids  # 205 and more: past the first page
    recent = hsx("runs", "--json", env=stack.env)
    assert len(json.loads(recent.stdout)) == 20  # the default: the newest 20
    oldest = hsx("runs", "show", created[0][:13], "--json", env=stack.env)
    assert oldest.returncode == 0, oldest.stdout + oldest.stderr
    assert json.loads(oldest.stdout)["name"] == "paged-000"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@ON_POSTGRES
def test_the_worker_stops_on_one_sigterm_and_keeps_its_state_in_hsx_home(
    stack: Stack, tmp_path: Path
) -> None:
    """infra/start-worker.sh as a non-interactive shell starts it (`... &`, as systemd's and
    compose's shells do): one SIGTERM to the script ends it and its worker, and the worker's
    Prefect home is hsx's, not ~/.prefect."""
    import signal
    import subprocess

    pid_file = tmp_path / "script.pid"
    env = {k: v for k, v in stack.env.items() if k != "PREFECT_HOME"}  # as the README's steps
    env["HSX_PREFECT_HOME"] = str(stack.home)
    shell = subprocess.Popen(
        ["bash", "-c", f"bash {REPO_ROOT}/infra/start-worker.sh & echo $! > {pid_file}; wait"],
        env=env,
        stdout=(tmp_path / "worker.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()):
            time.sleep(0.2)
        script = int(pid_file.read_text())
        workers: list[int] = []
        while not workers and time.monotonic() < deadline:  # after bootstrap.sh and the pool
            time.sleep(0.5)
            workers = [
                child
                for child in _children(script)
                if b"worker\0start" in Path(f"/proc/{child}/cmdline").read_bytes()
            ]
        (worker,) = workers
        # Started: it polls the server (its log says so) before the stop.
        while "Worker" not in (tmp_path / "worker.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        assert f"PREFECT_HOME={stack.home}".encode() in environ
        ignored = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{worker}/status").read_text().splitlines()
                if line.startswith("SigIgn:")
            ),
            16,
        )
        assert not ignored & (1 << (signal.SIGINT - 1)), "the worker ignores SIGINT"
        os.kill(script, signal.SIGTERM)  # one, to the script alone
        assert shell.wait(timeout=60) == 0
        assert not Path(f"/proc/{worker}").exists(), "the worker outlived one SIGTERM"
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def _flow_log_messages(stack: Stack, run_id: str) -> list[str]:
    logs = stack.call(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    return [log["message"] for log in logs]


@ON_SQLITE
def test_two_served_runs_and_a_ui_retry_share_one_model_load(stack: Stack, tmp_path: Path) -> None:
    """The team setup of issue 13: an `hsx serve` beside the stack, and the `extract-served`
    deployment run as the UI runs it. Two flow runs on two stores and a UI Retry of a run whose
    chunk failed all go to the one server: the model is loaded once (its log, its instance in
    every commit, its token counters), while the worker starts a fresh process for every flow
    run and builds no engine there."""
    from hsx.extraction.steps import plan_and_create_store, resolve_settings
    from settings import HsxSettings, merge_partial

    # The deployment's defaults (the tiny Llama the stack built, its own dtype and lengths):
    # `hsx serve` with its defaults serves exactly what those runs freeze.
    server = ServeProcess(REPO_ROOT / "models" / "tiny-llama", tmp_path, "--no-probe")
    server.start()
    try:
        instance = server.info()["instance"]
        tokens_before = server.metric("vllm:prompt_tokens_total")
        common = {
            "data": {"max_samples": 60},
            "engine": {"url": [server.url]},
            "layout": {"rows_per_chunk": 256, "min_work_chunk_tokens": 1024},
            "run": {"retries": 1, "retry_delay_seconds": 0},
        }
        first_store, second_store = str(tmp_path / "one.zarr"), str(tmp_path / "two.zarr")

        first = stack.run(
            "hsx-extract", "extract-served", {"settings": {**common, "store": first_store}}
        )
        done = stack.wait(first)
        assert done["state_type"] == "COMPLETED", done["state"]["message"]

        # The second store, planned as the run will plan it, with a directory where chunk
        # 1's first hidden-state object must go: its writes fail for real.
        partial = {**common, "store": second_store}
        deployment = stack.deployment_id("hsx-extract", "extract-served")
        defaults = stack.call("GET", f"/deployments/{deployment}").json()["parameters"]
        settings = resolve_settings(
            HsxSettings.model_validate(merge_partial(defaults["settings"], partial))
        )
        plan_and_create_store(settings)
        opened = ExtractionStore.open(second_store)
        chunk = opened.work_chunks[1]
        blocker = (
            Path(second_store)
            / "hidden_states"
            / f"c.{chunk.row_start // opened.rows_per_chunk}.0.0"
        )
        blocker.mkdir()
        second = stack.run("hsx-extract", "extract-served", {"settings": partial})
        failed = stack.wait(second)
        assert failed["state_type"] == "FAILED" and "chunk 1: " in failed["state"]["message"]
        blocker.rmdir()
        started = time.monotonic()
        stack.retry_like_the_ui(second)
        retried = stack.wait(second)
        retry_seconds = time.monotonic() - started
        assert retried["state_type"] == "COMPLETED", retried["state"]["message"]
        assert retried["run_count"] == 2

        # One load served the three attempts: every commit of both stores names the one
        # instance, the server started once and loaded its weights once, and it computed
        # (at least) every token of both stores.
        totals = 0
        for store in (first_store, second_store):
            commits = ExtractionStore.open(store).committed_chunks()
            assert sorted(commits) == list(range(len(ExtractionStore.open(store).work_chunks)))
            assert {(c.extra or {})["engine_server"]["instance"] for c in commits.values()} == {
                instance
            }
            totals += sum(c.tokens for c in commits.values())
        log = server.log()
        assert log.count(READY) == 1
        # Counted at its start: tqdm may print the 100% line twice for one load.
        assert log.split("hsx serve: loading", 1)[1].count("checkpoint shards:   0%") == 1
        assert server.metric("vllm:prompt_tokens_total") - tokens_before >= totals
        commits = ExtractionStore.open(second_store).committed_chunks()
        assert commits[1].extra["flow_run_attempt"] == 2
        assert all(c.extra["flow_run_attempt"] == 1 for i, c in commits.items() if i != 1)
        # Each attempt ran in a fresh worker process and checked the server instead of
        # probing a model: no engine was built there.
        for run_id in (first, second):
            logs = " ".join(_flow_log_messages(stack, run_id))
            assert "preflight servers: PASS" in logs, logs[-2000:]
            assert f"on server {server.url} (instance {instance})" in logs, logs[-2000:]
            assert "preflight probe" not in logs
        # The audit: `hsx info` names the server (URL and instance) of every chunk.
        shown = hsx("info", second_store, env=stack.env)
        assert shown.returncode == 0 and "server (instance)" in shown.stdout, shown.stdout
        listed = json.loads(hsx("info", second_store, "--json", env=stack.env).stdout)
        assert [c["extra"]["engine_server"]["url"] for c in listed["commits"]] == [
            server.url
        ] * len(commits)
        print(f"the UI's Retry of the second run took {retry_seconds:.1f} s, no model load")
    finally:
        server.stop()


# The stack as a team leaves it running (issue 44): a schedule creates runs and a worker completes
# one; a worker's SIGTERM (what systemctl stop and docker stop send) ends the extraction it runs
# Cancelled with its record; a flow-run process killed mid-task leaves no task Running; and over
# all of it the server's log holds no ERROR. The log's test stays last in the module.
# The worker's stop mid-run runs on SQLite: on PostgreSQL (after the server-restart test, on two
# busy test workers) it once saw the run Cancelled but the worker script not gone within the
# unit's TimeoutStopSec (120 s); that case is its own issue.


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


@ON_SQLITE  # on PostgreSQL once the worker outlived TimeoutStopSec: see the module note
def test_a_workers_sigterm_ends_its_run_cancelled_with_its_record(
    stack: Stack, tmp_path: Path
) -> None:
    """One SIGTERM to infra/start-worker.sh while an extraction runs (systemctl stop and docker
    stop send that one): the run ends Cancelled, its store record says what it committed,
    abandoned and never started and why, no task is left Running, `hsx runs` shows it, and
    the worker is gone within the unit file's stop timeout."""
    store = str(tmp_path / "stopped.zarr")
    run_id = _start_a_long_extraction(stack, store)
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


@ON_SQLITE
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
    """Over every test of the module on its database (the last of them: schedules, failed and
    retried chunks, Cancels, a worker's stop, a killed run): no ERROR in the server's log
    (SQLite's "database is locked" tracebacks, a failing scheduler)."""
    errors = stack.server_errors()
    assert not errors, f"{len(errors)} ERROR records in {stack.server_log}:\n" + "\n".join(
        errors[:5]
    )
