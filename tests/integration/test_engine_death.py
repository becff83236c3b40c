"""Engine death mid-chunk: the engine core runs in a child process (engine.in_process=False) and
is SIGKILLed while a work chunk is in flight. That chunk fails with an EngineError (transient),
its retry rebuilds the engine and completes (before hsx watched the core, vLLM's sync client
waited forever for outputs once its monitor had seen the core die: the run hung); the run ends Completed with every chunk verified,
the killed chunk committed by a later attempt, and the log names the failure and the chunk."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings
from tests.integration.test_flow import flow_logs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
]


def _engine_cores() -> list[psutil.Process]:
    """vLLM's engine-core children of this process (spawned Python processes)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in child.name() + " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # exited meanwhile
            continue
    return found


def test_sigkill_of_the_engine_core_mid_chunk_is_retried_and_completes(
    prefect_harness: None, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.extract import extract_flow
    from hsx.engine.vllm_engine import close_all_engines

    close_all_engines()  # an in-process engine of another test would be reused
    url = str(tmp_path / "death.zarr")
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        url,
        engine={"in_process": False},
        data={"max_samples": 120},
        layout={"min_work_chunk_tokens": 1024},
        run={"retries": 2, "preflight": False},
        pipeline={"chunks_in_flight": 1},  # one chunk at a time: the kill hits exactly one
    )
    killed: dict[str, Any] = {}
    seen: set[str] = set()

    def kill_after_first_commit() -> None:
        commits = Path(url) / "commits"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = list(commits.glob("chunk-*.json")) if commits.exists() else []
            cores = _engine_cores()
            for child in psutil.Process().children(recursive=True):
                try:
                    seen.add(f"{child.pid}:{child.name()}")
                except psutil.Error:  # exited meanwhile (a compile or tokenizer helper)
                    continue
            # Mid-chunk: a later chunk's prompts are queued at the engine. (Killed between
            # chunks, the next chunk finds the engine dead and rebuilds it before any work:
            # nothing fails, nothing to retry, and this test would see no retried chunk.)
            if done and cores and _requests_in_flight():
                killed["after"] = len(done)
                killed["pids"] = [core.pid for core in cores]
                for core in cores:
                    os.kill(core.pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    def _requests_in_flight() -> bool:
        from hsx.engine.vllm_engine import loaded_engines

        return any(engine.pending_requests > 0 for engine in loaded_engines())

    killer = threading.Thread(target=kill_after_first_commit, daemon=True)
    killer.start()
    try:
        summary = extract_flow(settings)
    finally:
        killer.join(timeout=5)
        close_all_engines()
    assert killed.get("pids"), f"the engine core was never seen in a child process: {seen}"
    assert summary["verified"] and summary["chunks_failed"] == []
    store = ExtractionStore.open(url)
    commits = store.committed_chunks()
    assert sorted(commits) == list(range(summary["chunks"]))
    retried = [index for index, record in commits.items() if record.attempt > 1]
    assert len(retried) == 1, {i: r.attempt for i, r in commits.items()}
    (chunk,) = retried
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    assert run.state is not None and run.state.is_completed()
    failures = [m for m in flow_logs(run.id) if f"work chunk {chunk} failed (transient" in m]
    assert failures and "EngineError" in failures[0], failures
    # The log names the signal: vLLM's own error (EngineDeadError) does not.
    assert "died of SIGKILL" in failures[0], failures[0][:2000]
    print(f"killed {killed}; chunk {chunk} retried: {failures[0][:300]}")
