"""Token frequencies over the loss-masked tokens of a store's samples, and the draft vocabulary
built from them, in each trainer's own file:

- speculators: ``token_freq.pt``, a dict {token id: count} (torch.save); its trainer builds the
  draft vocabulary from it.
- SpecForge (and speculators' ``--d2t-path/--t2d-path``): ``d2t`` int64 ``[N]`` offsets (target
  id = draft id + d2t[draft id]) and ``t2d`` bool ``[vocab]`` (True for the N chosen ids), the
  N most frequent ids in ascending order; ties broken by the smaller id (speculators' rule).

Counted from the store's ``input_ids`` and ``loss_mask`` only (no hidden state is read): seconds
for millions of tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from hsx.errors import ConfigError
from hsx.model.config import read_config, text_config
from hsx.store.reader import HiddenStatesReader
from hsx.trainers.formats import ExportFile, torch_bytes

_ROWS_PER_READ = 1 << 22  # ids and masks of consecutive samples read together, up to 4M rows


def token_rows(
    reader: HiddenStatesReader, samples: Sequence[int]
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(sample, input_ids [n] int64, loss_mask [n] uint8) of each sample in order; consecutive
    samples are read together (one read of their rows, not one per sample)."""
    starts, lengths = reader.store.sample_rows(0, reader.num_samples)
    run: list[int] = []

    def flush() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        first, last = run[0], run[-1]
        begin, end = int(starts[first]), int(starts[last] + lengths[last])
        ids = reader.store.read_rows("input_ids", begin, end)
        mask = reader.store.read_rows("loss_mask", begin, end)
        for sample in run:
            lo = int(starts[sample]) - begin
            hi = lo + int(lengths[sample])
            yield sample, ids[lo:hi].astype(np.int64), mask[lo:hi].astype(np.uint8)

    for sample in samples:
        if run and (
            sample != run[-1] + 1
            or int(starts[sample] + lengths[sample] - starts[run[0]]) > _ROWS_PER_READ
        ):
            yield from flush()
            run = []
        run.append(sample)
    if run:
        yield from flush()


def token_counts(reader: HiddenStatesReader, samples: Sequence[int], vocab_size: int) -> np.ndarray:
    """[vocab_size] int64: how often each id appears where the loss mask is set."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sample, ids, mask in token_rows(reader, samples):
        chosen = ids[mask.astype(bool)]
        if chosen.size and int(chosen.max()) >= vocab_size:
            raise ConfigError(
                f"sample {sample}: expected token ids below the vocabulary size {vocab_size}, "
                f"found {int(chosen.max())}"
            )
        counts += np.bincount(chosen, minlength=vocab_size)
    return counts


def store_vocab_size(reader: HiddenStatesReader) -> int:
    """The model's vocabulary size as the store recorded it (its config), else the largest
    stored id + 1."""
    folder = Path(str(reader.store.meta["model"]["path"]))
    if (folder / "config.json").is_file():
        size = text_config(read_config(folder)).get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    largest = 0
    for _, ids, _ in token_rows(reader, reader.available_samples.tolist()):
        if ids.size:
            largest = max(largest, int(ids.max()))
    return largest + 1


def draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [vocab]) of the N most frequent ids (ties: the smaller id);
    with fewer than N ids seen, the smallest unseen ids fill the rest."""
    vocab = int(counts.shape[0])
    if not 0 < draft_vocab_size <= vocab:
        raise ConfigError(
            f"--draft-vocab-size: expected 1..{vocab} (the target vocabulary), found "
            f"{draft_vocab_size}"
        )
    order = np.lexsort((np.arange(vocab), -counts))  # by count descending, then id ascending
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.size < draft_vocab_size:
        unseen = np.setdiff1d(np.arange(vocab), seen, assume_unique=True)
        seen = np.concatenate([seen, unseen[: draft_vocab_size - seen.size]])
    chosen = np.sort(seen).astype(np.int64)
    d2t = torch.from_numpy(chosen - np.arange(draft_vocab_size, dtype=np.int64))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    return d2t, t2d


def token_freq_file(reader: HiddenStatesReader, samples: Sequence[int]) -> ExportFile:
    """speculators' ``token_freq.pt``: {token id: count} of the loss-masked tokens."""
    counts = token_counts(reader, samples, store_vocab_size(reader))
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    return ExportFile("token_freq.pt", torch_bytes(freq))  # type: ignore[arg-type]


def vocab_mapping_file(d2t: torch.Tensor, t2d: torch.Tensor) -> ExportFile:
    """SpecForge's ``vocab_mapping.pt``: {"d2t": int64 [N], "t2d": bool [vocab]}."""
    return ExportFile("vocab_mapping.pt", torch_bytes({"d2t": d2t, "t2d": t2d}))
