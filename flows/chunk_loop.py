"""The extraction flow's chunk tasks: as many in flight as fill the engine's queue, each failure
kept with its error, a stop abandoning what has not committed; and the summary of what they
did (flows/extract.py runs them and reports the end)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prefect import Task
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from flows.reporting import Progress, ThroughputPlot
from hsx.extraction.run import ExtractionRun
from hsx.interrupt import stop_requested
from tasks.common import describe

# Stop early when this many chunks in a row failed after their retries: the cause is shared
# (engine, storage), and each further attempt could cost a model load.
MAX_CONSECUTIVE_FAILURES = 3

ChunkFuture = PrefectFuture[dict[str, Any]]


@dataclass
class ChunkTally:
    """What this attempt's chunk tasks did, as the summary and the run record count it."""

    pending: list[int]
    failed: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # failed chunk -> its last error
    results: dict[int, dict[str, Any]] = field(default_factory=dict)  # committed -> its task's
    abandoned: list[int] = field(default_factory=list)  # stopped before their commit
    not_started: list[int] = field(default_factory=list)
    repaired: list[int] = field(default_factory=list)  # corrupt at verify, extracted again
    # computed here, but another attempt had committed them first (the store records each)
    collided: list[int] = field(default_factory=list)
    skipped_samples: int = 0
    extracted_tokens: int = 0
    seconds: float = 0.0  # first chunk's start to last commit

    def fail(self, index: int, future: ChunkFuture) -> None:
        self.failed.append(index)
        self.errors[index] = describe(future.result(raise_on_failure=False))

    def commit(self, index: int, result: dict[str, Any]) -> None:
        self.results[index] = result
        if result.get("collision"):
            self.collided.append(index)
        self.extracted_tokens += int(result["tokens"])
        self.skipped_samples += int(result.get("samples_skipped", 0))


class ChunkLoop:
    """The chunk tasks of one attempt, ``concurrency`` in flight, in the plan's order."""

    def __init__(
        self,
        run: ExtractionRun,
        chunk_task: Task[..., dict[str, Any]],
        pending: list[int],
        concurrency: int,
        progress: Progress,
        plot: ThroughputPlot | None = None,
    ) -> None:
        self.run = run
        self.chunk_task = chunk_task
        self.concurrency = concurrency
        self.progress = progress
        self.plot = plot  # tokens/s over time on the run's page
        self.queue = deque(pending)
        self.in_flight: deque[tuple[int, ChunkFuture]] = deque()
        self.tally = ChunkTally(list(pending))
        self._done = 0
        self._consecutive = 0
        self._started = time.perf_counter()

    def run_all(self) -> None:
        """Every pending chunk, unless a stop or MAX_CONSECUTIVE_FAILURES ends it first. A
        TerminationSignal raised while waiting leaves its chunk in ``in_flight``."""
        while self.queue or self.in_flight:
            self._fill()
            if not self.in_flight:
                break
            index, future = self.in_flight[0]
            future.wait()
            self.in_flight.popleft()
            self._done += 1
            self._finished(index, future)
        self.tally.not_started = list(self.queue)
        self.tally.seconds = time.perf_counter() - self._started
        self.progress.update(self._done, force=True)
        if self.plot is not None:
            self.plot.draw(force=True)

    def _fill(self) -> None:
        while (
            self.queue
            and len(self.in_flight) < self.concurrency
            and self._consecutive < MAX_CONSECUTIVE_FAILURES
            and not stop_requested()  # a stopped run starts nothing more
        ):
            index = self.queue.popleft()
            self.in_flight.append((index, self.chunk_task.submit(self.run, index)))

    def _finished(self, index: int, future: ChunkFuture) -> None:
        logger = get_run_logger()
        if future.state.is_failed() or future.state.is_crashed():
            if stop_requested():  # abandoned before its commit: not a failure of the chunk
                self.tally.abandoned.append(index)
                return
            self.tally.fail(index, future)
            self._consecutive += 1
            if self._consecutive >= MAX_CONSECUTIVE_FAILURES and self.queue:
                logger.error(
                    "%d chunks in a row failed; not starting the %d remaining",
                    self._consecutive,
                    len(self.queue),
                )
            return
        self._consecutive = 0
        result = future.result()
        self.tally.commit(index, result)
        self.progress.update(self._done)
        if self.plot is not None and not result.get("skipped"):
            self.plot.add(int(result["tokens"]))
        elapsed = time.perf_counter() - self._started
        total = len(self.tally.pending)
        logger.info(
            "progress: %d/%d chunks, %d tokens, %.0f tokens/s, ETA %.0f s",
            self._done,
            total,
            self.tally.extracted_tokens,
            self.tally.extracted_tokens / max(elapsed, 1e-9),
            elapsed / self._done * (total - self._done),
        )

    def abandon_in_flight(self, wait_s: float) -> None:
        """After a stop: chunks in flight reach a batch boundary (and abandon) or their commit
        within seconds; waiting for them (up to ``wait_s``) makes the record count what was
        committed."""
        deadline = time.monotonic() + wait_s
        for index, future in self.in_flight:
            future.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if not future.state.is_completed():
                self.tally.abandoned.append(index)
                continue
            self._done += 1  # committed after all (its commit was under way)
            if self.plot is not None:
                self.plot.add(int(future.result().get("tokens", 0)))
        self.in_flight.clear()
        self.tally.not_started = list(self.queue)
        self.progress.update(self._done, force=True)
        if self.plot is not None:
            self.plot.draw(force=True)

    def redo(self, indices: list[int]) -> None:
        """Chunks whose commits verify dropped as corrupt: extracted again, all at once."""
        self.tally.repaired = list(indices)
        redo = [(index, self.chunk_task.submit(self.run, index)) for index in indices]
        for index, future in redo:
            future.wait()
            if future.state.is_failed() or future.state.is_crashed():
                self.tally.fail(index, future)
            else:
                result = future.result()
                self.tally.results[index] = result
                self.tally.extracted_tokens += int(result["tokens"])


def summarize(
    settings_store: str,
    plan: dict[str, Any],
    tally: ChunkTally,
    verification: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    """The run's summary: the CLI's table, the run record, the artifact."""
    done_now = len(tally.pending) + len(tally.repaired) - len(tally.failed) - len(tally.not_started)
    return {
        "store": settings_store,
        "samples": plan["samples"],
        # Longer than data.max_length (data.on_overlength): the store lists each one.
        "samples_truncated": plan.get("samples_truncated", 0),
        "samples_left_out": plan.get("samples_left_out", 0),
        "tokens": plan["tokens"],
        "chunks": plan["chunks"],
        "chunks_extracted_now": done_now,
        "chunks_repaired": tally.repaired,
        "chunks_failed": tally.failed,
        "chunk_errors": {str(index): tally.errors[index] for index in tally.failed},
        "chunks_not_started": tally.not_started,
        "chunks_committed_by_another_attempt": tally.collided,
        "samples_skipped_now": tally.skipped_samples,
        "tokens_extracted_now": tally.extracted_tokens,
        # Tokens over the extraction phase (first chunk's start to last commit), as the progress
        # lines count them; preflight and planning are in wall_seconds.
        "extract_tokens_per_s": round(tally.extracted_tokens / tally.seconds, 1)
        if tally.extracted_tokens and tally.seconds
        else 0.0,
        "wall_seconds": round(wall, 2),
        "verification": verification["summary"],
        "verified": verification["ok"],
    }
