"""Reading a store from a training loop: sample i as tensors, committed chunks only.

A missing Zarr chunk reads back as zeros without error, so the reader trusts commit records: a
sample whose work chunk has no commit is refused, never returned as zeros. A sample whose states
failed a check and was skipped (capture.on_bad_states=skip) is left out, its reason kept in
``skipped_samples``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hsx.errors import StoreError
from hsx.store.zarr_store import ExtractionStore


@dataclass
class Sample:
    """One conversation's extraction, as an EAGLE-3 trainer consumes it."""

    index: int
    input_ids: torch.Tensor  # [tokens] int64
    loss_mask: torch.Tensor  # [tokens] bool: True on assistant tokens
    hidden_states: torch.Tensor  # [tokens, K, H] in the logical dtype (bfloat16 or float32)
    layer_ids: tuple[int, ...]

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """The EAGLE-3 draft's input: the K-1 aux layers concatenated, [tokens, (K-1)*H]."""
        tokens, k, h = self.hidden_states.shape
        return self.hidden_states[:, : k - 1].reshape(tokens, (k - 1) * h)

    @property
    def target_hidden_states(self) -> torch.Tensor:
        """The last captured layer (the final pre-norm state with default ids), [tokens, H]."""
        return self.hidden_states[:, -1]


class HiddenStatesReader:
    """Random access to the committed samples of one store (a map-style torch Dataset)."""

    def __init__(self, url: str) -> None:
        self.store = ExtractionStore.open(url, mode="r")
        meta = self.store.meta
        self.layer_ids = tuple(int(i) for i in meta["layer_ids"])
        self.hidden_size = int(meta["hidden_size"])
        self.logical_dtype = str(meta["logical_dtype"])
        self._starts = np.asarray(self.store.array("sample_starts")[:], dtype=np.int64)
        self._lengths = np.asarray(self.store.array("sample_lengths")[:], dtype=np.int64)
        commits = self.store.committed_chunks()
        self._committed = np.zeros(len(self._lengths), dtype=bool)
        for commit in commits.values():
            self._committed[commit.sample_start : commit.sample_end] = True
        # sample index -> why its states were kept out
        self.skipped_samples: dict[int, str] = {
            int(entry["sample"]): str(entry["reason"])
            for commit in commits.values()
            for entry in commit.skipped_samples
        }
        usable = self._committed.copy()
        usable[list(self.skipped_samples)] = False
        self._usable = usable
        self._available = np.flatnonzero(usable).astype(np.int64)

    @property
    def num_samples(self) -> int:
        """Samples in the plan (committed or not)."""
        return len(self._lengths)

    @property
    def available_samples(self) -> np.ndarray:
        """Indices of the samples whose work chunk is committed (and that were not skipped),
        ascending."""
        return self._available

    def sample(self, index: int) -> Sample:
        self._check_usable(index)
        start, length = int(self._starts[index]), int(self._lengths[index])
        end = start + length
        ids = torch.from_numpy(self.store.read_rows("input_ids", start, end).astype(np.int64))
        mask = torch.from_numpy(self.store.read_rows("loss_mask", start, end).astype(bool))
        states = self._as_tensor(self.store.read_rows("hidden_states", start, end))
        return Sample(index, ids, mask, states, self.layer_ids)

    def _check_usable(self, index: int) -> None:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index: expected 0..{self.num_samples - 1}, found {index}")
        if not self._committed[index]:
            raise StoreError(
                f"sample {index} of {self.store.url}: its work chunk is not committed (resume the extraction)"
            )
        if not self._usable[index]:
            raise StoreError(
                f"sample {index} of {self.store.url}: skipped at extraction, its states failed "
                f"a check: {self.skipped_samples[index]}"
            )

    def samples(self, indices: Sequence[int]) -> list[Sample]:
        """Several samples (a training batch), each storage object they touch read once."""
        for index in indices:
            self._check_usable(index)
        ranges = [(int(self._starts[i]), int(self._starts[i] + self._lengths[i])) for i in indices]
        rows = self.store.read_row_ranges(("input_ids", "loss_mask", "hidden_states"), ranges)
        ids, masks, states = rows["input_ids"], rows["loss_mask"], rows["hidden_states"]
        return [
            Sample(
                int(index),
                torch.from_numpy(ids[n].astype(np.int64)),
                torch.from_numpy(masks[n].astype(bool)),
                self._as_tensor(states[n]),
                self.layer_ids,
            )
            for n, index in enumerate(indices)
        ]

    def _as_tensor(self, raw: np.ndarray) -> torch.Tensor:
        """[tokens, K, H] stored rows as a tensor of the logical dtype (bf16 stored as uint16)."""
        if self.logical_dtype == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(raw).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(raw))

    def __len__(self) -> int:
        return len(self._available)

    def __getitem__(self, position: int) -> Sample:
        return self.sample(int(self._available[position]))
