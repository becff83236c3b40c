"""The plan: every sample's length and rows, cut into work chunks that own whole Zarr chunks.

Computed before any extraction (tokenizing is cheap next to a forward pass) so the store's arrays
are created at their final size: no resize, no locks, and a retry rewrites exactly its own
storage objects. A work chunk is a run of whole samples whose rows are padded up to a multiple of
the Zarr chunk length C. Memory is a few bytes per sample; token ids are not kept (each work
chunk re-tokenizes its own samples, starting from the byte offset recorded here).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hsx.errors import ConfigError
from hsx.plan.token_spool import TokenSpool


@dataclass(frozen=True)
class WorkChunk:
    """Samples [sample_start, sample_end) stored at rows [row_start, row_end)."""

    index: int
    sample_start: int
    sample_end: int
    row_start: int
    row_end: int
    tokens: int  # real (unpadded) tokens
    byte_offset: int  # of the first sample's line in the dataset file
    line_number: int  # 1-based line of the first sample

    @property
    def name(self) -> str:
        return f"chunk-{self.index:06d}"


@dataclass
class Plan:
    inputs: dict[str, Any]  # everything that determines the stored bytes; hashed into plan_hash
    sample_lengths: np.ndarray  # int32 [N]
    sample_starts: np.ndarray  # int64 [N], row of each sample's first token
    chunks: list[WorkChunk]
    total_rows: int
    rows_per_chunk: int
    # Every sample's token ids and loss mask, in sample order (written into a new store).
    tokens: TokenSpool | None = None
    # Samples longer than data.max_length: {"policy", "truncated": [[sample, tokens], ...],
    # "skipped": [[row, tokens], ...]} (sample: index in the store; row: where it was read).
    overlength: dict[str, Any] | None = None
    # Rows per storage object of input_ids and loss_mask (layout.token_rows_per_object; None:
    # token_object_rows' default). Not in ``inputs``: the stored values do not depend on it.
    token_rows_per_object: int | None = None

    def close(self) -> None:
        if self.tokens is not None:
            self.tokens.close()
            self.tokens = None

    def chunk_rows(self, chunk: WorkChunk) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of the chunk's rows [row_start, row_end), zero-padded."""
        if self.tokens is None:
            raise ConfigError("plan has no token spool: it was closed before the store was written")
        size = chunk.row_end - chunk.row_start
        ids = np.zeros(size, dtype=np.int32)
        mask = np.zeros(size, dtype=np.uint8)
        first = (
            int(self.sample_starts[chunk.sample_start])
            if chunk.sample_end > chunk.sample_start
            else 0
        )
        spool_offset = int(self.sample_lengths[: chunk.sample_start].sum())
        spool_ids, spool_mask = self.tokens.rows(spool_offset, chunk.tokens)
        # Samples are contiguous inside a work chunk; padding only follows the last one.
        ids[first - chunk.row_start : first - chunk.row_start + chunk.tokens] = spool_ids
        mask[first - chunk.row_start : first - chunk.row_start + chunk.tokens] = spool_mask
        return ids, mask

    @property
    def num_samples(self) -> int:
        return int(self.sample_lengths.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.sample_lengths.sum())

    @property
    def plan_hash(self) -> str:
        return plan_hash(self.inputs, self.chunks)

    def chunk(self, index: int) -> WorkChunk:
        if not 0 <= index < len(self.chunks):
            raise ConfigError(
                f"work chunk index: expected 0..{len(self.chunks) - 1}, found {index}"
            )
        return self.chunks[index]


