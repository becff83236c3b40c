"""The process-wide budget of bytes submitted for writing but not yet written."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hsx.extraction.host_pipeline import HostPipeline, WriteBudget

pytestmark = pytest.mark.timeout(30)


def wait_until_blocked(budget: WriteBudget, thread: threading.Thread, timeout: float = 20) -> None:
    """Poll (generously) until ``thread`` waits on the budget's condition: proof that it is
    blocked in acquire, not merely slow to start, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    while len(budget._changed._waiters) < 1:  # type: ignore[attr-defined]
        assert thread.is_alive(), "the writer finished instead of waiting"
        assert time.monotonic() < deadline, "the writer never reached the budget's wait"
        time.sleep(0.001)


def test_a_writer_waits_until_its_object_fits_then_proceeds() -> None:
    budget = WriteBudget(100)
    budget.acquire(60)
    entered = threading.Event()

    def second_writer() -> None:
        budget.acquire(50)  # 110 > 100: must wait for the first object to be written
        entered.set()

    thread = threading.Thread(target=second_writer)
    thread.start()
    wait_until_blocked(budget, thread)
    assert not entered.is_set()
    assert budget.used == 60
    budget.release(60)
    assert entered.wait(5)
    thread.join(5)
    assert budget.used == 50


def test_an_object_larger_than_the_budget_is_written_alone() -> None:
    budget = WriteBudget(100)
    budget.acquire(250)  # an empty budget admits it: no writer can deadlock on its own size
    assert budget.used == 250
    blocked = threading.Event()
    done = threading.Event()

    def small_writer() -> None:
        blocked.set()
        budget.acquire(1)
        done.set()

    thread = threading.Thread(target=small_writer)
    thread.start()
    assert blocked.wait(20)
    wait_until_blocked(budget, thread)
    assert not done.is_set()
    assert budget.used == 250
    budget.release(250)
    assert done.wait(5)
    thread.join(5)
    assert budget.used == 1


def test_a_failed_write_raises_and_gives_its_bytes_back(host: HostPipeline, tmp_path: Path) -> None:
    """A real write failure: the array's folder replaced by a file. The writer raises the
    OSError, nothing is committed, and the run's budget is whole again (no leak that would
    stall every later chunk)."""
    import shutil

    from hsx.extraction.chunk_extraction import ChunkWriter, chunk_samples
    from hsx.store.zarr_store import ExtractionStore
    from tests.unit.test_plan_store import StatesEngine, make_plan, meta

    url = str(tmp_path / "store")
    plan = make_plan([40, 7], c=16, work=48)
    ExtractionStore.open_or_create(url, plan, meta())
    store = ExtractionStore.open(url, mode="r+")
    samples, _ = chunk_samples(store, plan.chunks[0])
    hidden = tmp_path / "store" / "hidden_states"
    metadata = (hidden / "zarr.json").read_bytes()
    shutil.rmtree(hidden)
    hidden.write_bytes(metadata)  # a file where the array's folder was: every write fails
    writer = ChunkWriter(host, store, plan.chunks[0])
    with pytest.raises(OSError):
        writer.append(samples, StatesEngine().extract([s.input_ids for s in samples]))
        writer.finish()
    assert host.write_budget.used == 0
    assert store.committed_chunks() == {}
