"""A run is built once and passed down: its chunk tasks never read config.json again (counted
with a Python audit hook on every file open), two runs in one process keep their own host
pipelines, and the engine home is chosen once from the settings (in-process here; servers in
tests/integration/test_serve.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from hsx.engine.homes import LocalEngineHome, engine_queue_limit
from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import ExtractionRun
from hsx.extraction.steps import plan_and_create_store
from hsx.store.zarr_store import ExtractionStore
from tasks.extract import extract_chunk_task
from tests.conftest import make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


class OpenCounter:
    """Counts opens of one file while armed (audit hooks cannot be removed: it disarms)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path.resolve())
        self.armed = False
        self.opens: list[str] = []
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed or event != "open" or not args:
            return
        name = args[0]
        if (
            isinstance(name, (str, bytes, Path))
            and str(Path(str(name, "utf-8") if isinstance(name, bytes) else name).resolve())
            == self.path
        ):
            with self._lock:
                self.opens.append(threading.current_thread().name)


@flow(name="hsx-test-chunk-tasks")
def chunk_tasks_flow(run: ExtractionRun, indices: list[int]) -> list[dict[str, Any]]:
    """The flow's own chunk task, submitted as hsx-extract submits it."""
    futures = [extract_chunk_task.submit(run, index) for index in indices]
    return [future.result() for future in futures]


def test_chunk_tasks_never_read_config_json(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path, prefect_harness: None
) -> None:
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "store.zarr"),
        data={"max_samples": 40},
        layout={"min_work_chunk_tokens": 256},
    )
    summary = plan_and_create_store(settings)
    assert len(summary.pending) >= 3, f"expected several work chunks, found {summary.pending}"
    counter = OpenCounter(tiny_llama / "config.json")
    with ExtractionRun.open(settings) as run:
        assert isinstance(run.engines, LocalEngineHome)
        first = run.extract(summary.pending[0], RunContext("warm"))  # builds the engine
        assert first is not None
        counter.armed = True
        try:
            results = chunk_tasks_flow(run, summary.pending[1:])
        finally:
            counter.armed = False
    assert counter.opens == [], (
        f"expected chunk tasks to use the run's spec, found config.json opened by {counter.opens}"
    )
    assert [r["chunk_index"] for r in results] == summary.pending[1:]
    assert all(not r["skipped"] and r["tokens"] > 0 for r in results), results
    store = ExtractionStore.open(settings.store)
    assert sorted(store.committed_chunks()) == summary.pending


def test_two_runs_in_one_process_keep_their_own_limits(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """A long-lived worker runs one flow after another: each run's host pipeline is its own,
    built from its settings (no process global rewritten by the other run's chunks)."""
    small = make_settings(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "a.zarr"),
        pipeline={"write_budget_mib": 64, "prefetch_batches": 1, "io_threads": 2},
    )
    large = make_settings(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "b.zarr"),
        engine={"batch_tokens": 1024},
        pipeline={"write_budget_mib": 256, "prefetch_batches": 4, "io_threads": 5},
    )
    with ExtractionRun.open(small) as first, ExtractionRun.open(large) as second:
        assert (first.host.write_budget.limit, second.host.write_budget.limit) == (
            64 << 20,
            256 << 20,
        )
        assert (first.host.prefetch_batches, second.host.prefetch_batches) == (1, 4)
        assert (first.host.io_pool._max_workers, second.host.io_pool._max_workers) == (2, 5)
        # Queue limits follow each run's batch size, engine step and prefetch depth.
        for run, settings in ((first, small), (second, large)):
            engine = settings.engine
            assert run.host.engine_queue.limit == engine_queue_limit(
                engine.batch_tokens,
                engine.max_num_batched_tokens,
                settings.pipeline.prefetch_batches,
            )
        assert first.spec.layer_ids == second.spec.layer_ids
