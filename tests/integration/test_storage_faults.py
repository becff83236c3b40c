"""Storage faults under the real flow, engine and stores (DESIGN.md "Storage faults"):

- a local disk that fills up (a small tmpfs, filled after the first commit) or turns read-only
  (remounted) mid-run: the chunk fails with a fatal error naming the store and the free space,
  is not retried, nothing is half-committed, and the re-run after the fix extracts exactly the
  missing chunks;
- an EIO of one object write (injected at the write syscall: no device here produces one on
  demand) is retried and the run completes;
- an S3-compatible store (moto's server on 127.0.0.1, s3fs) behind a fault proxy that throttles
  (503 SlowDown) and drops connections: the run completes, verifies, and reads back through the
  reader equal to a local store's run;
- a write that fails for good on each backend (local, memory://, s3://) costs that one chunk:
  the run ends Failed naming it, no commit for it, the re-run after the fix redoes only it.

Mounting needs root (CI runs as root here); the two mount tests skip elsewhere, saying why.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.cli import hsx
from tests.conftest import make_settings, missing_component
from tests.fault_proxy import FaultProxy
from tests.integration.test_flow import flow_logs, task_runs
from tests.servers import moto_s3, s3_config
from tests.stores import compare_stores

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

BUCKET = "hsx-faults"
# The store of 60 samples: 5,888 rows of 4 x 256 fp32 states, 24 MB, in 6 work chunks of
# 1,024 rows (4 MB each, 4 hidden-state objects of 256 rows).
DISK_SIZE = "40m"
CHUNK_1_FIRST_OBJECT = "c.4.0.0"  # rows [1024, 1280): chunk 1's first hidden-state object


def _settings(store: str, tiny_llama: Path, dataset: Path, **sections: dict[str, Any]) -> Any:
    run = {"retries": 1, **sections.pop("run", {})}
    return make_settings(
        tiny_llama,
        dataset,
        store,
        data={"max_samples": 60},
        layout={"min_work_chunk_tokens": 1024},
        pipeline={"chunks_in_flight": 1},  # in order, one at a time: faults hit known chunks
        run=run,
        **sections,
    )


def _latest_flow_run() -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]


def _chunk_run_counts(flow_run_id: Any) -> dict[int, int]:
    return {
        int(run.name.removeprefix("extract-chunk-").split("-")[0]): run.run_count
        for run in task_runs(flow_run_id)
        if run.name.startswith("extract-chunk-")
    }


def _after_first_commit(store: Path, action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` the moment the store's first commit record appears."""

    def watch() -> None:
        commits = store / "commits"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if commits.is_dir() and any(p.suffix == ".json" for p in commits.iterdir()):
                action()
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, name="fault-after-first-commit", daemon=True)
    thread.start()
    return thread


# ---- a local disk that fills up or turns read-only -----------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        missing_component("mounting a tmpfs needs root (CI runs as root on these machines)")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        missing_component(f"mount -t tmpfs refused here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path) -> None:
    """Take every free byte of the file system (fallocate: instant on tmpfs)."""
    stats = os.statvfs(disk)
    fd = os.open(disk / "filler", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, stats.f_bavail * stats.f_frsize)
    finally:
        os.close(fd)


