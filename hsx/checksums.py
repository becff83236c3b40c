"""Checksums of stored array regions.

xxh3-128 was chosen from a measurement on these machines (1 GB, one thread): xxh3_128 22.8 GB/s,
crc32c 14.3, blake3 4.4, sha256 1.8. It is not cryptographic: it detects corruption and torn
writes, not tampering.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

ALGORITHM = "xxh3_128"


class RegionHasher:
    """Streams the bytes of one array region, in row order, into one digest."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()

    def update(self, rows: np.ndarray) -> None:
        # C order bytes of the rows: the same bytes the store holds for that region.
        contiguous: Any = np.ascontiguousarray(rows)  # numpy arrays are buffers; stubs disagree
        self._hasher.update(memoryview(contiguous).cast("B"))

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())


def digest(rows: np.ndarray) -> str:
    hasher = RegionHasher()
    hasher.update(rows)
    return hasher.hexdigest()
