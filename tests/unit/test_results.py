"""Result hand-over from an engine in another process: the shared-memory ring (allocation,
reuse, release when the last view goes), spool files when it is full, errors, and a request
whose states never come (it fails, it does not hang). Writer and reader run in one process here
over the same shared file, as they do across the engine process and hsx's."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from hsx.engine.copier import read_spool_file, write_spool_file
from hsx.engine.result_ring import GRANULE, RingWriter, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.errors import EngineError

pytestmark = [pytest.mark.timeout(60)]


def _same_rows(key: str, tokens: int, rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] != tokens:
        raise EngineError(f"request {key}: expected {tokens} rows, found {rows.shape[0]}")
    return rows


@pytest.fixture
def ring_pair(tmp_path: Path) -> Iterator[tuple[ResultRendezvous, RingWriter]]:
    capacity = 8 * GRANULE
    meet = ResultRendezvous(
        _same_rows, spool_dir=str(tmp_path), ring_bytes=capacity, spool_wait_limit_s=0.5
    )
    writer = RingWriter(str(tmp_path), ring_granules(capacity))
    yield meet, writer
    writer.close()
    meet.close()


def _in_use(meet: ResultRendezvous) -> int:
    ring = meet._ring
    assert ring is not None
    return ring.in_use()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spool_file_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    rows = torch.randn(37, 3, 16).to(dtype)  # [tokens, K, H]
    path = write_spool_file(str(tmp_path), "c1-s2", rows)
    assert [p.name for p in tmp_path.iterdir()] == ["c1-s2.rows"] == [path.name]  # no temp left
    back = read_spool_file(path)
    assert back.dtype == dtype and torch.equal(back, rows)


def test_rows_before_and_after_finish() -> None:
    meet = ResultRendezvous(_same_rows)
    early: Future[torch.Tensor] = Future()
    meet.deliver("a", torch.zeros(4, 1, 2))
    meet.expect("a", 4, early)
    late: Future[torch.Tensor] = Future()
    meet.expect("b", 5, late)
    assert not late.done()
    meet.deliver("b", torch.zeros(3, 1, 2))
    assert early.result().shape == (4, 1, 2)
    with pytest.raises(EngineError, match="expected 5 rows, found 3"):
        late.result()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_rows_arrive_in_place_and_return_when_released(
    ring_pair: tuple[ResultRendezvous, RingWriter], dtype: torch.dtype
) -> None:
    meet, writer = ring_pair
    expected = torch.randn(300, 2, 64).to(dtype)  # [tokens, K, H]: 75 KiB in fp32, 2 granules
    place = writer.allocate(tuple(expected.shape), dtype)
    assert place is not None and writer.owns(place)
    place.copy_(expected)
    future: Future[torch.Tensor] = Future()
    meet.expect("r1", 300, future)
    writer.announce_rows("r1", place)
    rows = future.result(timeout=10)
    assert rows.dtype == dtype and torch.equal(rows, expected)
    granules = -(-expected.numel() * expected.element_size() // GRANULE)
    assert _in_use(meet) == granules
    # A view alone keeps the granules: the writer must not reuse memory that is still read.
    tail = rows[250:]
    del rows, future, place
    gc.collect()
    assert _in_use(meet) == granules
    assert torch.equal(tail, expected[250:])
    del tail
    gc.collect()
    assert _in_use(meet) == 0


def test_ring_full_falls_back_to_files_and_reuses_freed_granules(
    ring_pair: tuple[ResultRendezvous, RingWriter], tmp_path: Path
) -> None:
    meet, writer = ring_pair
    shape = (GRANULE * 3 // 4 // 4, 1, 1)  # three quarters of a granule of fp32: one granule
    places = [writer.allocate(shape, torch.float32) for _ in range(8)]
    assert all(p is not None for p in places)
    assert writer.allocate(shape, torch.float32) is None  # full: the caller writes a file
    futures: list[Future[torch.Tensor]] = []
    for i, place in enumerate(places):
        assert place is not None
        place.fill_(i)
        futures.append(Future())
        meet.expect(f"k{i}", shape[0], futures[-1])
        writer.announce_rows(f"k{i}", place)
    results = [f.result(timeout=10) for f in futures]
    assert [int(r[0, 0, 0]) for r in results] == list(range(8))
    # Released out of order: the freed granules are found again, wrapping past the end.
    del places, futures
    results[2] = results[5] = torch.empty(0)
    gc.collect()
    assert _in_use(meet) == 6
    again = writer.allocate((2 * shape[0], 1, 1), torch.float32)  # two granules: no free run
    assert again is None
    one = writer.allocate(shape, torch.float32)
    two = writer.allocate(shape, torch.float32)
    assert one is not None and two is not None and writer.allocate(shape, torch.float32) is None
    # Full: a file, announced through the same path.
    overflow: Future[torch.Tensor] = Future()
    meet.expect("file", 3, overflow)
    writer.announce_file("file", str(write_spool_file(str(tmp_path), "file", torch.ones(3, 1, 1))))
    assert torch.equal(overflow.result(timeout=10), torch.ones(3, 1, 1))
    assert not (tmp_path / "file.rows").exists()  # read, then removed


def test_errors_broken_files_and_states_that_never_come(
    ring_pair: tuple[ResultRendezvous, RingWriter], tmp_path: Path
) -> None:
    meet, writer = ring_pair
    failed: Future[torch.Tensor] = Future()
    broken: Future[torch.Tensor] = Future()
    missing: Future[torch.Tensor] = Future()
    (tmp_path / "broken.rows").write_bytes(b"not a header")
    meet.expect("failed", 2, failed)
    meet.expect("broken", 2, broken)
    meet.expect("missing", 2, missing)
    writer.announce_error("failed", RuntimeError("device copy failed: " + "x" * 5000))
    writer.announce_file("broken", str(tmp_path / "broken.rows"))
    with pytest.raises(EngineError, match="device copy failed"):
        failed.result(timeout=10)
    with pytest.raises(EngineError, match=r"broken.*could not be read"):
        broken.result(timeout=10)
    with pytest.raises(EngineError, match=r"were not announced in .* within 0.5 s"):
        missing.result(timeout=10)
    assert meet.pending() == 0