def _remount(disk: Path, mode: str) -> None:
    for _ in range(200):  # EBUSY while a file is open for writing: retry until the write ends
        if subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)]).returncode == 0:
            return
        time.sleep(0.005)
    raise RuntimeError(f"could not remount {disk} {mode}")


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_disk_is_fatal_then_the_rerun_completes(
    fault: str, small_disk: Path, prefect_harness: None, tiny_llama: Path, sample_dataset: Path
) -> None:
    from flows.extract import ExtractionIncompleteError, extract_flow

    store_path = small_disk / "store.zarr"
    settings = _settings(str(store_path), tiny_llama, sample_dataset)
    inject = (
        (lambda: _fill(small_disk)) if fault == "full" else (lambda: _remount(small_disk, "ro"))
    )
    watcher = _after_first_commit(store_path, inject)
    with pytest.raises(ExtractionIncompleteError) as incomplete:
        extract_flow(settings)
    watcher.join(timeout=5)
    failed_run = _latest_flow_run()
    error, reason = {
        "full": ("StorageFullError", "no space left on device"),
        "read-only": ("StoreReadOnlyError", "read-only file system"),
    }[fault]
    message = str(incomplete.value)
    assert error in message and reason in message, message
    # The disk refused the run record too: the error still lists the failed chunks and says so.
    assert re.search(r"\n  chunk \d+: ", message) and "run record could not be written" in message

    store = ExtractionStore.open(str(store_path))
    committed = sorted(store.committed_chunks())
    planned = len(store.work_chunks)
    # The chunks before the fault are committed (a prefix: one chunk at a time, in order);
    # none after it, and nothing half-committed: every commit verifies, no temp file is left.
    assert committed and committed == list(range(len(committed))) and len(committed) < planned
    report = verify_store(store)
    assert report.problems == [] and report.chunks_verified == len(committed)
    assert not [p for p in store_path.rglob("*") if ".tmp-" in p.name]
    counts = _chunk_run_counts(failed_run.id)
    failing = [index for index in counts if index not in committed]
    # Fatal: each failing chunk ran once (retries=1 would run a transient failure twice).
    assert failing and all(counts[index] == 1 for index in failing), counts
    logs = flow_logs(failed_run.id)
    assert any(f"work chunk {failing[0]} failed (fatal, not retried)" in m for m in logs)
    if fault == "full":
        assert any("bytes free of" in m for m in logs), "the error names the free space"

    # The fix (free the space / remount read-write), then the re-run completes the store.
    if fault == "full":
        (small_disk / "filler").unlink()
    else:
        _remount(small_disk, "rw")
    resumed = extract_flow(settings)
    assert resumed["verified"] and resumed["chunks_extracted_now"] == planned - len(committed)
    assert sorted(store.committed_chunks()) == list(range(planned))


