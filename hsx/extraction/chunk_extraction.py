"""Extracting one work chunk: tokenize its samples, run the engine batch by batch, write whole
Zarr chunks with streaming checksums, then commit.

Writing overlaps the engine: batch i is copied, hashed and handed to the I/O threads while the
engine computes the next batches. Per chunk at most one batch waits to be appended; per process
at most ``_WRITE_BUDGET`` bytes of objects wait to be written. Memory is bounded by those, the
queued batches and one staging Zarr chunk per writer, whatever the size of the dataset or the
work chunk.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, cast

import numpy as np
import torch

from hsx import timings
from hsx.data.tokenization import TokenizedSample
from hsx.engine.capture_checks import BadStatesPolicy, CapturedDataError, SampleScan
from hsx.errors import StoreError
from hsx.interrupt import raise_if_stopped
from hsx.plan.chunks import WorkChunk
from hsx.store.checksums import ALGORITHM, digest, new_hasher, update_digest
from hsx.store.local_io import DIRECT_ALIGNMENT, aligned_empty
from hsx.store.zarr_store import CommitRecord, ExtractionStore
from settings import PipelineSettings

logger = logging.getLogger(__name__)


class HiddenStateEngine(Protocol):
    """What extraction needs of an engine (vLLM, or the HF reference in tests)."""

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]: ...


# Batches a chunk keeps queued at the engine beyond the one it waits for: the engine never runs
# dry while results are copied, written and committed (measured: idle 26% of the time without).
PREFETCH_BATCHES = 2
# Chunk tasks a process runs at once, without a plan to size them by (tests, benchmarks of a
# fixed shape); extraction sizes it from the plan with chunks_in_flight().
CHUNKS_IN_FLIGHT = 3
MAX_CHUNKS_IN_FLIGHT = 32


class EngineQueue:
    """Prompt tokens queued at the engine and not computed yet, for the whole process.

    Chunks queue a batch while the total stays under a limit, in the order they asked (first
    come, first queued, so chunks finish in about the order they started). The engine then has
    its next steps' work whether a work chunk holds one batch or a hundred. Measured on the
    H200 before: two "feeding" chunks of one 3.4k-token batch each queued less than one engine
    step of 16k tokens, and the engine sat idle 20-40% of the time while chunks wrote and
    committed. Tokens queued cost no host memory (states exist once computed); what results
    hold is bounded per chunk (PREFETCH_BATCHES) and by the write budget."""

    def __init__(self) -> None:
        self.queued = 0
        self._waiting: deque[object] = deque()
        self._changed = threading.Condition()

    def acquire(self, tokens: int, limit: int) -> None:
        """Wait for this caller's turn and room for ``tokens`` (a batch larger than the limit
        waits for an empty queue)."""
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            try:
                while self._waiting[0] is not ticket or (
                    self.queued and self.queued + tokens > limit
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


_ENGINE_QUEUE = EngineQueue()


def engine_queue_limit(batch_tokens: int, max_num_batched_tokens: int | None) -> int:
    """Tokens the process keeps queued at the engine: what two chunks with PREFETCH_BATCHES each
    queued before, and at least four engine steps."""
    return max(2 * (PREFETCH_BATCHES + 1) * batch_tokens, 4 * (max_num_batched_tokens or 16384))


def chunks_in_flight(pipeline: PipelineSettings, queue_limit: int, chunk_tokens: float) -> int:
    """Chunk tasks to run at once: enough chunks that their batches fill the engine's queue,
    plus one writing and committing, within 3..MAX_CHUNKS_IN_FLIGHT (each holds a staging
    buffer per array); ``pipeline.chunks_in_flight`` when set."""
    if pipeline.chunks_in_flight is not None:
        return pipeline.chunks_in_flight
    wanted = math.ceil(queue_limit / max(chunk_tokens, 1.0)) + 1
    return max(CHUNKS_IN_FLIGHT, min(MAX_CHUNKS_IN_FLIGHT, wanted))


def _submit(
    engine: HiddenStateEngine, prompts: list[np.ndarray], queue_limit: int
) -> list[Future[torch.Tensor]]:
    """Queue a batch without waiting for its results, where the engine can (else compute it
    now), once the engine's queue has room; each prompt's tokens leave the queue when its rows
    are computed."""
    tokens = [int(prompt.shape[0]) for prompt in prompts]
    _ENGINE_QUEUE.acquire(sum(tokens), queue_limit)
    futures: list[Future[torch.Tensor]] = []
    try:
        submit = getattr(engine, "submit", None)
        if submit is not None:
            futures = cast(list[Future[torch.Tensor]], submit(prompts))
        else:
            for rows in engine.extract(prompts):
                done: Future[torch.Tensor] = Future()
                done.set_result(rows)
                futures.append(done)
    except BaseException:
        _ENGINE_QUEUE.release(sum(tokens))
        raise
    for future, count in zip(futures, tokens, strict=True):
        future.add_done_callback(_Release(count))
    return futures


@dataclass(frozen=True)
class _Release:
    """Gives a prompt's tokens back to the engine queue once its rows are computed."""

    tokens: int

    def __call__(self, _: Future[torch.Tensor]) -> None:
        _ENGINE_QUEUE.release(self.tokens)


