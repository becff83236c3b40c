"""Extracting one work chunk: tokenize its samples, run the engine batch by batch, write whole
Zarr chunks with streaming checksums, then commit.

Writing overlaps the engine: batch i is copied, hashed and handed to the I/O threads while the
engine computes the next batches. Per chunk at most one batch waits to be appended; per run
at most the write budget's bytes of objects wait to be written. Memory is bounded by those, the
queued batches and one staging Zarr chunk per writer, whatever the size of the dataset or the
work chunk.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from hsx import timings
from hsx.data.tokenization import TokenizedSample
from hsx.engine.capture_checks import BadStatesPolicy, CapturedDataError, SampleScan
from hsx.errors import StoreError
from hsx.extraction.host_pipeline import HiddenStateEngine, HostPipeline
from hsx.interrupt import raise_if_stopped
from hsx.plan.chunks import WorkChunk
from hsx.store.checksums import ALGORITHM, digest, new_hasher, update_digest
from hsx.store.fp8_states import ENCODING as FP8_ENCODING
from hsx.store.fp8_states import SCALES_ARRAY, quantize, unpack
from hsx.store.local_io import DIRECT_ALIGNMENT
from hsx.store.zarr_store import CommitRecord, ExtractionStore

logger = logging.getLogger(__name__)


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


def stored_parts(states: torch.Tensor, store: ExtractionStore) -> dict[str, np.ndarray]:
    """One sample's states ``[tokens, K, H]`` (or, from a GPU engine for an fp8 store, packed
    ``[tokens, K, H + 4]`` uint8) as the arrays the store keeps: hidden_states in its physical
    dtype, plus hidden_scales ``[tokens, K]`` in an fp8 store."""
    if store.state_encoding == FP8_ENCODING:
        # Packed rows [tokens, K, H + 4] uint8: a GPU engine quantized them before its copy.
        q, scales = unpack(states) if states.dtype == torch.uint8 else quantize(states)
        return {"hidden_states": q.cpu().numpy(), SCALES_ARRAY: scales.cpu().numpy()}
    return {"hidden_states": to_stored(states, store.logical_dtype)}


# The work chunk writes the store's state arrays (store.state_arrays); input_ids and loss_mask
# were written with the store's layout (from the plan) and are only read and checksummed.
READ_ARRAYS = ("input_ids", "loss_mask")
# Rows are copied and hashed in blocks of about this size: a block stays in the L2 cache (2 MiB
# per core here, 1 MiB or more on current server CPUs) between the copy and the hash.
_HASH_BLOCK_BYTES = 512 << 10


class ChunkWriter:
    """Writes one work chunk's rows in whole Zarr chunks and hashes exactly the stored bytes.

    Rows are copied into reused staging buffers of C rows per array (a fresh allocation per
    flush costs page faults that measured slower than the write itself on these machines). Each
    block of rows is hashed right after it is copied, while it is still in the CPU cache: a
    separate pass over a full buffer read all of it from memory again, and that extra memory
    traffic measured 6% of store write speed. Full buffers are written by the I/O pool while the
    next fills."""

    def __init__(
        self,
        host: HostPipeline,
        store: ExtractionStore,
        chunk: WorkChunk,
        bad_states: BadStatesPolicy = "fail",
    ) -> None:
        self.host = host
        self.store = store
        self.chunk = chunk
        self.bad_states = bad_states
        self.layer_ids = tuple(int(i) for i in store.meta.get("layer_ids", ()))
        self._next_sample = chunk.sample_start
        # Samples whose states failed a check (bad_states="skip"): recorded in the commit.
        self.skipped: list[dict[str, Any]] = []
        self.rows = store.rows_per_chunk
        self.written_arrays = store.state_arrays
        # fp8: the checks read each vector's scale (its max magnitude), not the fp8 bits.
        self.scan_array = SCALES_ARRAY if SCALES_ARRAY in self.written_arrays else "hidden_states"
        # Digests, one per Zarr chunk, in row order.
        self._digests: dict[str, list[str]] = {name: [] for name in self.written_arrays}
        self._staging = {
            name: self.host.staging.take(
                (self.rows, *store.array(name).shape[1:]), store.array(name).dtype
            )
            for name in self.written_arrays
        }
        self._hashers = {name: new_hasher() for name in self.written_arrays}
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
                part = stored_parts(rows, self.store)  # hidden_states [tokens, K, H], ...
                if rows.shape[0] != sample.num_tokens:
                    problem = (
                        f"captured {rows.shape[0]} rows, expected {sample.num_tokens} as planned"
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

    def _zero_rows(self, tokens: int) -> dict[str, np.ndarray]:
        arrays = {name: self.store.array(name) for name in self.written_arrays}
        return {
            name: np.zeros((tokens, *array.shape[1:]), dtype=array.dtype)
            for name, array in arrays.items()
        }

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

    def _append_rows(self, parts: dict[str, np.ndarray], scan: SampleScan | None) -> None:
        """Append one sample's rows of every written array (same row count each)."""
        count, offset = parts["hidden_states"].shape[0], 0
        while offset < count:
            if self._filled == 0 and count - offset >= self.rows:
                whole = {name: part[offset : offset + self.rows] for name, part in parts.items()}
                if all(self._writable_in_place(rows) for rows in whole.values()):
                    if scan is not None:
                        scan.add(whole[self.scan_array], offset)
                    self._submit_in_place(whole)
                    offset += self.rows
                    continue
            take = min(count - offset, self.rows - self._filled, self._block_rows)
            for name, part in parts.items():
                block = self._staging[name][self._filled : self._filled + take]
                block[...] = part[offset : offset + take]
                if scan is not None and name == self.scan_array:
                    scan.add(block, offset)  # still in cache
                update_digest(self._hashers[name], block)
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
            self._staging[name] = self.host.staging.take(staging.shape, staging.dtype)
        self._next_row += self.rows
        self._filled = 0
        self._bound_in_flight()

    def _submit_write(self, name: str, rows: np.ndarray, staged: bool) -> Future[None]:
        self.host.write_budget.acquire(rows.nbytes)  # waits while the run has enough in flight
        try:
            return self.host.io_pool.submit(self._write, name, self._next_row, rows, staged)
        except BaseException:
            self.host.write_budget.release(rows.nbytes)
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
            self.host.write_budget.release(rows.nbytes)
            if staged:
                self.host.staging.give_back(rows)

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
            self.host.staging.give_back(staging)
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
    host: HostPipeline,
    store: ExtractionStore,
    chunk: WorkChunk,
    engine: HiddenStateEngine,
    batch_tokens: int,
    context: RunContext,
    progress: Callable[[int], None] | None = None,
    bad_states: BadStatesPolicy = "fail",
) -> CommitRecord:
    """Extract and write ``chunk``, then write its commit record (last). Returns the record.
    ``host``: the run's queue, write budget and pools (hsx.extraction.host_pipeline).
    ``bad_states``: what a sample whose states fail a check does (hsx.engine.capture_checks)."""
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    samples, read_digests = chunk_samples(store, chunk)
    writer = ChunkWriter(host, store, chunk, bad_states)
    # An fp8 store lets an engine on a GPU quantize before its copy (packed rows arrive).
    encoding = FP8_ENCODING if store.state_encoding == FP8_ENCODING else ""
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
        pending = host.append_pool.submit(_timed_append, writer, batch, states)
        if progress is not None:
            progress(sum(sample.num_tokens for sample in batch))

    try:
        for batch in batches(samples, batch_tokens):
            raise_if_stopped(chunk.name)  # a stopped run queues nothing more
            prompts = [sample.input_ids for sample in batch]
            queued.append((batch, host.submit(engine, prompts, encoding)))
            if len(queued) > host.prefetch_batches:
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
    # A run stopped while the last batch was written (or declared dead: flows/extract_item.py)
    # must not commit: its chunk is redone, perhaps already by another node.
    raise_if_stopped(chunk.name)
    with timings.timed("commit"):
        winner = store.write_commit(record)  # last: until now the chunk does not exist for readers
    if winner is not None:
        _record_collision(store, record, winner)
    return record


def _record_collision(store: ExtractionStore, record: CommitRecord, winner: CommitRecord) -> None:
    """Another attempt committed this chunk first: keep its commit, record both, go on (the
    run's verify, or the parent of many nodes, re-checks the chunk's objects)."""
    collision = store.write_collision(record, winner)
    record.extra["collision"] = collision
    logger.warning(
        "chunk %06d was committed first by run %s attempt %d on %s; this attempt (run %s, "
        "attempt %d) computed it too and did not commit (%s)",
        record.chunk_index,
        winner.run_id,
        winner.attempt,
        winner.host,
        record.run_id,
        record.attempt,
        "the same object digests"
        if collision["same_checksums"]
        else "other object digests: run `hsx verify` on the store",
    )
