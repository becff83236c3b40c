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
from hsx.store.fp8_states import SCALES_ARRAY, dequantize
from hsx.store.zarr_store import ExtractionStore


@dataclass
class Sample:
    """One conversation's extraction, as an EAGLE-3 trainer consumes it."""

    index: int
    input_ids: torch.Tensor  # [tokens] int64
    loss_mask: torch.Tensor  # [tokens] bool: True on assistant tokens
    hidden_states: torch.Tensor  # [tokens, K, H] in the logical dtype (bfloat16 or float32)
    layer_ids: tuple[int, ...]
    # fp8 stores read with dequantize=False: hidden_states is float8_e4m3fn and these are its
    # scales [tokens, K] float32 (state = fp8 value * scale).
    scales: torch.Tensor | None = None

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

    def __init__(self, url: str, dequantize: bool = True) -> None:
        """``dequantize=False`` on an fp8 store returns the stored fp8 states and their scales
        (``Sample.scales``) instead of states in the logical dtype."""
        self.store = ExtractionStore.open(url, mode="r")
        self.dequantize = dequantize
        self._state_arrays = self.store.state_arrays
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
        parts = {name: self.store.read_rows(name, start, end) for name in self._state_arrays}
        return self._sample(index, ids, mask, parts)

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
        rows = self.store.read_row_ranges(("input_ids", "loss_mask", *self._state_arrays), ranges)
        return [
            self._sample(
                int(index),
                torch.from_numpy(rows["input_ids"][n].astype(np.int64)),
                torch.from_numpy(rows["loss_mask"][n].astype(bool)),
                {name: rows[name][n] for name in self._state_arrays},
            )
            for n, index in enumerate(indices)
        ]

    def _sample(
        self, index: int, ids: torch.Tensor, mask: torch.Tensor, parts: dict[str, np.ndarray]
    ) -> Sample:
        """A Sample from the stored rows of its state arrays (``hidden_states [tokens, K, H]``,
        and ``hidden_scales [tokens, K]`` in an fp8 store)."""
        raw = np.ascontiguousarray(parts["hidden_states"])
        if SCALES_ARRAY not in parts or self.dequantize:
            states = states_tensor(raw, parts.get(SCALES_ARRAY), self.logical_dtype)
            return Sample(index, ids, mask, states, self.layer_ids)
        q = torch.from_numpy(raw)
        scales = torch.from_numpy(np.ascontiguousarray(parts[SCALES_ARRAY]))
        return Sample(index, ids, mask, q.view(torch.float8_e4m3fn), self.layer_ids, scales)

    def __len__(self) -> int:
        return len(self._available)

    def __getitem__(self, position: int) -> Sample:
        return self.sample(int(self._available[position]))


def states_tensor(raw: np.ndarray, scales: np.ndarray | None, logical_dtype: str) -> torch.Tensor:
    """Stored rows of ``hidden_states`` ``[tokens, K, H]`` (and, in an fp8 store, their
    ``hidden_scales [tokens, K]``) as a tensor of the logical dtype (bf16 is stored as uint16;
    fp8 bits are dequantized)."""
    raw = np.ascontiguousarray(raw)
    if scales is not None:
        q = torch.from_numpy(raw)
        factors = torch.from_numpy(np.ascontiguousarray(scales))
        return dequantize(q, factors, getattr(torch, logical_dtype))
    if logical_dtype == "bfloat16":
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)
