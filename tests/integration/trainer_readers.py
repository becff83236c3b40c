"""Loads an hsx export with a trainer's OWN reader code and compares every tensor with hsx's
reader. Run in a child process whose path holds the trainers' packages (installed --no-deps by
scripts/bootstrap.sh into .venv/trainers):

    python -m tests.integration.trainer_readers FORMAT EXPORT_DIR STORE_URL
    python -m tests.integration.trainer_readers vocab VOCAB_DIR DRAFT_VOCAB_SIZE

Prints one JSON line: what was compared and every difference found (empty when all equal)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from hsx.store.reader import HiddenStatesReader


def _equal(name: str, found: torch.Tensor, expected: torch.Tensor, problems: list[str]) -> None:
    if tuple(found.shape) != tuple(expected.shape):
        problems.append(
            f"{name}: expected shape {tuple(expected.shape)}, found {tuple(found.shape)}"
        )
    elif not torch.equal(found.to(expected.dtype), expected):
        problems.append(
            f"{name}: values differ (max {float((found.float() - expected.float()).abs().max())})"
        )


def _same_items(
    name: str, ours: dict[str, Any], theirs: dict[str, Any], problems: list[str]
) -> None:
    """hsx's dataset item against the trainer's reader's item: the same keys, equal tensors."""
    if set(ours) != set(theirs):
        problems.append(f"{name}: expected keys {sorted(theirs)}, found {sorted(ours)}")
        return
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            if ours[key].dtype != value.dtype:
                problems.append(f"{name} {key}: expected {value.dtype}, found {ours[key].dtype}")
            _equal(f"{name} {key}", ours[key], value, problems)
        elif ours[key] != value:
            problems.append(f"{name} {key}: expected {value!r}, found {ours[key]!r}")


def check_speculators(
    out: Path, reader: HiddenStatesReader, positions: list[int]
) -> dict[str, Any]:
    from speculators.train.data import ArrowDataset, CollateFn

    dtype = torch.bfloat16 if reader.logical_dtype == "bfloat16" else torch.float32
    dataset = ArrowDataset(
        max_len=8192, datapath=str(out), on_missing="raise", hidden_states_dtype=dtype
    )
    problems: list[str] = []
    if len(dataset) != len(positions):
        problems.append(f"rows: expected {len(positions)}, found {len(dataset)}")
    items = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token_ids mismatch is only a warning there
        for position, index in enumerate(positions):
            item = dataset[position]
            sample = reader.sample(index)
            if not isinstance(item, dict):
                problems.append(f"row {position}: unavailable ({item})")
                continue
            _equal(f"row {position} input_ids", item["input_ids"], sample.input_ids, problems)
            _equal(
                f"row {position} loss_mask", item["loss_mask"].bool(), sample.loss_mask, problems
            )
            _equal(
                f"row {position} hidden_states",
                item["hidden_states"],
                sample.aux_hidden_states,
                problems,
            )
            _equal(
                f"row {position} verifier_last_hidden_states",
                item["verifier_last_hidden_states"],
                sample.target_hidden_states,
                problems,
            )
            items.append(item)
    from hsx.trainers.datasets import SpeculatorsDataset

    ours = SpeculatorsDataset(reader.store.url, positions)
    for position, item in enumerate(items):
        _same_items(f"hsx dataset row {position}", ours[position], item, problems)
    hidden = reader.hidden_size
    batch = CollateFn(
        max_len=8192, hidden_size=hidden, num_target_layers=len(reader.layer_ids) - 1
    )(items[:4])
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    return {
        "compared": len(items),
        "problems": problems,
        "batch": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
        "token_freq_total": int(sum(freq.values())),
    }


