"""speculators' index of an export: a Hugging Face ``save_to_disk`` dataset with one row per
exported sample (``input_ids`` and ``loss_mask`` as int64 lists, ``seq_len``), in torch format
(its reader compares ``input_ids`` with each file's ``token_ids`` as tensors). Row i is
``hidden_states/hs_{i}.safetensors``."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hsx.store.reader import HiddenStatesReader
from hsx.trainers.formats import ExportFile
from hsx.trainers.vocab import token_rows


def dataset_files(reader: HiddenStatesReader, positions: Sequence[int]) -> list[ExportFile]:
    """The dataset's files (arrow data, dataset_info.json, state.json), written by ``datasets``
    itself into a scratch folder and returned as bytes (the export writes them atomically)."""
    import pyarrow as pa
    from datasets import Dataset

    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for _, sample_ids, sample_mask in token_rows(reader, positions):
        ids.append(sample_ids)
        masks.append(sample_mask.astype(np.int64))
    lengths = np.asarray([len(a) for a in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    table = pa.table(
        {
            "input_ids": pa.LargeListArray.from_arrays(
                pa.array(offsets), pa.array(np.concatenate(ids) if ids else [], pa.int64())
            ).cast(pa.list_(pa.int64())),
            "loss_mask": pa.LargeListArray.from_arrays(
                pa.array(offsets), pa.array(np.concatenate(masks) if masks else [], pa.int64())
            ).cast(pa.list_(pa.int64())),
            "seq_len": pa.array(lengths, pa.int64()),
        }
    )
    dataset = Dataset(table)
    dataset.set_format(type="torch")  # persisted in state.json: its reader needs tensors
    from datasets import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # the flow logs its own progress; a tqdm bar would interleave
    try:
        with tempfile.TemporaryDirectory(prefix="hsx-export-index-") as scratch:
            dataset.save_to_disk(scratch)
            return [
                ExportFile(path.name, path.read_bytes())
                for path in sorted(Path(scratch).iterdir())
                if path.is_file()
            ]
    finally:
        if not quiet:
            enable_progress_bars()
