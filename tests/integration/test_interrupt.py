"""Ctrl-C (SIGINT to the process group, as a terminal sends it) and SIGTERM (a scheduler's stop)
during `hsx extract`: the CLI exits within seconds with what is committed and how to resume, its
temporary Prefect server does not outlive it, nothing half-committed is left, and the resume
completes. Also: the temporary server dies with a CLI killed by SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import REPO_ROOT
from tests.integration.test_kill_resume import extract_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The CLI's own grace is 10 s; a clean stop takes about one.
EXIT_WITHIN_S = 15.0


def start_and_wait_for_first_commit(command: list[str], store: Path) -> subprocess.Popen[str]:
    """The CLI as a user starts it: no PREFECT_API_URL, so it starts (and owns) a temporary
    Prefect server, whose fate under the signals is part of what is checked here."""
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
        start_new_session=True,  # its own process group, like a job in a terminal
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    commits = store / "commits"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if commits.is_dir() and any(p.name.endswith(".json") for p in commits.iterdir()):
            return process
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no commit before the run ended: {process.communicate()[0][-3000:]}")


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def still_running(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize(
    ("signum", "to_group", "expected_code"),
    [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
    ids=["ctrl-c-to-the-group", "sigterm-to-the-cli"],
)
def test_a_signal_stops_the_run_within_seconds_and_the_resume_completes(
    tiny_llama: Path,
    sample_dataset: Path,
    tmp_path: Path,
    signum: int,
    to_group: bool,
    expected_code: int,
) -> None:
    store = tmp_path / "stopped.zarr"
    command = extract_command(tiny_llama, sample_dataset, store)
    process = start_and_wait_for_first_commit(command, store)
    children = descendants(process.pid)
    assert any("uvicorn" in " ".join(c.cmdline()) for c in children), "no temporary server"
    sent = time.monotonic()
    (os.killpg if to_group else os.kill)(process.pid, signum)
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    assert process.returncode == expected_code, output[-3000:]
    assert took < EXIT_WITHIN_S, f"expected an exit within {EXIT_WITHIN_S} s, took {took:.1f} s"
    time.sleep(1.0)
    assert still_running(children) == []  # the temporary server and any engine process
    assert f"stopped by {signal.Signals(signum).name} (flow run Cancelled)" in output
    assert "Finished in state Cancelled(" in output  # not Crashed, not Failed
    assert "resume with: hsx extract" in output

    opened = ExtractionStore.open(str(store))
    done = opened.committed_chunks()
    planned = len(opened.work_chunks)
    assert 0 < len(done) < planned, f"{len(done)} of {planned} chunks committed"
    assert f"{len(done)}/{planned} work chunks" in output
    report = verify_store(opened)
    assert report.problems == [] and report.chunks_verified == len(done)  # none half-committed
    (run,) = opened.run_records()
    assert run["status"] == "interrupted" and run["chunks_extracted_now"] == len(done)
    assert run["reason"] == f"{signal.Signals(signum).name} received"
    assert run["tokens_extracted_now"] == sum(record.tokens for record in done.values()) > 0
    assert run["resume"].startswith("resume with: hsx extract --model")
    # Every chunk is committed, abandoned before its commit, or was never started.
    accounted = set(done) | set(run["chunks_abandoned"]) | set(run["chunks_not_started"])
    assert accounted == set(range(planned)), run

    resumed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    final = ExtractionStore.open(str(store))
    records = final.committed_chunks()
    assert sorted(records) == list(range(planned)) and verify_store(final).ok
    for index, record in done.items():  # what the stopped run committed was kept, not redone
        assert records[index].finished_at == record.finished_at


def test_the_temporary_server_dies_with_a_killed_cli(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """SIGKILL of the CLI alone (what the kernel's OOM killer does): its server must not be left
    running as an orphan."""
    store = tmp_path / "killed.zarr"
    process = start_and_wait_for_first_commit(
        extract_command(tiny_llama, sample_dataset, store), store
    )
    servers = [c for c in descendants(process.pid) if "uvicorn" in " ".join(c.cmdline())]
    assert len(servers) == 1
    process.kill()  # the CLI alone, not its group
    process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while still_running(servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(servers) == []
    with contextlib.suppress(ProcessLookupError):  # whatever else of the run is left
        os.killpg(process.pid, signal.SIGKILL)
