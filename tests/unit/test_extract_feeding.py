"""How work chunks queue batches at the engine: the run's engine queue keeps the engine
fed whether a chunk holds one batch or many and never queues more than its limit. (A chunk the
real engine refuses gives its tokens back: tests/integration/test_engine_refusal.py.)

The engine here is a stand-in that computes queued prompts on its own thread, a few tokens per
"step": what is under test is how chunks queue work (hsx.extraction.host_pipeline), not the engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.engine.homes import engine_queue_limit
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import (
    CHUNKS_IN_FLIGHT,
    MAX_CHUNKS_IN_FLIGHT,
    HostPipeline,
    chunks_in_flight,
)
from hsx.store.zarr_store import ExtractionStore
from settings import PipelineSettings
from tests.unit.test_plan_store import H, K, make_plan, meta

pytestmark = pytest.mark.timeout(120)


class QueueingEngine:
    """Computes queued prompts in order on a thread of its own, ``step_tokens`` per 3 ms step,
    and records the queue order and the most tokens ever queued and not yet computed."""

    def __init__(self, step_tokens: int = 32) -> None:
        self.queued: list[int] = []  # first token id of each prompt, in queue order
        self.outstanding = 0
        self.most_outstanding = 0
        self._lock = threading.Lock()
        self._work: list[tuple[np.ndarray, Future[torch.Tensor]]] = []
        self._step_tokens = step_tokens
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(
        self, prompts: list[np.ndarray], state_encoding: str = ""
    ) -> list[Future[torch.Tensor]]:
        futures: list[Future[torch.Tensor]] = []
        with self._lock:
            for prompt in prompts:
                self.queued.append(int(prompt[0]))
                future: Future[torch.Tensor] = Future()
                self._work.append((prompt, future))
                futures.append(future)
                self.outstanding += len(prompt)
            self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return futures

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        return [future.result() for future in self.submit(prompts)]

    def _run(self) -> None:
        while not self._stop:
            done, budget = [], self._step_tokens
            with self._lock:
                while self._work and budget > 0:
                    done.append(self._work.pop(0))
                    budget -= len(done[-1][0])
                    self.outstanding -= len(done[-1][0])
            for prompt, future in done:
                # +1: a token id 0 would give an all-zero state vector, which extraction refuses
                rows = torch.as_tensor(prompt, dtype=torch.float32)[:, None, None] + 1.0
                future.set_result(rows.expand(len(prompt), K, H).clone())
            time.sleep(0.003)

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def test_small_chunks_fill_the_engine_queue_up_to_its_limit(tmp_path: Path) -> None:
    """Chunks of one batch each (as a short dataset cut into many chunks gives): as many chunks
    as it takes queue at once, so the engine has several steps of work; never more than the
    limit; every token leaves the queue once computed."""
    lengths = [8] * 2 * 24  # 24 chunks of 2 samples = 16 tokens, one batch each
    plan = make_plan(lengths, c=16, work=16)
    store = ExtractionStore.open_or_create(str(tmp_path / "s"), plan, meta())
    limit = 96  # 3 engine steps of 32 tokens, 6 chunks' worth
    concurrency = chunks_in_flight(PipelineSettings(), limit, plan.total_tokens / len(plan.chunks))
    assert concurrency == 7  # 6 chunks fill the queue, one more writes and commits
    engine = QueueingEngine(step_tokens=32)
    host = HostPipeline(PipelineSettings(), queue_limit=limit)
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            records = list(
                pool.map(
                    lambda chunk: extract_chunk(host, store, chunk, engine, 16, RunContext("r")),
                    plan.chunks,
                )
            )
    finally:
        engine.close()
        host.close()
    assert len(records) == len(plan.chunks) == 24
    assert sorted(store.committed_chunks()) == list(range(24))
    # More than two chunks' batches waited at once (two was the old fixed number of feeders)...
    assert engine.most_outstanding > 2 * 16, engine.most_outstanding
    # ...and never more than the limit.
    assert engine.most_outstanding <= limit, engine.most_outstanding
    assert host.engine_queue.queued == 0


def test_a_batch_larger_than_the_limit_waits_for_an_empty_queue(tmp_path: Path) -> None:
    plan = make_plan([8] * 12, c=16, work=48)
    store = ExtractionStore.open_or_create(str(tmp_path / "s"), plan, meta())
    engine = QueueingEngine(step_tokens=8)
    host = HostPipeline(PipelineSettings(), queue_limit=16)
    try:
        for chunk in plan.chunks:
            extract_chunk(host, store, chunk, engine, 48, RunContext("r"))
    finally:
        engine.close()
        host.close()
    assert engine.most_outstanding == 48  # one whole batch, alone
    assert sorted(store.committed_chunks()) == [0, 1]
    assert host.engine_queue.queued == 0


def test_chunks_in_flight_from_the_plan_and_the_setting() -> None:
    auto = PipelineSettings()
    # The H200 benchmark: 347,418 tokens in 103 chunks, batches of 65536, steps of 16384.
    limit = engine_queue_limit(65536, 16384)
    assert limit == 2 * 3 * 65536
    assert chunks_in_flight(auto, limit, 347_418 / 103) == MAX_CHUNKS_IN_FLIGHT
    # Chunks of millions of tokens: a few in flight, as before.
    assert chunks_in_flight(auto, limit, 4e6) == CHUNKS_IN_FLIGHT
    assert chunks_in_flight(auto, limit, 20_000) == 21  # 20 fill 393,216 tokens
    assert chunks_in_flight(PipelineSettings(chunks_in_flight=5), limit, 100.0) == 5
    # Default batches (4096) on an engine of 16k-token steps: four steps queued at least.
    assert engine_queue_limit(4096, 16384) == 4 * 16384
