"""Re-reading every committed chunk and comparing its bytes with the commit's checksums."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hsx.checksums import ALGORITHM, digest
from hsx.errors import StoreError
from hsx.store import ROW_ARRAYS, ExtractionStore


@dataclass
class ChunkProblem:
    chunk_index: int
    message: str


@dataclass
class VerifyReport:
    url: str
    chunks_planned: int
    chunks_committed: int = 0
    chunks_verified: int = 0
    missing: list[int] = field(default_factory=list)
    problems: list[ChunkProblem] = field(default_factory=list)
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """True only when every planned chunk is committed and every byte verifies."""
        return (
            not self.missing and not self.problems and self.chunks_verified == self.chunks_planned
        )

    def summary(self) -> str:
        state = "OK" if self.ok else "FAILED"
        return (
            f"{state}: {self.chunks_verified}/{self.chunks_planned} chunks verified, "
            f"{len(self.missing)} missing, {len(self.problems)} with mismatches"
        )


def verify_store(
    store: ExtractionStore,
    only: set[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Hash each committed chunk's regions, one Zarr chunk of rows at a time (bounded memory)."""
    chunks = [c for c in store.work_chunks if only is None or c.index in only]
    report = VerifyReport(url=store.url, chunks_planned=len(chunks))
    commits = store.committed_chunks()
    step = int(store.meta["rows_per_chunk"])
    for chunk in chunks:
        record = commits.get(chunk.index)
        if record is None:
            report.missing.append(chunk.index)
            continue
        report.chunks_committed += 1
        if record.checksum_algorithm != ALGORITHM:
            report.problems.append(
                ChunkProblem(
                    chunk.index,
                    f"expected checksum algorithm {ALGORITHM}, found {record.checksum_algorithm}",
                )
            )
            continue
        if (record.row_start, record.row_end) != (chunk.row_start, chunk.row_end):
            report.problems.append(
                ChunkProblem(
                    chunk.index,
                    f"expected rows [{chunk.row_start}, {chunk.row_end}), commit says [{record.row_start}, {record.row_end})",
                )
            )
            continue
        bad = False
        for name in ROW_ARRAYS:
            stored = list(record.checksums.get(name, []))
            objects = (chunk.row_end - chunk.row_start) // step
            if len(stored) != objects:
                bad = True
                report.problems.append(
                    ChunkProblem(
                        chunk.index,
                        f"{name}: expected {objects} checksums in the commit, found {len(stored)}",
                    )
                )
                continue
            for position, row in enumerate(range(chunk.row_start, chunk.row_end, step)):
                try:
                    rows = store.read_rows(name, row, row + step)  # one storage object at a time
                except StoreError as exc:  # a missing or truncated object
                    bad = True
                    report.problems.append(ChunkProblem(chunk.index, str(exc)))
                    continue
                report.bytes_read += rows.nbytes
                computed = digest(rows)
                if computed != stored[position]:
                    bad = True
                    report.problems.append(
                        ChunkProblem(
                            chunk.index,
                            f"{name} rows [{row}, {row + step}): stored and computed checksum do not "
                            f"match. Stored: {stored[position]} Computed: {computed}",
                        )
                    )
        if not bad:
            report.chunks_verified += 1
        if progress is not None:
            progress(1)
    return report
