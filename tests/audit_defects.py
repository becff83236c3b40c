"""Defects planted into a copy of a real store (made by the real engine), the way the anchors'
bugs wrote them: the arrays are changed through zarr, and the chunk's commit record is given the
new objects' checksums, so that `hsx verify` still passes: only the audit can see them."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from hsx.store.checksums import digest
from hsx.store.fp8_states import SCALES_ARRAY
from hsx.store.zarr_store import COMMITS_DIR, ExtractionStore


@dataclass(frozen=True)
class Planted:
    """Where a defect went."""

    chunk: int
    samples: tuple[int, ...]


def copy_store(source: str, target: Path) -> str:
    shutil.copytree(source, target)
    return str(target)


def _chunk_with_samples(store: ExtractionStore, wanted: int = 2) -> tuple[int, list[int]]:
    """A committed chunk with at least ``wanted`` samples (the second such, when there is one:
    not the store's first rows), and its samples."""
    chunks = [c for c in store.work_chunks if c.sample_end - c.sample_start >= wanted]
    chunk = chunks[1] if len(chunks) > 1 else chunks[0]
    return chunk.index, list(range(chunk.sample_start, chunk.sample_end))


def _bounds(store: ExtractionStore, sample: int) -> tuple[int, int]:
    starts, lengths = store.sample_rows(sample, sample + 1)
    return int(starts[0]), int(starts[0] + lengths[0])


def _states(url: str) -> zarr.Array:
    node = zarr.open_group(url, mode="r+")["hidden_states"]
    assert isinstance(node, zarr.Array) and node.dtype == np.float32, "plant into fp32 stores"
    return node


def _scales(url: str) -> zarr.Array | None:
    """An fp8 store's scales ``[T, K]`` (a vector reads as its fp8 bits times its scale)."""
    group = zarr.open_group(url, mode="r+")
    node = group.get(SCALES_ARRAY, None)
    assert node is None or isinstance(node, zarr.Array)
    return node


def _recommit(url: str, chunk: int) -> None:
    """The chunk's commit record with the checksums of its objects as they are now."""
    store = ExtractionStore.open(url)
    work = store.work_chunks[chunk]
    step = store.rows_per_chunk
    path = Path(url, COMMITS_DIR, f"chunk-{chunk:06d}.json")
    record = json.loads(path.read_text())
    for name in store.state_arrays:
        record["checksums"][name] = [
            digest(store.read_rows(name, row, row + step))
            for row in range(work.row_start, work.row_end, step)
        ]
    path.write_text(json.dumps(record, indent=1, sort_keys=True))


def shift_states(url: str) -> Planted:
    """Every sample of one chunk: the state at row t is the one of row t-1 (a capture one
    position late; each sample's first row keeps its own)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    states = _states(url)
    for sample in samples:
        first, end = _bounds(store, sample)
        rows = np.asarray(states[first:end])
        rows[1:] = rows[:-1].copy()
        states[first:end] = rows
    _recommit(url, chunk)
    return Planted(chunk, tuple(samples))


def zero_layer(url: str, slot: int = 1) -> Planted:
    """One captured layer all zeros over one chunk (fp8 stores: its scales)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    work = store.work_chunks[chunk]
    scales = _scales(url)
    target = _states(url) if scales is None else scales
    rows = np.asarray(target[work.row_start : work.row_end])
    rows[:, slot] = 0
    target[work.row_start : work.row_end] = rows
    _recommit(url, chunk)
    return Planted(chunk, tuple(samples))


def swap_samples(url: str) -> Planted:
    """Two samples of one chunk hold each other's states over the shorter one's length, at
    their ends (where the assistant turns are)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    a, b = samples[0], samples[1]
    (_, a1), (_, b1) = _bounds(store, a), _bounds(store, b)
    n = min(a1 - _bounds(store, a)[0], b1 - _bounds(store, b)[0])
    states = _states(url)
    first, second = np.asarray(states[a1 - n : a1]), np.asarray(states[b1 - n : b1])
    states[a1 - n : a1] = second
    states[b1 - n : b1] = first
    _recommit(url, chunk)
    return Planted(chunk, (a, b))


def nan_vector(url: str, slot: int = 0, position: int = 3) -> Planted:
    """One NaN vector: one layer at one position of one sample (fp8 stores: its scale)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    first, _ = _bounds(store, samples[-1])
    scales = _scales(url)
    target = _states(url) if scales is None else scales
    row = np.asarray(target[first + position : first + position + 1])
    row[0, slot] = np.nan
    target[first + position : first + position + 1] = row
    _recommit(url, chunk)
    return Planted(chunk, (samples[-1],))


def apply_final_norm(url: str, weight: np.ndarray, eps: float) -> Planted:
    """One chunk's final captured layer stored after the model's final norm (RMSNorm)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    work = store.work_chunks[chunk]
    states = _states(url)
    rows = np.asarray(states[work.row_start : work.row_end])
    final = rows[:, -1].astype(np.float64)
    scale = 1.0 / np.sqrt((final**2).mean(axis=-1, keepdims=True) + eps)
    rows[:, -1] = (final * scale * weight).astype(np.float32)
    states[work.row_start : work.row_end] = rows
    _recommit(url, chunk)
    return Planted(chunk, tuple(samples))


def reverse_layers(url: str) -> Planted:
    """One chunk's captured layers stored in reverse order."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    work = store.work_chunks[chunk]
    states = _states(url)
    states[work.row_start : work.row_end] = np.asarray(states[work.row_start : work.row_end])[
        :, ::-1
    ].copy()
    _recommit(url, chunk)
    return Planted(chunk, tuple(samples))


def cut_rows(url: str, missing: int = 5) -> Planted:
    """One sample's states end ``missing`` rows before its tokens (zeros there, in every layer:
    what a capture shorter than its prompt leaves)."""
    store = ExtractionStore.open(url)
    chunk, samples = _chunk_with_samples(store)
    _, end = _bounds(store, samples[0])
    states = _states(url)
    states[end - missing : end] = 0
    _recommit(url, chunk)
    return Planted(chunk, (samples[0],))
