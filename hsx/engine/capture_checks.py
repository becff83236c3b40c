"""Captured states are checked before their chunk commits: non-finite values, all-zero state
vectors or layers, a row count other than planned, token ids other than planned.

The anchors' worst bugs passed silently: all-zero states on hybrid models (vLLM PR #46301),
states leaked between requests, NaNs that let training "keep going" (speculators#615). A real
hidden-state vector is never exactly zero, and never holds a NaN or an infinity.

The scan reads the stored bits (bf16 as uint16, fp32 as uint32): clearing the sign bit gives a
magnitude whose maximum over H says both things at once, per (token, layer): 0 means an all-zero
vector, and at least the exponent-all-ones pattern means an inf or NaN somewhere in it. It runs on
blocks that the writer has just copied (still in the CPU cache), so it costs no extra memory pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from hsx.errors import TransientError

# What a chunk does with a sample whose states fail a check.
BadStatesPolicy = Literal["fail", "skip", "off"]

# A layer with more than this share of its values exactly zero fails its sample: hybrid models
# whose cache sizes were wrong gave 70%+ zeros (vLLM PR #51328) in vectors that were not all
# zero; a real residual stream holds (almost) no exact zero.
MOSTLY_ZERO_FRACTION = 0.5
# A block's zeros are attributed to its layers from this share of one layer's values.
_COUNT_LAYERS_FROM = 0.25

# (magnitude mask, smallest non-finite magnitude) by stored dtype
_BITS: dict[np.dtype[np.generic], tuple[np.dtype[np.generic], int, int]] = {
    np.dtype(np.uint16): (np.dtype(np.uint16), 0x7FFF, 0x7F80),  # bfloat16 bits
    np.dtype(np.float32): (np.dtype(np.uint32), 0x7FFFFFFF, 0x7F800000),
}


class CapturedDataError(TransientError):
    """A sample's captured states failed a check. Retried (a leak between requests or a device
    fault may not repeat); with ``capture.on_bad_states=skip`` the sample is recorded as skipped
    instead and the chunk commits."""

    def __init__(self, message: str, sample: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample

    def __reduce__(self) -> tuple[type[CapturedDataError], tuple[str, int | None]]:
        return (type(self), (str(self), self.sample))


class _Scratch(threading.local):
    """One magnitude buffer per writer thread: a fresh allocation per block page-faults."""

    def __init__(self) -> None:
        self.buffers: dict[np.dtype[np.generic], np.ndarray] = {}

    def get(self, dtype: np.dtype[np.generic], size: int) -> np.ndarray:
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.size < size:
            buffer = np.empty(size, dtype=dtype)
            self.buffers[dtype] = buffer
        return buffer[:size]


_SCRATCH = _Scratch()


@dataclass
class SampleScan:
    """Problems of one sample's states, accumulated block by block."""

    layer_ids: tuple[int, ...]
    tokens: int
    nonfinite: int = 0
    first_nonfinite: tuple[int, int] | None = None
    zero: int = 0
    first_zero: tuple[int, int] | None = None
    layer_nonzero: np.ndarray = field(init=False)
    # Per layer: values exactly zero, and values scanned (fp8 scales carry no element counts).
    layer_zero_values: np.ndarray = field(init=False)
    layer_values: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.layer_nonzero = np.zeros(len(self.layer_ids), dtype=bool)
        self.layer_zero_values = np.zeros(len(self.layer_ids), dtype=np.int64)
        self.layer_values = np.zeros(len(self.layer_ids), dtype=np.int64)

    def add(self, block: np.ndarray, token_offset: int) -> None:
        """Scan rows ``[token_offset, token_offset + n)`` of the sample; ``block`` is
        ``[n, K, H]`` in the store's physical dtype, or an fp8 store's scales ``[n, K]``
        float32 (each vector's max magnitude / 448: non-finite or zero exactly where the
        vector was)."""
        if block.ndim == 2 and block.dtype == np.float32:
            self._record(~np.isfinite(block), block != 0, token_offset)
            return
        if block.dtype not in _BITS:
            raise TypeError(f"states check: expected uint16 (bf16) or float32, found {block.dtype}")
        bits_dtype, mask, nonfinite_from = _BITS[block.dtype]
        bits = block.view(bits_dtype)
        magnitude = _SCRATCH.get(bits_dtype, bits.size).reshape(bits.shape)
        np.bitwise_and(bits, mask, out=magnitude)
        largest = magnitude.max(axis=-1)  # [n, K]
        # Exact zeros per layer (+0 and -0 alike: the sign bit is cleared). count_nonzero over
        # the whole block is numpy's fast path (~0.3 of the scan; with an axis it cost more than
        # the scan itself): layers are counted one by one only in a block holding zeros for a
        # quarter of one layer's values. A block below counts as none, so a layer past 75%
        # zeros is always caught, one past 50% where its zeros are spread over the sample.
        per_layer = magnitude.shape[0] * magnitude.shape[2]
        zeros = magnitude.size - np.count_nonzero(magnitude)
        if zeros > _COUNT_LAYERS_FROM * per_layer:
            for k in range(magnitude.shape[1]):
                self.layer_zero_values[k] += per_layer - np.count_nonzero(magnitude[:, k, :])
        self.layer_values += per_layer
        self._record(largest >= nonfinite_from, largest != 0, token_offset)

    def _record(self, bad: np.ndarray, nonzero: np.ndarray, token_offset: int) -> None:
        """Count ``bad`` (non-finite) and zero (token, layer) positions, both ``[n, K]``."""
        if bad.any():
            self.nonfinite += int(bad.sum())
            if self.first_nonfinite is None:
                token, layer = np.argwhere(bad)[0]
                self.first_nonfinite = (token_offset + int(token), int(layer))
        self.layer_nonzero |= nonzero.any(axis=0)
        if not nonzero.all():
            self.zero += int((~nonzero).sum())
            if self.first_zero is None:
                token, layer = np.argwhere(~nonzero)[0]
                self.first_zero = (token_offset + int(token), int(layer))

    def problem(self) -> str | None:
        """What is wrong with the sample's states, or None."""
        problems = []
        positions = self.tokens * len(self.layer_ids)
        if self.first_nonfinite is not None:
            token, layer = self.first_nonfinite
            problems.append(
                f"non-finite values (inf/NaN) at {self.nonfinite} of {positions} (token, layer) "
                f"positions, first at token {token}, layer id {self.layer_ids[layer]}"
            )
        dead = [self.layer_ids[k] for k in np.flatnonzero(~self.layer_nonzero)]
        share = self.layer_zero_values / np.maximum(self.layer_values, 1)
        mostly = [
            f"layer id {self.layer_ids[k]} {share[k]:.0%}"
            for k in np.flatnonzero(share > MOSTLY_ZERO_FRACTION)
            if self.layer_ids[k] not in dead
        ]
        if dead:
            problems.append(f"all-zero states at every token of layer id(s) {dead}")
        if mostly:
            problems.append(
                f"mostly zero states: expected at most {MOSTLY_ZERO_FRACTION:.0%} of a layer's "
                f"values exactly zero, found {', '.join(mostly)}"
            )
        if not dead and self.first_zero is not None:
            token, layer = self.first_zero
            problems.append(
                f"all-zero state vectors at {self.zero} of {positions} (token, layer) positions, "
                f"first at token {token}, layer id {self.layer_ids[layer]}"
            )
        return "; ".join(problems) or None


def check_token_ids(key: str, planned: list[int], seen: list[int] | None) -> str | None:
    """The prompt the engine ran against the planned token ids (a template or BOS added by the
    engine would shift every state against the stored ids)."""
    if seen is None or list(seen) == planned:
        return None
    first = next(
        (i for i, (a, b) in enumerate(zip(planned, seen, strict=False)) if a != b),
        min(len(planned), len(seen)),
    )
    return (
        f"request {key}: expected the engine to run the {len(planned)} planned token ids, "
        f"found {len(seen)} ids differing from position {first}"
    )