@dataclass(frozen=True)
class RunContext:
    """Who is writing: goes into every commit record."""

    run_id: str
    attempt: int = 1
    code_version: str = "unknown"
    extra: dict[str, Any] | None = None


def to_stored(states: torch.Tensor, logical_dtype: str) -> np.ndarray:
    """[tokens, K, H] torch -> numpy in the store's physical dtype (bf16 as uint16 bits)."""
    if logical_dtype == "bfloat16":
        return states.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return states.to(getattr(torch, logical_dtype)).contiguous().numpy()


# The arrays a work chunk writes; input_ids and loss_mask were written with the store's layout
# (from the plan) and are only read and checksummed by the chunk.
WRITTEN_ARRAYS = ("hidden_states",)
READ_ARRAYS = ("input_ids", "loss_mask")


_STAGING_POOL: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
_STAGING_LOCK = threading.Lock()


def _staging_buffer(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """A reused buffer: fresh pages cost a page fault each (measured slower than the write)."""
    with _STAGING_LOCK:
        free = _STAGING_POOL.get((shape, dtype.str))
        if free:
            return free.pop()
    buffer = aligned_empty(shape, dtype)  # aligned: objects can be written with O_DIRECT
    buffer.fill(0)  # touch every page now, not in the engine's time
    return buffer


def _release_staging(buffer: np.ndarray) -> None:
    with _STAGING_LOCK:
        free = _STAGING_POOL.setdefault((buffer.shape, buffer.dtype.str), [])
        if len(free) < _POOL_KEEP:  # beyond that, let it go: memory stays flat
            free.append(buffer)


# Storage objects are written by a few threads at once: per-object costs (open, rename, an
# object store's request latency) overlap, and writes release the GIL.
# Measured on 2 cores: 4 I/O threads and 96 MiB in flight. On the H200 machine (16 cores, a disk
# taking 2.3 GB/s with 4 O_DIRECT writers) 4 threads under 96 MiB were idle half the time and the
# store wrote 1.1 GB/s: more cores get more writers and a budget of 4 objects per writer.
_CPUS = os.cpu_count() or 2
_IO_THREADS = max(4, min(16, _CPUS // 2))


class WriteBudget:
    """Bytes of storage objects submitted but not yet written, for the whole process: bounds
    the memory of every chunk writer together (one budget per process, not per writer: a lone
    writer may keep all I/O threads busy, and three writers do not triple the memory)."""

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


# 16 MiB objects: 6 in flight, so that each of the 4 I/O threads finds the next object queued
# when it finishes one (measured: with exactly 4, threads idled ~6% of the time while the
# writer filled the next; an idle I/O thread costs store write speed).
_MIN_WRITE_BUDGET = max(96, 32 * _IO_THREADS) << 20
_WRITE_BUDGET = WriteBudget(_MIN_WRITE_BUDGET)
_POOL_KEEP = 8  # free staging buffers kept per shape (raised with the budget)


def io_threads(pipeline: PipelineSettings) -> int:
    return pipeline.io_threads or _IO_THREADS


def write_budget_bytes(pipeline: PipelineSettings) -> int:
    """The process's write budget for these settings (None = scaled by the machine's memory)."""
    if pipeline.write_budget_mib is not None:
        return pipeline.write_budget_mib << 20
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    floor = max(96, 32 * io_threads(pipeline)) << 20
    return max(floor, min(4 << 30, memory // 32))


def configure_host_pipeline(pipeline: PipelineSettings) -> None:
    """Apply the settings to the process-wide write budget and prefetch depth (chunks of one
    run share them); called at the start of every chunk."""
    global _POOL_KEEP, PREFETCH_BATCHES, _IO_POOL
    threads = io_threads(pipeline)
    if threads != _IO_POOL._max_workers:
        # A new pool; the old one finishes what was submitted to it and ends.
        old, _IO_POOL = _IO_POOL, ThreadPoolExecutor(threads, thread_name_prefix="hsx-io")
        old.shutdown(wait=False)
    with _WRITE_BUDGET._changed:
        _WRITE_BUDGET.limit = write_budget_bytes(pipeline)
        _WRITE_BUDGET._changed.notify_all()
    # Staging buffers that fill the budget are reused rather than faulted in afresh.
    _POOL_KEEP = max(8, _WRITE_BUDGET.limit // (16 << 20))
    PREFETCH_BATCHES = pipeline.prefetch_batches


# Rows are copied and hashed in blocks of about this size: a block stays in the L2 cache (2 MiB
# per core here, 1 MiB or more on current server CPUs) between the copy and the hash.
_HASH_BLOCK_BYTES = 512 << 10
_IO_POOL = ThreadPoolExecutor(max_workers=_IO_THREADS, thread_name_prefix="hsx-io")
# Long-lived threads that copy engine results into staging buffers (one batch per chunk at a
# time). Not a pool per chunk: every new thread gets glibc heap state of its own, and RSS
# measured growing with the number of chunks when each chunk made one.
_APPEND_POOL = ThreadPoolExecutor(max_workers=max(4, _CPUS // 4), thread_name_prefix="hsx-writer")


class ChunkWriter:
    """Writes one work chunk's rows in whole Zarr chunks and hashes exactly the stored bytes.

    Rows are copied into reused staging buffers of C rows per array (a fresh allocation per
    flush costs page faults that measured slower than the write itself on these machines). Each
    block of rows is hashed right after it is copied, while it is still in the CPU cache: a
    separate pass over a full buffer read all of it from memory again, and that extra memory
    traffic measured 6% of store write speed. Full buffers are written by the I/O pool while the
    next fills."""

    def __init__(
        self, store: ExtractionStore, chunk: WorkChunk, bad_states: BadStatesPolicy = "fail"
    ) -> None:
        self.store = store
        self.chunk = chunk
        self.bad_states = bad_states
        self.layer_ids = tuple(int(i) for i in store.meta.get("layer_ids", ()))
        self._next_sample = chunk.sample_start
        # Samples whose states failed a check (bad_states="skip"): recorded in the commit.
        self.skipped: list[dict[str, Any]] = []
        self.rows = store.rows_per_chunk
        self.logical_dtype = store.logical_dtype
        # Digests, one per Zarr chunk, in row order.
        self._digests: dict[str, list[str]] = {name: [] for name in WRITTEN_ARRAYS}
        self._staging = {
            name: _staging_buffer(
                (self.rows, *store.array(name).shape[1:]), store.array(name).dtype
            )
            for name in WRITTEN_ARRAYS
        }
        self._hashers = {name: new_hasher() for name in WRITTEN_ARRAYS}
        row_bytes = max(buffer[0].nbytes for buffer in self._staging.values())
        self._block_rows = max(1, _HASH_BLOCK_BYTES // max(row_bytes, 1))
        self._filled = 0
        self._next_row = chunk.row_start
        self._written_tokens = 0
        self.chunks_in_place = 0  # Zarr chunks written straight from engine results
        self._in_flight: deque[Future[None]] = deque()

    def append(
        self,
        samples: Sequence[TokenizedSample],
        states: Sequence[torch.Tensor | CapturedDataError],
    ) -> None:
        """Write each sample's rows ``[tokens, K, H]``; a CapturedDataError in place of a
        sample's states (the engine refused them) writes zero rows for it and skips it."""
        for sample, rows in zip(samples, states, strict=True):
            index = self._next_sample
            self._next_sample += 1
            problem: str | None = None
            if isinstance(rows, CapturedDataError):
                problem = str(rows)
                part = self._zero_rows(sample.num_tokens)
            else:
                part = to_stored(rows, self.logical_dtype)  # [tokens, K, H]
                if part.shape[0] != sample.num_tokens:
                    problem = (
                        f"captured {part.shape[0]} rows, expected {sample.num_tokens} as planned"
                    )
                    part = self._zero_rows(sample.num_tokens)
            if problem is not None:
                self._bad_sample(index, problem)
            scan = (
                SampleScan(self.layer_ids, sample.num_tokens)
                if problem is None and self.bad_states != "off"
                else None
            )
            self._append_rows(part, scan)
            if scan is not None and (found := scan.problem()) is not None:
                self._bad_sample(index, found)
            self._written_tokens += sample.num_tokens

    def _zero_rows(self, tokens: int) -> np.ndarray:
        array = self.store.array("hidden_states")
        return np.zeros((tokens, *array.shape[1:]), dtype=array.dtype)

    def _bad_sample(self, index: int, problem: str) -> None:
        """Fail the chunk naming the sample, or record it as skipped (bad_states="skip")."""
        if self.bad_states == "skip":
            logger.warning("%s: sample %d skipped: %s", self.chunk.name, index, problem)
            self.skipped.append({"sample": index, "reason": problem})
            return
        raise CapturedDataError(
            f"{self.chunk.name}, sample {index}: {problem}; "
            "set capture.on_bad_states=skip to record such samples as skipped instead",
            sample=index,
        )

    def _append_rows(self, part: np.ndarray, scan: SampleScan | None) -> None:
        count, offset = part.shape[0], 0
        while offset < count:
            if self._filled == 0 and count - offset >= self.rows:
                whole = part[offset : offset + self.rows]
                if self._writable_in_place(whole):
                    if scan is not None:
                        scan.add(whole, offset)
                    self._submit_in_place({"hidden_states": whole})
                    offset += self.rows
                    continue
            take = min(count - offset, self.rows - self._filled, self._block_rows)
            block = self._staging["hidden_states"][self._filled : self._filled + take]
            block[...] = part[offset : offset + take]
            if scan is not None:
                scan.add(block, offset)  # still in cache
            update_digest(self._hashers["hidden_states"], block)
            self._filled += take
            offset += take
            if self._filled == self.rows:
                self._flush()

    def _writable_in_place(self, rows: np.ndarray) -> bool:
        """Whether a whole Zarr chunk of a sample's rows can be written straight from the
        engine's result, without a copy into staging: long samples cover most of their Zarr
        chunks whole. It must hold the stored bytes as they are (C order, the array's dtype),
        and for O_DIRECT be aligned (the connector aligns its result buffers)."""
        if not rows.flags.c_contiguous or rows.dtype.byteorder not in ("=", "<", "|"):
            return False
        return not self.store.direct_io or (
            rows.ctypes.data % DIRECT_ALIGNMENT == 0 and rows.nbytes % DIRECT_ALIGNMENT == 0
        )

    def _submit_in_place(self, whole: dict[str, np.ndarray]) -> None:
        for name, rows in whole.items():
            self._digests[name].append(digest(rows))
            self._in_flight.append(self._submit_write(name, rows, staged=False))
        self._next_row += self.rows
        self.chunks_in_place += 1
        self._bound_in_flight()

    def _flush(self) -> None:
        for name, staging in self._staging.items():
            self._digests[name].append(self._hashers[name].hexdigest())
            self._hashers[name] = new_hasher()
            self._in_flight.append(self._submit_write(name, staging, staged=True))
            self._staging[name] = _staging_buffer(staging.shape, staging.dtype)
        self._next_row += self.rows
        self._filled = 0
        self._bound_in_flight()

    def _submit_write(self, name: str, rows: np.ndarray, staged: bool) -> Future[None]:
        _WRITE_BUDGET.acquire(rows.nbytes)  # waits while the process has enough in flight
        try:
            return _IO_POOL.submit(self._write, name, self._next_row, rows, staged)
        except BaseException:
            _WRITE_BUDGET.release(rows.nbytes)
            raise

    def _bound_in_flight(self) -> None:
        """Raise a failed write now, not only at the end; forget finished ones. Before raising,
        wait for the writes still in flight: none may outlive the failed chunk, and each gives
        its bytes back to the process's write budget when it ends."""
        while self._in_flight and self._in_flight[0].done():
            if self._in_flight[0].exception() is not None:
                self._drain()  # raises the first failure once every write has ended
            self._in_flight.popleft()

    def _write(self, name: str, row_start: int, rows: np.ndarray, staged: bool) -> None:
        """Write one Zarr chunk (in an I/O thread); a staging buffer goes back to the pool."""
        try:
            with timings.timed("write", rows.nbytes):
                self.store.write_chunk(name, row_start, rows)
        finally:
            _WRITE_BUDGET.release(rows.nbytes)
            if staged:
                _release_staging(rows)

    def _drain(self) -> None:
        """Wait for every submitted write; the first failure is raised."""
        error: BaseException | None = None
        while self._in_flight:
            try:
                self._in_flight.popleft().result()
            except BaseException as exc:  # keep draining: no write may outlive the writer
                error = error or exc
        if error is not None:
            raise error

    def finish(self) -> dict[str, list[str]]:
        """Pad the last Zarr chunk with zero rows, write it; returns each array's digests, one
        per Zarr chunk of the region, in row order."""
        if self._written_tokens != self.chunk.tokens:
            raise StoreError(
                f"{self.chunk.name}: expected {self.chunk.tokens} tokens as planned, found "
                f"{self._written_tokens} (the dataset or tokenizer changed since the plan)"
            )
        try:
            if self._filled:
                for name, staging in self._staging.items():
                    staging[self._filled :] = 0
                    update_digest(self._hashers[name], staging[self._filled :])
                self._flush()
        finally:
            self._drain()
        for staging in self._staging.values():
            _release_staging(staging)
        self._staging = {}
        if self._next_row != self.chunk.row_end:
            raise StoreError(
                f"{self.chunk.name}: expected to end at row {self.chunk.row_end}, ended at {self._next_row}"
            )
        return {name: list(digests) for name, digests in self._digests.items()}


def _timed_append(
    writer: ChunkWriter,
    batch: Sequence[TokenizedSample],
    states: Sequence[torch.Tensor | CapturedDataError],
) -> None:
    nbytes = sum(int(s.nbytes) for s in states if isinstance(s, torch.Tensor))
    with timings.timed("append", nbytes):
        writer.append(batch, states)


def chunk_samples(
    store: ExtractionStore, chunk: WorkChunk
) -> tuple[list[TokenizedSample], dict[str, list[str]]]:
    """The chunk's samples, from the token rows stored at planning, and the digests of those
    rows (one per Zarr chunk) for the commit."""
    regions = {name: store.read_rows(name, chunk.row_start, chunk.row_end) for name in READ_ARRAYS}
    step = store.rows_per_chunk
    digests = {
        name: [digest(rows[offset : offset + step]) for offset in range(0, rows.shape[0], step)]
        for name, rows in regions.items()
    }
    starts, lengths = store.sample_rows(chunk.sample_start, chunk.sample_end)
    samples = []
    for first, length in zip((starts - chunk.row_start).tolist(), lengths.tolist(), strict=True):
        ids = regions["input_ids"][first : first + length]
        mask = regions["loss_mask"][first : first + length]
        samples.append(TokenizedSample(ids, mask, truncated=False))
    return samples, digests


def batches(
    samples: Sequence[TokenizedSample], batch_tokens: int
) -> Iterator[list[TokenizedSample]]:
    batch: list[TokenizedSample] = []
    tokens = 0
    for sample in samples:
        if batch and tokens + sample.num_tokens > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(sample)
        tokens += sample.num_tokens
    if batch:
        yield batch


def _states(
    future: Future[torch.Tensor], bad_states: BadStatesPolicy
) -> torch.Tensor | CapturedDataError:
    """A request's states; the engine's refusal of them is kept for the writer to skip the
    sample when asked to (any other failure fails the chunk)."""
    error = future.exception()
    if isinstance(error, CapturedDataError) and bad_states == "skip":
        return error
    return future.result()


def extract_chunk(
    store: ExtractionStore,
    chunk: WorkChunk,
    engine: HiddenStateEngine,
    batch_tokens: int,
    context: RunContext,
    progress: Callable[[int], None] | None = None,
    queue_limit: int | None = None,
    bad_states: BadStatesPolicy = "fail",
) -> CommitRecord:
    """Extract and write ``chunk``, then write its commit record (last). Returns the record.
    ``queue_limit``: tokens the process keeps queued at the engine (engine_queue_limit).
    ``bad_states``: what a sample whose states fail a check does (hsx.engine.capture_checks)."""
    queue_limit = queue_limit or engine_queue_limit(batch_tokens, None)
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    samples, read_digests = chunk_samples(store, chunk)
    writer = ChunkWriter(store, chunk, bad_states)
    pending: Future[None] | None = None
    queued: deque[tuple[list[TokenizedSample], list[Future[torch.Tensor]]]] = deque()

    def consume() -> None:
        nonlocal pending
        batch, futures = queued.popleft()
        # One wake-up when the whole batch is done, not one per request: each wake-up of this
        # thread takes the GIL from the engine's driver thread.
        wait(futures)
        states = [_states(future, bad_states) for future in futures]
        if pending is not None:
            pending.result()  # keeps rows in order and at most one batch waiting
        pending = _APPEND_POOL.submit(_timed_append, writer, batch, states)
        if progress is not None:
            progress(sum(sample.num_tokens for sample in batch))

    try:
        for batch in batches(samples, batch_tokens):
            raise_if_stopped(chunk.name)  # a stopped run queues nothing more
            prompts = [sample.input_ids for sample in batch]
            queued.append((batch, _submit(engine, prompts, queue_limit)))
            if len(queued) > PREFETCH_BATCHES:
                consume()
        while queued:
            raise_if_stopped(chunk.name)
            consume()
    finally:
        if pending is not None:
            pending.result()
    checksums = {**read_digests, **writer.finish()}
    record = CommitRecord(
        chunk_index=chunk.index,
        row_start=chunk.row_start,
        row_end=chunk.row_end,
        sample_start=chunk.sample_start,
        sample_end=chunk.sample_end,
        tokens=chunk.tokens,
        checksums=checksums,
        checksum_algorithm=ALGORITHM,
        plan_hash=str(store.meta["plan_hash"]),
        run_id=context.run_id,
        attempt=context.attempt,
        code_version=context.code_version,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=started_at.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        seconds=round(time.perf_counter() - started, 4),
        extra=dict(context.extra or {}),
        skipped_samples=list(writer.skipped),
    )
    with timings.timed("commit"):
        store.write_commit(record)  # last: until now the chunk does not exist for readers
    return record