def test_an_io_error_of_one_write_is_retried_and_the_run_completes(
    prefect_harness: None,
    tiny_llama: Path,
    sample_dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EIO from the write syscall of chunk 1's first hidden-state object, once. No device here
    produces an EIO on demand (no device-mapper in this kernel), so it is raised where the
    kernel's would surface: hsx.store.local_io._write_all, under the real store and flow."""
    import hsx.store.local_io
    from flows.extract import extract_flow

    real_write_all = hsx.store.local_io._write_all
    raised: list[str] = []

    def write_all_failing_once(fd: int, payload: memoryview) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not raised and f"/hidden_states/{CHUNK_1_FIRST_OBJECT}.tmp-" in target:
            raised.append(target)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_write_all(fd, payload)

    monkeypatch.setattr(hsx.store.local_io, "_write_all", write_all_failing_once)
    url = str(tmp_path / "eio.zarr")
    summary = extract_flow(_settings(url, tiny_llama, sample_dataset))
    assert raised and summary["verified"] and summary["chunks_failed"] == []
    run = _latest_flow_run()
    counts = _chunk_run_counts(run.id)
    assert counts[1] == 2 and all(n == 1 for i, n in counts.items() if i != 1), counts
    logs = flow_logs(run.id)
    failure = [m for m in logs if "work chunk 1 failed (transient" in m]
    assert len(failure) == 1 and "StorageIOError" in failure[0] and "errno EIO" in failure[0]
    assert f"hidden_states/{CHUNK_1_FIRST_OBJECT}" in failure[0]
    store = ExtractionStore.open(url)
    assert store.read_commit(1) is not None and store.read_commit(1).attempt == 2  # type: ignore[union-attr]


# ---- an S3-compatible store ------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_proxy(tmp_path_factory: Any) -> Iterator[FaultProxy]:
    """moto's S3 server on 127.0.0.1 behind the fault proxy; s3fs pointed at the proxy through
    fsspec's config (what FSSPEC_S3 sets for a CLI), botocore's retries bounded."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with (
        moto_s3(log) as port,
        pytest.MonkeyPatch.context() as patch,
        FaultProxy(port) as proxy,
    ):
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setitem(fsspec.config.conf, "s3", s3_config(proxy.url))
        fsspec.filesystem("s3").mkdir(BUCKET)
        yield proxy


@pytest.fixture(scope="module")
def local_reference(
    prefect_harness: None, tiny_llama: Path, sample_dataset: Path, tmp_path_factory: Any
) -> str:
    """The same extraction into a local store, uninterrupted and fault-free."""
    from flows.extract import extract_flow

    url = str(tmp_path_factory.mktemp("reference") / "local.zarr")
    assert extract_flow(_settings(url, tiny_llama, sample_dataset))["verified"]
    return url


def test_s3_store_survives_throttling_and_dropped_connections(
    s3_proxy: FaultProxy,
    local_reference: str,
    prefect_harness: None,
    tiny_llama: Path,
    sample_dataset: Path,
) -> None:
    from flows.extract import extract_flow
    from hsx.errors import StorageIOError

    url = f"s3://{BUCKET}/throttled.zarr"
    # Every 5th request is answered 503 SlowDown or dropped unanswered, 30 of them: botocore's
    # own retries absorb them.
    s3_proxy.arm(period=5, kinds=("slowdown", "drop"), limit=30)
    try:
        summary = extract_flow(_settings(url, tiny_llama, sample_dataset))
    finally:
        injected = dict(s3_proxy.injected)
        s3_proxy.clear()
    assert summary["verified"] and summary["chunks_failed"] == []
    assert injected.get("slowdown", 0) >= 10 and injected.get("drop", 0) >= 10, injected

    store = ExtractionStore.open(url)
    assert verify_store(store).ok
    difference = compare_stores(url, local_reference)
    assert difference.samples == 60
    # The same engine in the same process, the same batches (one chunk at a time): equal.
    assert difference.max_abs_hidden <= 1e-5, difference

    # `hsx verify` from another process finds the store through FSSPEC_S3, as a user's would.
    verified = hsx("verify", url, env={"FSSPEC_S3": json.dumps(s3_config(s3_proxy.url))})
    assert verified.returncode == 0 and "OK: 6/6 chunks verified" in verified.stdout, (
        verified.stdout + verified.stderr
    )

    # A dead endpoint: a clear StorageIOError naming the store within seconds, not a hang.
    s3_proxy.refuse_all()
    started = time.monotonic()
    try:
        with pytest.raises(StorageIOError, match=rf"store {url}: expected to check .*"):
            ExtractionStore.open(url)
    finally:
        s3_proxy.clear()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("backend", ["local", "memory", "s3"])
def test_a_write_that_fails_for_good_costs_that_chunk_alone(
    backend: str,
    request: pytest.FixtureRequest,
    local_reference: str,
    prefect_harness: None,
    tiny_llama: Path,
    sample_dataset: Path,
    tmp_path: Path,
) -> None:
    """Chunk 1's first hidden-state object cannot be written: a directory in its place (local,
    memory://), or a persistent HTTP 500 for its key (s3://)."""
    from flows.extract import ExtractionIncompleteError, extract_flow
    from hsx.extraction.steps import plan_and_create_store

    url = {
        "local": str(tmp_path / "blocked.zarr"),
        "memory": f"memory://blocked-{os.getpid()}-{time.monotonic_ns()}.zarr",
        "s3": f"s3://{BUCKET}/blocked.zarr",
    }[backend]
    settings = _settings(url, tiny_llama, sample_dataset)
    plan_and_create_store(settings)
    store = ExtractionStore.open(url)
    blocked = f"{store.root}/hidden_states/{CHUNK_1_FIRST_OBJECT}"
    proxy: FaultProxy | None = None
    if backend == "s3":
        proxy = request.getfixturevalue("s3_proxy")
        proxy.fail_requests("PUT", f"/hidden_states/{CHUNK_1_FIRST_OBJECT}")
    else:
        store.fs.mkdir(blocked)
    try:
        with pytest.raises(ExtractionIncompleteError) as incomplete:
            extract_flow(settings)
    finally:
        if proxy is not None:
            proxy.clear()
    assert "chunk 1: " in str(incomplete.value), str(incomplete.value)
    planned = len(store.work_chunks)
    assert sorted(store.committed_chunks()) == [i for i in range(planned) if i != 1]
    report = verify_store(store)
    assert report.missing == [1] and report.problems == []
    counts = _chunk_run_counts(_latest_flow_run().id)
    assert counts[1] == 2 and all(n == 1 for i, n in counts.items() if i != 1), counts

    if backend != "s3":
        store.fs.rm(blocked, recursive=True)
    resumed = extract_flow(settings)
    assert resumed["verified"] and resumed["chunks_extracted_now"] == 1
    assert sorted(store.committed_chunks()) == list(range(planned))
    difference = compare_stores(url, local_reference)
    assert difference.samples == 60 and difference.max_abs_hidden <= 1e-5, difference


def test_a_dataset_on_s3_plans_as_its_local_copy(
    s3_proxy: FaultProxy, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """--dataset as an fsspec URL: a JSONL file, a glob of Parquet files and a save_to_disk
    folder on the S3-compatible server plan to the local file's tokens, and a changed object
    changes the dataset's digest."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsx.data.tokenization import fingerprint_dataset
    from hsx.extraction.steps import plan_and_create_store

    rows = [json.loads(line) for line in sample_dataset.read_text().splitlines()[:16]]
    s3 = fsspec.filesystem("s3")
    s3.pipe(f"{BUCKET}/data/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    for part, half in enumerate((rows[:8], rows[8:])):
        pq.write_table(pa.Table.from_pylist(half), tmp_path / f"part-{part}.parquet")
        s3.put(str(tmp_path / f"part-{part}.parquet"), f"{BUCKET}/data/parquet/part-{part}.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    s3.put(str(tmp_path / "saved"), f"{BUCKET}/data/saved", recursive=True)
    local = tmp_path / "rows.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def tokens(dataset: str | Path, name: str) -> np.ndarray:
        url = str(tmp_path / f"{name}.zarr")
        assert plan_and_create_store(make_settings(tiny_llama, dataset, url)).samples == 16  # type: ignore[arg-type]
        store = ExtractionStore.open(url)
        return store.read_rows("input_ids", 0, int(store.meta["total_rows"]))

    expected = tokens(local, "local")
    for name, url in {
        "jsonl": f"s3://{BUCKET}/data/rows.jsonl",
        "parquet": f"s3://{BUCKET}/data/parquet/part-*.parquet",
        "saved": f"s3://{BUCKET}/data/saved",
    }.items():
        assert np.array_equal(tokens(url, name), expected), name
    before = fingerprint_dataset(f"s3://{BUCKET}/data/rows.jsonl")
    assert before == fingerprint_dataset(local)  # the same bytes, wherever they are
    s3.pipe(f"{BUCKET}/data/rows.jsonl", local.read_bytes() + b"\n")
    assert fingerprint_dataset(f"s3://{BUCKET}/data/rows.jsonl") != before


def test_an_export_to_s3_survives_throttling_verifies_and_reads_back(
    s3_proxy: FaultProxy, local_reference: str, prefect_harness: None
) -> None:
    """`hsx export --out s3://...`: the ModelOpt files written through a throttling endpoint,
    the manifest verifies there, each file read back from S3 holds the reader's tensors, and
    a flipped byte in one object is found."""
    import io

    import torch

    from flows.export import export_flow
    from hsx.store.reader import HiddenStatesReader
    from hsx.trainers.export import verify_export

    out = f"s3://{BUCKET}/export-modelopt"
    s3_proxy.arm(period=7, kinds=("slowdown", "drop"), limit=12)
    try:
        summary = export_flow(local_reference, out, "modelopt", writers=3)  # type: ignore[arg-type]
    finally:
        injected = dict(s3_proxy.injected)
        s3_proxy.clear()
    assert injected.get("slowdown", 0) + injected.get("drop", 0) >= 6, injected
    assert summary["verification"].startswith("OK"), summary
    reader = HiddenStatesReader(local_reference)
    assert summary["samples"] == len(reader.available_samples) == 60
    s3 = fsspec.filesystem("s3")
    files = sorted(json.loads(s3.cat_file(f"{BUCKET}/export-modelopt/hsx-export.json"))["files"])
    seen = 0
    for relative in files:
        if not relative.endswith(".pt"):
            continue
        item = torch.load(io.BytesIO(s3.cat_file(f"{BUCKET}/export-modelopt/{relative}")))
        sample = reader.sample(int(item["conversation_id"]))
        assert torch.equal(item["input_ids"], sample.input_ids)
        assert torch.equal(item["hidden_states"], sample.target_hidden_states)
        assert torch.equal(item["aux_hidden_states"], sample.aux_hidden_states)
        seen += 1
    assert seen == 60
    victim = next(relative for relative in files if relative.endswith(".pt"))
    data = bytearray(s3.cat_file(f"{BUCKET}/export-modelopt/{victim}"))
    data[len(data) // 2] ^= 0x01
    s3.pipe_file(f"{BUCKET}/export-modelopt/{victim}", bytes(data))
    report = verify_export(out)
    assert not report.ok and len(report.mismatched) == 1, report
    assert report.mismatched[0].startswith(f"{victim}: expected"), report


def test_racing_commits_of_one_chunk_on_s3_leave_exactly_one_winner(
    s3_proxy: FaultProxy, host: Any
) -> None:
    """Commit records on S3 are conditional PUTs (If-None-Match: *): twelve attempts at one
    chunk at once through the proxy, exactly one commits and the others get its record back;
    the same record put again (a PUT retried after its answer was lost) is no collision."""
    from hsx.extraction.chunk_extraction import RunContext, extract_chunk
    from tests.unit.test_plan_store import StatesEngine, make_plan, meta, race_one_commit

    url = f"s3://{BUCKET}/race-{os.getpid()}-{time.monotonic_ns()}"
    plan = make_plan([30, 30], work=32)
    store = ExtractionStore.open_or_create(url, plan, meta())
    first = extract_chunk(host, store, plan.chunks[0], StatesEngine(), 100, RunContext("first"))
    assert store.write_commit(first) is None  # its own record again: not a race
    race_one_commit(store, first, plan.chunks[1], racers=12)
    again = extract_chunk(host, store, plan.chunks[0], StatesEngine(), 100, RunContext("late"))
    assert again.extra["collision"]["winner"]["run_id"] == "first"
    assert [c["loser"]["run_id"] for c in store.collisions()] == ["late"]


def test_a_long_lived_reader_sees_commits_written_after_its_listing(
    s3_proxy: FaultProxy, host: Any
) -> None:
    """s3fs keeps a folder's listing once made: a process that listed the commit records
    (a many-node parent at its start) and later reads them again must see what other processes
    committed since (seen: a parent's Retry found committed chunks missing)."""
    from hsx.extraction.chunk_extraction import RunContext, extract_chunk
    from tests.unit.test_plan_store import StatesEngine, make_plan, meta

    url = f"s3://{BUCKET}/listing-{os.getpid()}-{time.monotonic_ns()}"
    plan = make_plan([30, 30, 30], work=32)
    reader = ExtractionStore.open_or_create(url, plan, meta())
    extract_chunk(host, reader, plan.chunks[0], StatesEngine(), 100, RunContext("first"))
    assert sorted(reader.committed_chunks()) == [0]  # the listing is now cached
    assert reader.read_commit(1) is None
    # Another process: its own s3fs instance, its own cache.
    writer_fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_config(s3_proxy.url))
    writer = ExtractionStore.open(url, mode="r+")
    writer.fs = writer_fs
    extract_chunk(host, writer, plan.chunks[1], StatesEngine(), 100, RunContext("other"))
    extract_chunk(host, writer, plan.chunks[2], StatesEngine(), 100, RunContext("other"))
    assert sorted(reader.committed_chunks()) == [0, 1, 2]
    assert reader.read_commit(2) is not None and reader.read_commit(2).run_id == "other"  # type: ignore[union-attr]
