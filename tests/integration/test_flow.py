"""The extraction flow under a real Prefect engine (prefect_test_harness), end to end, then:
a second run extracts nothing; a chunk that fails for real is retried alone with its traceback in
the logs, the run ends Failed, and the next run redoes only that chunk."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx.store.zarr_store import ExtractionStore
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def flow_logs(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs reach the API in batches
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200
        )
    return [log.message for log in logs]


def task_runs(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return list(
            client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        )


def test_flow_end_to_end_then_nothing_twice(
    prefect_harness: None, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from flows.extract import extract_flow

    url = str(tmp_path / "flow.zarr")
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        url,
        data={"max_samples": 60},
        layout={"min_work_chunk_tokens": 1024},
    )
    first = extract_flow(settings)
    assert first["verified"] and first["chunks"] >= 3
    assert (
        first["chunks_extracted_now"] == first["chunks"]
        and first["tokens_extracted_now"] == first["tokens"]
    )
    store = ExtractionStore.open(url)
    commits = store.committed_chunks()
    assert sorted(commits) == list(range(first["chunks"]))
    runs = {r["run_id"]: r for r in store.run_records()}
    assert len(runs) == 1 and next(iter(runs.values()))["status"] == "completed"
    assert {c.run_id for c in commits.values()} == set(runs)

    second = extract_flow(settings)
    assert (
        second["verified"]
        and second["chunks_extracted_now"] == 0
        and second["tokens_extracted_now"] == 0
    )
    assert store.committed_chunks() == commits  # same records: nothing was extracted again
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        latest = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    # The engine of the first run is alive in this process: the probe does not evict it.
    assert any("skipped: the real engine is loaded" in m for m in flow_logs(latest.id))
    assert len(list(store.run_records())) == 2

    # A third run with other layer ids is refused by the flow's first task, before the probe
    # could build a model or planning re-tokenize the dataset.
    changed = settings.model_copy(
        update={"capture": settings.capture.model_copy(update={"layer_ids": [1, 3]})}
    )
    refused = extract_flow(changed, return_state=True)
    assert refused.is_failed()
    with pytest.raises(Exception, match=r"Changed: layer_ids .*this run \[1, 3\]"):
        refused.result()
    names = [run.name for run in task_runs(refused.state_details.flow_run_id)]
    assert len(names) == 1 and names[0].startswith("resume-check"), names
    # The refused run keeps its record too (audit keeps every attempt), naming why.
    refused_record = [r for r in store.run_records() if r["status"] == "failed"]
    assert len(list(store.run_records())) == 3 and len(refused_record) == 1
    assert refused_record[0]["failed_in"] == "resume-check"
    assert "Changed: layer_ids" in refused_record[0]["error"]

    # hsx verify: exit 0 on this store; 1 once a stored byte flips.
    verify = [sys.executable, "-m", "flows.cli", "verify", url]
    ok = subprocess.run(verify, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    info = subprocess.run(
        [sys.executable, "-m", "flows.cli", "info", url, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    audit = json.loads(info.stdout)
    assert len(audit["commits"]) == first["chunks"] and len(audit["runs"]) == 3
    assert (
        audit["meta"]["layer_ids"] == [2, 4, 5, 8] and audit["meta"]["layer_convention"] == "vllm"
    )
    step = store.rows_per_chunk
    before = {
        name: store.read_rows(name, 0, store.work_chunks[-1].row_end)
        for name in ("input_ids", "loss_mask")
    }
    states_before = store.read_rows("hidden_states", 0, store.work_chunks[3].row_end)
    victim = sorted((tmp_path / "flow.zarr" / "loss_mask").glob("c.*"))[0]
    victim.write_bytes(bytes([victim.read_bytes()[0] ^ 1]) + victim.read_bytes()[1:])
    bad = subprocess.run(verify, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert bad.returncode == 1 and "Stored:" in bad.stdout, bad.stdout + bad.stderr

    # One flipped byte in each kind of row object (token ids, loss mask, hidden states), in
    # three chunks; hsx verify --repair, given the model and dataset, re-extracts exactly those.
    root = tmp_path / "flow.zarr"
    targets = {"loss_mask": 0, "input_ids": 1, "hidden_states": 2}
    for name, index in list(targets.items())[1:]:
        # A row in the middle of the chunk's first C rows, in whichever object holds it (the
        # token arrays' objects span many chunks).
        row = store.work_chunks[index].row_start + step // 2
        size, array = store.object_rows(name), store.array(name)
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
        suffix = ".0.0" if name == "hidden_states" else ""
        victim = root / name / f"c.{row // size}{suffix}"
        data = bytearray(victim.read_bytes())
        data[(row % size) * row_bytes + row_bytes // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    old = {index: store.read_commit(index) for index in targets.values()}
    # Chunk 3's commit record cut in half (it no longer parses), and one flipped byte in each
    # sample index array (written at creation; no commit covers them).
    record = root / "commits" / "chunk-000003.json"
    old[3] = store.read_commit(3)
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])
    index_before = store.sample_rows(0, store.meta["num_samples"])
    for victim in (root / "sample_starts" / "c" / "0", root / "sample_lengths" / "c.0"):
        data = bytearray(victim.read_bytes())
        data[9] ^= 0x01
        victim.write_bytes(bytes(data))
    found = subprocess.run(verify, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "chunk-000003.json: expected a JSON commit record" in found.stdout.replace("\n", "")
    assert found.stdout.count("sample index") >= 2, found.stdout
    repair = subprocess.run(
        [*verify, "--repair", "--model", str(tiny_llama), "--dataset", str(sample_dataset)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    output = repair.stdout + repair.stderr
    assert repair.returncode == 0, output
    assert "dropped the commit records of chunks [0, 1, 2, 3]" in output, output
    store = ExtractionStore.open(url)
    assert sorted(store.committed_chunks()) == list(range(first["chunks"]))
    for index in old:
        assert store.read_commit(index).run_id != old[index].run_id  # type: ignore[union-attr]
    index_after = store.sample_rows(0, store.meta["num_samples"])
    assert all((a == b).all() for a, b in zip(index_after, index_before, strict=True))
    for index in range(4, first["chunks"]):
        assert store.read_commit(index) == commits[index]  # the others were not extracted again
    after = {name: store.read_rows(name, 0, store.work_chunks[-1].row_end) for name in before}
    assert all((after[name] == before[name]).all() for name in before)  # token rows restored
    # The re-extracted chunks hold the states they held (fp32: the engine's run-to-run spread).
    states_after = store.read_rows("hidden_states", 0, store.work_chunks[3].row_end)
    assert states_after.shape == states_before.shape
    assert float(np.abs(states_after - states_before).max()) <= 1e-5
    again = subprocess.run(verify, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert any(r["status"] == "repaired" for r in store.run_records())


def test_failed_chunk_retries_alone_and_resumes(
    prefect_harness: None, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.extract import ExtractionIncompleteError, extract_flow

    url = str(tmp_path / "fault.zarr")
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        url,
        data={"max_samples": 60},
        layout={"min_work_chunk_tokens": 1024},
        run={"retries": 2},
    )
    # A real storage fault: a directory where work chunk 1's first hidden-state object must go,
    # so every write of that chunk fails (root ignores permission bits).
    from hsx.extraction.steps import plan_and_create_store

    plan = plan_and_create_store(settings)
    store = ExtractionStore.open(url)
    chunk = store.work_chunks[1]
    # A directory where chunk 1's first hidden-state object must go: every write of it fails.
    first_object = chunk.row_start // store.rows_per_chunk
    blocker = tmp_path / "fault.zarr" / "hidden_states" / f"c.{first_object}.0.0"
    blocker.mkdir(parents=True)

    with pytest.raises(ExtractionIncompleteError) as incomplete:
        extract_flow(settings)
    # The failed chunks are listed with their errors, in the error and in the run record.
    assert re.search(
        r"1 failed, 0 not started.*\n  chunk 1: .*IsADirectoryError", str(incomplete.value), re.S
    ), str(incomplete.value)
    assert sorted(store.committed_chunks()) == [i for i in range(plan.chunks) if i != 1]
    (record,) = [r for r in store.run_records() if r["status"] == "failed"]
    assert list(record["summary"]["chunk_errors"]) == ["1"]
    assert "IsADirectoryError" in record["summary"]["chunk_errors"]["1"]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    failed_run = runs[0]
    assert failed_run.state is not None and failed_run.state.is_failed()
    chunk_runs = {tr.name: tr for tr in task_runs(failed_run.id)}
    failing = chunk_runs["extract-chunk-000001"]
    assert (
        failing.run_count == 3 and failing.state is not None and failing.state.is_failed()
    )  # 1 + 2 retries
    assert all(
        tr.run_count == 1
        for name, tr in chunk_runs.items()
        if name.startswith("extract-chunk-") and name != "extract-chunk-000001"
    )
    messages = flow_logs(failed_run.id)
    failures = [m for m in messages if "work chunk 1 failed (transient" in m]
    assert len(failures) == 3 and all("Traceback (most recent call last)" in m for m in failures), (
        messages[-5:]
    )

    blocker.rmdir()
    resumed = extract_flow(settings)
    assert resumed["verified"] and resumed["chunks_extracted_now"] == 1
    assert sorted(store.committed_chunks()) == list(range(plan.chunks))
    assert (
        store.read_commit(1) is not None
        and store.read_commit(1).run_id != store.read_commit(0).run_id
    )  # type: ignore[union-attr]


def test_fatal_bad_dataset_line_is_not_retried(
    prefect_harness: None, tiny_llama: Path, tmp_path: Path
) -> None:
    from flows.extract import extract_flow
    from hsx.errors import DatasetError

    dataset = tmp_path / "bad.jsonl"
    good = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    dataset.write_text(
        json.dumps(good) + "\n" + '{"messages": [{"role": "user", "content": "no reply"}]}\n'
    )
    url = str(tmp_path / "never.zarr")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: .*assistant"):
        extract_flow(make_settings(tiny_llama, dataset, url))
    assert not Path(url).exists()


def test_a_fatal_error_in_a_chunk_task_runs_once(
    prefect_harness: None, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """The real chunk task with retries=3 and a real fatal error inside it (a work chunk the
    store's plan does not have): retry_unless_fatal refuses every retry, so it runs once, and
    its log says so with the traceback. (Transient faults retrying: the test above.)"""
    from prefect import flow

    from hsx.extraction.run import ExtractionRun
    from hsx.extraction.steps import plan_and_create_store
    from tasks.extract import extract_chunk_task

    settings = make_settings(tiny_llama, sample_dataset, str(tmp_path / "s.zarr"))
    plan = plan_and_create_store(settings)
    missing_chunk = plan.chunks + 5
    run = ExtractionRun.open(settings)

    @flow(name="hsx-fatal-chunk")
    def one_chunk() -> Any:
        task = extract_chunk_task.with_options(retries=3, retry_delay_seconds=0)
        return task(run, missing_chunk, return_state=True)

    from hsx.errors import ConfigError

    with run, pytest.raises(ConfigError, match=rf"work chunk {missing_chunk}: expected 0\.\."):
        one_chunk()  # a flow that returns a failed state raises its error
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    (chunk_run,) = [tr for tr in task_runs(run.id) if tr.name.startswith("extract-chunk-")]
    assert chunk_run.run_count == 1, f"expected 1 run of a fatal error, found {chunk_run.run_count}"
    messages = flow_logs(run.id)
    failures = [
        m for m in messages if f"work chunk {missing_chunk} failed (fatal, not retried)" in m
    ]
    assert len(failures) == 1 and "Traceback (most recent call last)" in failures[0], messages
    assert f"expected 0..{plan.chunks - 1}" in failures[0]