def plan_hash(inputs: dict[str, Any], chunks: list[WorkChunk]) -> str:
    payload = json.dumps(
        {"inputs": inputs, "chunks": [asdict(c) for c in chunks]}, sort_keys=True, default=str
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def auto_work_chunk_tokens(
    total_tokens: int, rows_per_chunk: int, target_chunks: int, min_tokens: int
) -> int:
    """Size work chunks so a run holds about ``target_chunks`` tasks (Prefect's history drops
    task runs under bursts of thousands), never below ``min_tokens``; a multiple of C."""
    wanted = max(math.ceil(total_tokens / max(target_chunks, 1)), min_tokens, rows_per_chunk)
    return math.ceil(wanted / rows_per_chunk) * rows_per_chunk


# Rows of one input_ids/loss_mask object by default: 256 KiB of int32 ids. Those arrays are 5
# bytes a row against the states' kilobytes; at C rows an object is a few KiB and one request
# each (1.56M PUTs at creation for 200M tokens at C=256, issue 29).
TOKEN_OBJECT_ROWS = 65_536


def token_object_rows(total_rows: int, rows_per_chunk: int, wanted: int | None) -> int:
    """Rows per storage object of the token arrays: ``wanted`` (a multiple of C) or about
    TOKEN_OBJECT_ROWS, and no more than the array's rows rounded up to C."""
    c = rows_per_chunk
    if wanted is not None and (wanted < c or wanted % c):
        raise ConfigError(
            f"layout.token_rows_per_object: expected a multiple of rows_per_chunk ({c}), "
            f"found {wanted}"
        )
    rows = wanted or math.ceil(TOKEN_OBJECT_ROWS / c) * c
    return min(rows, max(math.ceil(total_rows / c), 1) * c)


def storage_rows_for_work_chunks(auto_rows: int, work_chunk_tokens: int | None) -> int:
    """The automatic C, made no larger than a work chunk set by hand: each work chunk is padded
    to whole storage chunks, so a C above it pads every one (225 work chunks of 512 tokens into
    8,192-row objects: 3.6 GB written for 103k tokens of the tiny model). The largest power of
    two not above ``work_chunk_tokens`` then, at least 16 (the settings' bound)."""
    if work_chunk_tokens is None or work_chunk_tokens >= auto_rows:
        return auto_rows
    return max(16, 2 ** int(math.log2(work_chunk_tokens)))


def auto_rows_per_chunk(row_bytes: int, target_bytes: int) -> int:
    """A power of two of rows whose hidden-state object is nearest ``target_bytes``, in
    [64, 65536]: 16 MiB gives C=256 for Kimi-K2 (K=4, H=7168, bf16) and 8192 for a tiny model."""
    wanted = max(target_bytes / max(row_bytes, 1), 1.0)
    return int(min(max(2 ** round(math.log2(wanted)), 64), 65536))


def cut_chunks(
    lengths: np.ndarray,  # int32 [N]
    byte_offsets: np.ndarray,  # int64 [N]
    line_numbers: np.ndarray,  # int64 [N]
    rows_per_chunk: int,
    work_chunk_tokens: int,
) -> tuple[list[WorkChunk], np.ndarray, int]:
    """Greedy cut into runs of whole samples of about ``work_chunk_tokens`` rows each.

    Returns (chunks, sample_starts [N] int64, total_rows). A sample longer than a work chunk gets
    a chunk of its own."""
    chunks: list[WorkChunk] = []
    starts = np.zeros(len(lengths), dtype=np.int64)
    row = 0
    first = 0
    rows_in_chunk = 0

    def close(end: int) -> None:
        nonlocal row, first, rows_in_chunk
        padded = math.ceil(rows_in_chunk / rows_per_chunk) * rows_per_chunk
        chunks.append(
            WorkChunk(
                index=len(chunks),
                sample_start=first,
                sample_end=end,
                row_start=row,
                row_end=row + padded,
                tokens=rows_in_chunk,
                byte_offset=int(byte_offsets[first]),
                line_number=int(line_numbers[first]),
            )
        )
        row += padded
        first = end
        rows_in_chunk = 0

    for i, length in enumerate(lengths.tolist()):
        if rows_in_chunk and rows_in_chunk + length > work_chunk_tokens:
            close(i)
        starts[i] = row + rows_in_chunk
        rows_in_chunk += length
    if rows_in_chunk:
        close(len(lengths))
    return chunks, starts, row
