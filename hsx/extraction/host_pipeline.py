"""The host side of one run's extraction: the engine's queue, the write budget, the staging
buffers and the thread pools that every chunk of the run shares.

Built once from ``PipelineSettings`` where the run starts (the flow, the CLI's probe, a bench, a
test) and passed down to every chunk; closed with the run. Nothing here is process-global: two
runs in one process (a long-lived worker) each have their own limits, and a setting changed
between runs takes effect for the next run, never half-way through one.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import numpy as np
import torch

from hsx.engine.interface import HiddenStateEngine
from hsx.store.local_io import aligned_empty
from settings import PipelineSettings

# Chunk tasks a run extracts at once without a plan to size them by (tests, benchmarks of a
# fixed shape); a run sizes it from its plan with chunks_in_flight().
CHUNKS_IN_FLIGHT = 3
MAX_CHUNKS_IN_FLIGHT = 32  # also settings' bound on pipeline.chunks_in_flight
_CPUS = os.cpu_count() or 2
# Storage objects are written by a few threads at once: per-object costs (open, rename, an
# object store's request latency) overlap, and writes release the GIL.
# Measured on 2 cores: 4 I/O threads and 96 MiB in flight. On the H200 machine (16 cores, a disk
# taking 2.3 GB/s with 4 O_DIRECT writers) 4 threads under 96 MiB were idle half the time and the
# store wrote 1.1 GB/s: more cores get more writers and a budget of 4 objects per writer.
DEFAULT_IO_THREADS = max(4, min(16, _CPUS // 2))
_STAGING_OBJECT_BYTES = 16 << 20  # a typical staging buffer: the budget's unit of reuse


class EngineQueue:
    """Prompt tokens queued at the engine and not computed yet, for the whole run.

    Chunks queue a batch while the total stays under a limit, in the order they asked (first
    come, first queued, so chunks finish in about the order they started). The engine then has
    its next steps' work whether a work chunk holds one batch or a hundred. Measured on the
    H200 before: two "feeding" chunks of one 3.4k-token batch each queued less than one engine
    step of 16k tokens, and the engine sat idle 20-40% of the time while chunks wrote and
    committed. Tokens queued cost no host memory (states exist once computed); what results
    hold is bounded per chunk (prefetch_batches) and by the write budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0
        self._waiting: deque[object] = deque()
        self._changed = threading.Condition()

    def acquire(self, tokens: int) -> None:
        """Wait for this caller's turn and room for ``tokens`` (a batch larger than the limit
        waits for an empty queue)."""
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            try:
                while self._waiting[0] is not ticket or (
                    self.queued and self.queued + tokens > self.limit
                ):
                    self._changed.wait()
                self.queued += tokens
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()

    def release(self, tokens: int) -> None:
        with self._changed:
            self.queued -= tokens
            self._changed.notify_all()


class WriteBudget:
    """Bytes of storage objects submitted but not yet written, for the whole run: bounds the
    memory of every chunk writer together (one budget per run, not per writer: a lone writer
    may keep all I/O threads busy, and three writers do not triple the memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit (an object larger than the limit waits for an empty budget)."""
        with self._changed:
            while self.used and self.used + nbytes > self.limit:
                self._changed.wait()
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.used -= nbytes
            self._changed.notify_all()


