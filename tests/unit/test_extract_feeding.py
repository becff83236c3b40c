"""Chunks in flight hand the engine over at their last queued batch, and give it back on failure.

The engine here is a stand-in that completes queued prompts on its own thread: what is under
test is how chunks queue work (hsx.extract), not the engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx import extract
from hsx.extract import CHUNKS_IN_FLIGHT, FEEDING_CHUNKS, RunContext, extract_chunk
from hsx.store import ExtractionStore
from tests.unit.test_plan_store import H, K, make_plan, meta, sample_tokens

pytestmark = pytest.mark.timeout(120)


class QueueingEngine:
    """Completes queued prompts in order on a thread of its own, a few ms per batch, and
    records which sample each queued prompt belongs to."""

    def __init__(self, fail_on_first_token: int | None = None) -> None:
        self.queued: list[int] = []  # first token id of each prompt, in queue order
        self._lock = threading.Lock()
        self._work: list[tuple[np.ndarray, Future[torch.Tensor]]] = []
        self._fail_on = fail_on_first_token
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(self, prompts: list[np.ndarray]) -> list[Future[torch.Tensor]]:
        futures: list[Future[torch.Tensor]] = []
        with self._lock:
            for prompt in prompts:
                first = int(prompt[0])
                if first == self._fail_on:
                    raise RuntimeError(f"engine refused the prompt starting with {first}")
                self.queued.append(first)
                future: Future[torch.Tensor] = Future()
                self._work.append((prompt, future))
                futures.append(future)
        return futures

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        return [future.result() for future in self.submit(prompts)]

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                work, self._work = self._work, []
            for prompt, future in work:
                rows = torch.as_tensor(prompt, dtype=torch.float32)[:, None, None]
                future.set_result(rows.expand(len(prompt), K, H).clone())
            time.sleep(0.003)

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def _slots_free() -> int:
    taken = 0
    while extract._FEED_SLOTS.acquire(blocking=False):
        taken += 1
    for _ in range(taken):
        extract._FEED_SLOTS.release()
    return taken


def test_at_most_feeding_chunks_queue_at_once_and_the_next_starts_at_a_last_batch(
    tmp_path: Path,
) -> None:
    # 6 chunks of 12 samples, 2 samples a batch: 6 batches a chunk, more than it keeps queued.
    lengths = [8] * 6 * 12
    plan = make_plan(lengths, c=16, work=96)
    store = ExtractionStore.open_or_create(str(tmp_path / "s"), plan, meta())
    engine = QueueingEngine()
    try:
        with ThreadPoolExecutor(max_workers=CHUNKS_IN_FLIGHT) as pool:
            records = list(
                pool.map(
                    lambda chunk: extract_chunk(store, chunk, engine, 16, RunContext("r")),
                    plan.chunks,
                )
            )
    finally:
        engine.close()
    assert len(records) == len(plan.chunks) == 6
    chunk_of = {
        int(sample_tokens(sample, 1)[0][0]): chunk.index
        for chunk in plan.chunks
        for sample in range(chunk.sample_start, chunk.sample_end)
    }
    order = [chunk_of[sample] for sample in engine.queued]
    spans = {c: (order.index(c), len(order) - 1 - order[::-1].index(c)) for c in set(order)}
    for position in range(len(order)):
        feeding = [c for c, (first, last) in spans.items() if first <= position <= last]
        assert len(feeding) <= FEEDING_CHUNKS, (position, feeding, order)
    assert _slots_free() == FEEDING_CHUNKS


def test_a_failing_chunk_gives_its_slot_back(tmp_path: Path) -> None:
    plan = make_plan([8] * 12, c=16, work=48)
    store = ExtractionStore.open_or_create(str(tmp_path / "s"), plan, meta())
    engine = QueueingEngine(fail_on_first_token=int(sample_tokens(2, 1)[0][0]))
    try:
        with pytest.raises(RuntimeError, match="engine refused the prompt starting with 200"):
            extract_chunk(store, plan.chunks[0], engine, 16, RunContext("r"))
        assert _slots_free() == FEEDING_CHUNKS
        extract_chunk(store, plan.chunks[1], engine, 16, RunContext("r"))  # not blocked
    finally:
        engine.close()
    assert sorted(store.committed_chunks()) == [1]
