"""Extracting one work chunk: tokenize its samples, run the engine batch by batch, write whole
Zarr chunks with streaming checksums, then commit.

Writing overlaps the engine: batch i is hashed and written by one writer thread while the engine
computes batch i+1 (vLLM's CPU build uses one thread per engine, leaving a core free). At most one
batch waits, so memory is bounded by two batches plus one Zarr chunk of rows, whatever the size of
the dataset or the work chunk.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hsx.checksums import ALGORITHM, RegionHasher
from hsx.dataset import TokenizedSample, iter_conversations, tokenize_conversation
from hsx.errors import StoreError
from hsx.plan import WorkChunk
from hsx.store import ROW_ARRAYS, CommitRecord, ExtractionStore

logger = logging.getLogger(__name__)


class HiddenStateEngine(Protocol):
    """What extraction needs of an engine (vLLM, or the HF reference in tests)."""

    def extract(self, prompts: Sequence[np.ndarray]) -> list[torch.Tensor]: ...


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


class ChunkWriter:
    """Writes one work chunk's rows in whole Zarr chunks and hashes exactly the stored bytes."""

    def __init__(self, store: ExtractionStore, chunk: WorkChunk) -> None:
        self.store = store
        self.chunk = chunk
        self.rows_per_chunk = int(store.meta["rows_per_chunk"])
        self.logical_dtype = store.logical_dtype
        self.hashers = {name: RegionHasher() for name in ROW_ARRAYS}
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in ROW_ARRAYS}
        self._pending_rows = 0
        self._next_row = chunk.row_start
        self._written_tokens = 0

    def append(self, samples: Sequence[TokenizedSample], states: Sequence[torch.Tensor]) -> None:
        for sample, rows in zip(samples, states, strict=True):
            self._pending["input_ids"].append(sample.input_ids.astype(np.int32, copy=False))
            self._pending["loss_mask"].append(sample.loss_mask.astype(np.uint8, copy=False))
            self._pending["hidden_states"].append(to_stored(rows, self.logical_dtype))
            self._pending_rows += sample.num_tokens
            self._written_tokens += sample.num_tokens
        whole = (self._pending_rows // self.rows_per_chunk) * self.rows_per_chunk
        if whole:
            self._flush(whole)

    def _flush(self, count: int) -> None:
        arrays = {name: np.concatenate(parts) for name, parts in self._pending.items()}
        head = {name: array[:count] for name, array in arrays.items()}
        for name, rows in head.items():
            self.hashers[name].update(rows)
        self.store.write_rows(self._next_row, head)
        self._next_row += count
        self._pending = {name: [array[count:]] for name, array in arrays.items()}
        self._pending_rows -= count

    def finish(self) -> dict[str, str]:
        """Pad the last Zarr chunk with zero rows, write it, return the region digests."""
        if self._written_tokens != self.chunk.tokens:
            raise StoreError(
                f"{self.chunk.name}: expected {self.chunk.tokens} tokens as planned, found "
                f"{self._written_tokens} (the dataset or tokenizer changed since the plan)"
            )
        padding = self.chunk.row_end - self._next_row - self._pending_rows
        if self._pending_rows or padding:
            for parts in self._pending.values():
                template = parts[0] if parts else np.zeros((0,), dtype=np.uint8)
                parts.append(np.zeros((padding, *template.shape[1:]), dtype=template.dtype))
            self._pending_rows += padding
            self._flush(self._pending_rows)
        if self._next_row != self.chunk.row_end:
            raise StoreError(
                f"{self.chunk.name}: expected to end at row {self.chunk.row_end}, ended at {self._next_row}"
            )
        return {name: hasher.hexdigest() for name, hasher in self.hashers.items()}


def tokenized_samples(
    dataset: Path, tokenizer: Any, chunk: WorkChunk, max_length: int, expected_lengths: np.ndarray
) -> list[TokenizedSample]:
    """The chunk's samples, read from its byte offset and checked against the planned lengths."""
    samples: list[TokenizedSample] = []
    start = (chunk.byte_offset, chunk.line_number, chunk.sample_start)
    for conversation in iter_conversations(dataset, start=start):
        if conversation.index >= chunk.sample_end:
            break
        sample = tokenize_conversation(
            tokenizer,
            conversation.messages,
            max_length,
            where=f"{dataset}:{conversation.line_number}",
        )
        planned = int(expected_lengths[conversation.index - chunk.sample_start])
        if sample.num_tokens != planned:
            raise StoreError(
                f"{dataset}:{conversation.line_number}: expected {planned} tokens as planned, found "
                f"{sample.num_tokens} (the dataset or tokenizer changed since the plan)"
            )
        samples.append(sample)
    if len(samples) != chunk.sample_end - chunk.sample_start:
        raise StoreError(
            f"{chunk.name}: expected samples {chunk.sample_start}..{chunk.sample_end - 1} in {dataset}, "
            f"found {len(samples)} (the dataset changed since the plan)"
        )
    return samples


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


def extract_chunk(
    store: ExtractionStore,
    chunk: WorkChunk,
    engine: HiddenStateEngine,
    samples: Sequence[TokenizedSample],
    batch_tokens: int,
    context: RunContext,
    progress: Callable[[int], None] | None = None,
) -> CommitRecord:
    """Extract and write ``chunk``, then write its commit record (last). Returns the record."""
    started_at = datetime.now(UTC)
    started = time.perf_counter()
    writer = ChunkWriter(store, chunk)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-writer") as pool:
        pending: Future[None] | None = None
        for batch in batches(samples, batch_tokens):
            states = engine.extract([sample.input_ids for sample in batch])
            if pending is not None:
                pending.result()  # keeps rows in order and at most one batch waiting
            pending = pool.submit(writer.append, batch, states)
            if progress is not None:
                progress(sum(sample.num_tokens for sample in batch))
        if pending is not None:
            pending.result()
    checksums = writer.finish()
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
    )
    store.write_commit(record)  # last: until now the chunk does not exist for readers
    return record
