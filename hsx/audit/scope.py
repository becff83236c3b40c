"""What an audit covers: the committed chunks of a store (within a range of samples), the rows of
each it reads states from (whole samples, or a sample's last rows, spread so that a budget of
positions reaches every chunk it can), and whether the data's trained tokens are the target's
own greedy choices (a store extracted from `hsx regenerate` greedy output).

Everything here is decided before any state is read; the refusals (no committed chunk, a range
outside the store) come from here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import fsspec

from hsx.data.regenerated import MANIFEST, read_manifest
from hsx.errors import DatasetError, StoreError
from hsx.store.reader import HiddenStatesReader

# The fewest rows a chunk's share of the budget is: alignment needs a few positions per sample.
MIN_ROWS_PER_CHUNK = 32
# Sampling parameters that leave greedy choice the head's argmax (at their neutral values).
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_IGNORED_UNDER_GREEDY = ("temperature", "top_p", "top_k", "min_p", "seed", "n")


class NothingToAuditError(StoreError):
    """No committed, usable sample in range (nothing committed yet, or every sample skipped)."""


@dataclass(frozen=True)
class Window:
    """Rows [row_start, row_end) of one sample whose states are read."""

    sample: int
    row_start: int
    row_end: int
    sample_start: int  # the sample's first row
    sample_end: int  # one past its last row


@dataclass(frozen=True)
class ChunkScope:
    """One committed work chunk: its samples in range, and the windows audited."""

    chunk: int
    row_start: int
    row_end: int
    samples: tuple[int, ...]  # usable samples of the chunk within the range
    windows: tuple[Window, ...]

    @property
    def positions(self) -> int:
        return sum(w.row_end - w.row_start for w in self.windows)


@dataclass(frozen=True)
class Greedy:
    """Whether the loss-masked tokens are the target's own argmax, and why (or why not)."""

    exact: bool
    reason: str


def parse_range(value: str | None, num_samples: int) -> tuple[int, int]:
    """``START:END`` of sample indices (either side may be empty) within the store."""
    from hsx.trainers.export import parse_samples

    start, end = parse_samples(value)
    end = num_samples if end is None else min(end, num_samples)
    if start >= end:
        raise StoreError(
            f"--samples: expected a range within the store's {num_samples} samples, found {value!r}"
        )
    return start, end


def select_chunks(
    reader: HiddenStatesReader, positions: int, samples: str | None = None
) -> list[ChunkScope]:
    """The committed chunks with usable samples in range and the rows audited in each:
    ``positions`` rows in all (0: every row), an equal share per chunk, at least
    MIN_ROWS_PER_CHUNK (with a small budget, fewer chunks, evenly spread: the others have no
    window). StoreError when nothing is committed in range."""
    if positions < 0:
        raise StoreError(f"--positions: expected 0 (every row) or more, found {positions}")
    start, end = parse_range(samples, reader.num_samples)
    usable = set(reader.available_samples.tolist())
    candidates = []
    for chunk in reader.store.work_chunks:
        chosen = tuple(
            s
            for s in range(max(chunk.sample_start, start), min(chunk.sample_end, end))
            if s in usable
        )
        if chosen:
            candidates.append((chunk, chosen))
    if not candidates:
        raise NothingToAuditError(
            f"store {reader.store.url}: expected committed samples to audit in {start}:{end}, "
            f"found none ({len(reader.store.committed_chunks())} chunks committed of "
            f"{len(reader.store.work_chunks)}, {len(reader.skipped_samples)} samples skipped at "
            "extraction): nothing to audit"
        )
    audited = list(range(len(candidates)))
    if positions and positions < len(candidates) * MIN_ROWS_PER_CHUNK:
        keep = max(1, positions // MIN_ROWS_PER_CHUNK)
        audited = sorted({int(i * len(candidates) / keep) for i in range(keep)})
    share = math.ceil(positions / len(audited)) if positions else 0
    starts, lengths = reader.store.sample_rows(0, reader.num_samples)
    scopes = []
    for n, (chunk, chosen) in enumerate(candidates):
        bounds = {s: (int(starts[s]), int(starts[s] + lengths[s])) for s in chosen}
        windows = _windows(chunk.index, chosen, bounds, share) if n in audited else ()
        scopes.append(ChunkScope(chunk.index, chunk.row_start, chunk.row_end, chosen, windows))
    return scopes


def _windows(
    chunk: int, samples: tuple[int, ...], bounds: dict[int, tuple[int, int]], share: int
) -> tuple[Window, ...]:
    """Whole samples in a fixed pseudo-random order while they fit ``share`` rows (0: all);
    when the first does not fit, its last ``share`` rows (a sample's end is where a capture
    that stopped early shows, and where assistant turns are)."""
    if not share:
        return tuple(Window(s, *bounds[s], *bounds[s]) for s in samples)
    order = list(samples)
    random.Random(chunk).shuffle(order)  # the same rows on every audit of this store
    taken: list[Window] = []
    left = share
    for sample in order:
        first, last = bounds[sample]
        if last - first <= left:
            taken.append(Window(sample, first, last, first, last))
            left -= last - first
        elif not taken:
            taken.append(Window(sample, last - left, last, first, last))
            left = 0
        if left < MIN_ROWS_PER_CHUNK // 2:
            break
    return tuple(sorted(taken, key=lambda w: w.sample))


def greedy_provenance(meta: dict[str, Any]) -> Greedy:
    """Whether the store's dataset is an `hsx regenerate` output whose turns were generated
    greedily, without penalties, by this model: then every loss-masked token is the target's
    argmax after the tokens before it, and the audit requires exact agreement there."""
    dataset = str(meta.get("dataset", ""))
    try:
        fs, root = fsspec.core.url_to_fs(dataset)
        if not fs.isfile(f"{root.rstrip('/')}/{MANIFEST}"):
            return Greedy(False, f"the dataset {dataset} is not an `hsx regenerate` output")
        manifest = read_manifest(fs, root.rstrip("/"))
    except (OSError, ValueError, ImportError, DatasetError) as exc:
        return Greedy(False, f"the dataset {dataset} could not be read: {exc!r}")
    frozen = dict(manifest.get("frozen_inputs") or {})
    sampling = {**(frozen.get("model_sampling_defaults") or {}), **(frozen.get("sampling") or {})}
    if frozen.get("model_config_hash") != meta["model"].get("config_hash"):
        return Greedy(
            False,
            f"regenerated by another model (config digest {frozen.get('model_config_hash')}, "
            f"the store's {meta['model'].get('config_hash')})",
        )
    if float(sampling.get("temperature", 1.0)) != 0.0:
        return Greedy(False, f"regenerated with sampling {sampling} (not greedy)")
    for key, value in sampling.items():
        if key in _NEUTRAL and value is not None and float(value) != _NEUTRAL[key]:
            return Greedy(False, f"regenerated greedily with {key}={value} (not the argmax)")
        if key not in _NEUTRAL and key not in _IGNORED_UNDER_GREEDY:
            return Greedy(
                False, f"regenerated greedily with {key}={value!r} (may not be the argmax)"
            )
    return Greedy(True, f"regenerated greedily by this model ({dataset}, sampling {sampling})")
