"""Token ids and loss masks of the whole dataset, spooled to local disk while planning.

Planning tokenizes every conversation anyway (to know each sample's length); keeping the result
in two flat temporary files lets the store's input_ids and loss_mask be written once, at creation,
so work chunks never tokenize again. Re-tokenizing in the chunk tasks measured 15-20% of
extraction time here, spent holding the GIL beside the engine. Memory stays flat: rows go to disk
as they come and are read back one Zarr chunk at a time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np


class TokenSpool:
    """Append-only ``input_ids`` (int32) and ``loss_mask`` (uint8) of consecutive samples."""

    def __init__(self, directory: str | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="hsx-tokens-", dir=directory))
        self._ids = open(self._dir / "input_ids.bin", "wb")  # noqa: SIM115 - closed in close()
        self._mask = open(self._dir / "loss_mask.bin", "wb")  # noqa: SIM115
        self.tokens = 0
        self._readers: tuple[np.ndarray, np.ndarray] | None = None

    def append(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> int:
        """Add one sample's rows; returns its offset in the spool."""
        offset = self.tokens
        self._ids.write(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
        self._mask.write(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
        self.tokens += int(input_ids.shape[0])
        return offset

    def rows(self, offset: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids [count], loss_mask [count]) starting at spool row ``offset``."""
        if self._readers is None:
            self._ids.flush()
            self._mask.flush()
            if self.tokens == 0:
                empty = (np.zeros(0, np.int32), np.zeros(0, np.uint8))
                return empty
            self._readers = (
                np.memmap(
                    self._dir / "input_ids.bin", dtype=np.int32, mode="r", shape=(self.tokens,)
                ),
                np.memmap(
                    self._dir / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(self.tokens,)
                ),
            )
        ids, mask = self._readers
        return ids[offset : offset + count], mask[offset : offset + count]

    def close(self) -> None:
        self._readers = None
        self._ids.close()
        self._mask.close()
        for name in ("input_ids.bin", "loss_mask.bin"):
            (self._dir / name).unlink(missing_ok=True)
        os.rmdir(self._dir)

    def __enter__(self) -> TokenSpool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