def check_specforge(out: Path, reader: HiddenStatesReader, positions: list[int]) -> dict[str, Any]:
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import (
        OfflineManifestReader,
        list_feature_files,
    )
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    from hsx.trainers.datasets import SpecForgeDataset
    from hsx.trainers.final_norm import load_final_norm

    norm = load_final_norm(Path(reader.store.meta["model"]["path"]))
    specforge_dataset = SpecForgeDataset(reader.store.url, norm, max_len=8192, samples=positions)
    files = list_feature_files(str(out))
    refs = OfflineManifestReader(str(out), validate_files=True).read()
    problems: list[str] = []
    if len(files) != len(positions) or len(refs) != len(positions):
        problems.append(f"files: expected {len(positions)}, found {len(files)} ({len(refs)} refs)")
    targets = {}
    for position, (path, index) in enumerate(zip(files, positions, strict=False)):
        sample = reader.sample(index)
        raw = load_feature_file(path)
        item = normalize_offline_sample(raw, max_len=8192)
        _equal(f"file {position} input_ids", item["input_ids"][0], sample.input_ids, problems)
        mask = sample.loss_mask.to(torch.int64).clone()
        mask[-1] = 0  # its normalization clears the last position
        _equal(f"file {position} loss_mask", item["loss_mask"][0], mask, problems)
        _equal(
            f"file {position} hidden_state (aux)",
            item["hidden_state"][0],
            sample.aux_hidden_states,
            problems,
        )
        targets[index] = item["target"][0]
        ours = specforge_dataset[position]
        _same_items(f"hsx dataset file {position}", ours, item, problems)
    counts = count_effective_feature_tokens(str(out), max_length=8192)
    torch.save(targets, out.parent / f"{out.name}-targets.pt")  # post-norm, for the HF check
    return {
        "compared": len(targets),
        "problems": problems,
        "token_counts": {str(k): int(v) for k, v in counts.items()},
    }


def check_modelopt(out: Path, reader: HiddenStatesReader, positions: list[int]) -> dict[str, Any]:
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )

    files = sorted(str(p) for p in out.rglob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    problems: list[str] = []
    if len(dataset) != len(positions):
        problems.append(f"files: expected {len(positions)}, found {len(dataset)}")
    items = []
    for position, index in enumerate(positions):
        item = dataset[position]
        sample = reader.sample(index)
        _equal(f"file {position} input_ids", item["input_ids"], sample.input_ids, problems)
        _equal(f"file {position} loss_mask", item["loss_mask"].bool(), sample.loss_mask, problems)
        _equal(
            f"file {position} base_model_hidden_states",
            item["base_model_hidden_states"],
            sample.target_hidden_states,
            problems,
        )
        _equal(
            f"file {position} aux_hidden_states",
            item["aux_hidden_states"],
            sample.aux_hidden_states,
            problems,
        )
        if item["base_hidden_prenorm"] is not True:
            problems.append(
                f"file {position}: expected base_hidden_prenorm True, found {item['base_hidden_prenorm']}"
            )
        items.append(item)
    from hsx.trainers.datasets import ModelOptDataset

    ours = ModelOptDataset(reader.store.url, positions)
    for position, item in enumerate(items):
        _same_items(f"hsx dataset file {position}", ours[position], item, problems)
    batch = EagleOfflineDataCollator(train_len=64)(items[:4])
    return {
        "compared": len(items),
        "problems": problems,
        "batch": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
    }


def check_vocab(folder: Path, draft_vocab_size: int) -> dict[str, Any]:
    """hsx vocab's files as both trainers take them: speculators builds the same d2t/t2d from
    token_freq.pt; SpecForge accepts vocab_mapping.pt (its own consistency check)."""
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    mapping = torch.load(folder / "vocab_mapping.pt")
    validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])
    freq = torch.load(folder / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(
        freq, draft_vocab_size, mapping["t2d"].numel()
    )
    problems: list[str] = []
    _equal("d2t", mapping["d2t"], d2t, problems)
    _equal("t2d", mapping["t2d"], t2d, problems)
    return {"problems": problems, "counted": int(sum(freq.values()))}


def main() -> None:
    if sys.argv[1] == "vocab":
        print("RESULT " + json.dumps(check_vocab(Path(sys.argv[2]), int(sys.argv[3]))))
        return
    format_name, out, store = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    manifest = json.loads((out / "hsx-export.json").read_text())
    reader = HiddenStatesReader(store)
    check = {
        "speculators": check_speculators,
        "specforge": check_specforge,
        "modelopt": check_modelopt,
    }
    result = check[format_name](out, reader, list(manifest["sample_of_position"]))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