class StagingBuffers:
    """Reused staging buffers by shape and dtype: fresh pages cost a page fault each (measured
    slower than the write itself); at most ``keep`` free ones per shape, so memory stays flat."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        with self._lock:
            free = self._free.get((shape, dtype.str))
            if free:
                return free.pop()
        buffer = aligned_empty(shape, dtype)  # aligned: objects can be written with O_DIRECT
        buffer.fill(0)  # touch every page now, not in the engine's time
        return buffer

    def give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault((buffer.shape, buffer.dtype.str), [])
            if len(free) < self.keep:
                free.append(buffer)


def io_threads(pipeline: PipelineSettings) -> int:
    return pipeline.io_threads or DEFAULT_IO_THREADS


def min_write_budget_bytes(threads: int) -> int:
    """16 MiB objects: 6 in flight for 4 I/O threads, so that each finds the next object queued
    when it finishes one (measured: with exactly 4, threads idled ~6% of the time while the
    writer filled the next; an idle I/O thread costs store write speed)."""
    return max(96, 32 * threads) << 20


def write_budget_bytes(pipeline: PipelineSettings) -> int:
    """The run's write budget for these settings (None = scaled by the machine's memory)."""
    if pipeline.write_budget_mib is not None:
        return pipeline.write_budget_mib << 20
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(min_write_budget_bytes(io_threads(pipeline)), min(4 << 30, memory // 32))


def chunks_in_flight(pipeline: PipelineSettings, queue_limit: int, chunk_tokens: float) -> int:
    """Chunk tasks to run at once: enough chunks that their batches fill the engine's queue,
    plus one writing and committing, within 3..MAX_CHUNKS_IN_FLIGHT (each holds a staging
    buffer per array); ``pipeline.chunks_in_flight`` when set."""
    if pipeline.chunks_in_flight is not None:
        return pipeline.chunks_in_flight
    wanted = math.ceil(queue_limit / max(chunk_tokens, 1.0)) + 1
    return max(CHUNKS_IN_FLIGHT, min(MAX_CHUNKS_IN_FLIGHT, wanted))


@dataclass(frozen=True)
class _GiveBackTokens:
    """Gives a prompt's tokens back to the engine queue once its rows are computed."""

    queue: EngineQueue
    tokens: int

    def __call__(self, _: Future[torch.Tensor]) -> None:
        self.queue.release(self.tokens)


class HostPipeline:
    """One run's host-side resources, shared by its chunks (see the module's docstring).

    ``queue_limit``: prompt tokens kept queued at the engine(s) (engine_queue_limit, times the
    servers of ``engine.url``)."""

    def __init__(self, settings: PipelineSettings, queue_limit: int) -> None:
        self.settings = settings
        self.prefetch_batches = settings.prefetch_batches
        self.io_threads = io_threads(settings)
        self.engine_queue = EngineQueue(queue_limit)
        self.write_budget = WriteBudget(write_budget_bytes(settings))
        # Staging buffers that fill the budget are reused rather than faulted in afresh.
        self.staging = StagingBuffers(keep=max(8, self.write_budget.limit // _STAGING_OBJECT_BYTES))
        self.io_pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="hsx-io")
        # Threads that copy engine results into staging buffers (one batch per chunk at a time).
        # One pool for the run, not one per chunk: every new thread gets glibc heap state of its
        # own, and RSS measured growing with the number of chunks when each chunk made one.
        self.append_pool = ThreadPoolExecutor(max(4, _CPUS // 4), thread_name_prefix="hsx-writer")

    def submit(
        self, engine: HiddenStateEngine, prompts: list[np.ndarray], state_encoding: str = ""
    ) -> list[Future[torch.Tensor]]:
        """Queue a batch without waiting for its results, where the engine can (else compute it
        now), once the engine's queue has room; each prompt's tokens leave the queue when its
        rows are computed."""
        tokens = [int(prompt.shape[0]) for prompt in prompts]
        self.engine_queue.acquire(sum(tokens))
        futures: list[Future[torch.Tensor]] = []
        try:
            # Engines without ``submit`` (tests' fakes, the HF reference) compute at once.
            submit = getattr(engine, "submit", None)
            if submit is not None:
                futures = cast(list[Future[torch.Tensor]], submit(prompts, state_encoding))
            else:
                for rows in engine.extract(prompts):
                    done: Future[torch.Tensor] = Future()
                    done.set_result(rows)
                    futures.append(done)
        except BaseException:
            self.engine_queue.release(sum(tokens))
            raise
        for future, count in zip(futures, tokens, strict=True):
            future.add_done_callback(_GiveBackTokens(self.engine_queue, count))
        return futures

    def close(self) -> None:
        """End the pools once what was submitted is done (a chunk still running finishes)."""
        self.io_pool.shutdown(wait=False)
        self.append_pool.shutdown(wait=False)

    def __enter__(self) -> HostPipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
