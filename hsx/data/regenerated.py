"""The layout of a regenerated dataset (`hsx regenerate --out OUT`), and how it is read as a
dataset: only when every chunk is committed, its parts in chunk order.

    OUT/hsx-regeneration.json     what was regenerated, how (frozen inputs), how many chunks
    OUT/data/part-NNNNNN.ID.jsonl one chunk's rows: id, messages, input_ids, loss_mask, hsx_turns
                                  (ID: the attempt that wrote it; an output of an older hsx has
                                  part-NNNNNN.jsonl)
    OUT/commits/part-NNNNNN.json  the chunk's commit record (created once, written last), naming
                                  its part file ("part")

Each attempt writes its own part file and only the one whose commit record is created counts:
an attempt that loses the commit race never touches the winner's bytes.
"""

from __future__ import annotations

import json
from typing import Any

from hsx.errors import DatasetError

MANIFEST = "hsx-regeneration.json"
DATA_DIR = "data"
COMMITS_DIR = "commits"
FORMAT_NAME = "hsx-regeneration"


def part_name(index: int) -> str:
    return f"part-{index:06d}"


def part_file(index: int, record: dict[str, Any]) -> str:
    """The data file a commit record stands for (records of older outputs name none)."""
    return str(record.get("part") or f"{part_name(index)}.jsonl")


def read_commit(fs: Any, folder: str, index: int) -> dict[str, Any]:
    path = f"{folder}/{COMMITS_DIR}/{part_name(index)}.json"
    try:
        record = json.loads(fs.cat_file(path))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: expected a commit record (JSON): {exc!r}") from exc
    if not isinstance(record, dict):
        raise DatasetError(f"{path}: expected a JSON object, found {type(record).__name__}")
    return record


def is_regenerated(fs: Any, folder: str) -> bool:
    return bool(fs.isfile(f"{folder}/{MANIFEST}"))


def read_manifest(fs: Any, folder: str) -> dict[str, Any]:
    path = f"{folder}/{MANIFEST}"
    try:
        manifest = json.loads(fs.cat_file(path))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: expected a regeneration manifest (JSON): {exc!r}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DatasetError(f"{path}: expected format {FORMAT_NAME!r}, found {found!r}")
    return manifest


def committed_parts(fs: Any, folder: str) -> set[int]:
    """Indices of the chunks whose commit record exists."""
    listing = (
        fs.ls(f"{folder}/{COMMITS_DIR}", detail=False)
        if fs.isdir(f"{folder}/{COMMITS_DIR}")
        else []
    )
    found = set()
    for path in listing:
        name = str(path).rsplit("/", 1)[-1]
        if name.startswith("part-") and name.endswith(".json"):
            found.add(int(name[5:-5]))
    return found


def regenerated_parts(fs: Any, folder: str, name: str) -> list[str]:
    """The data files of a complete regenerated dataset, in chunk order; a DatasetError naming
    what is missing (and how to finish it) when any chunk is not committed."""
    manifest = read_manifest(fs, folder)
    chunks = int(manifest["chunks"])
    missing = sorted(set(range(chunks)) - committed_parts(fs, folder))
    if missing:
        listed = ", ".join(str(i) for i in missing[:10]) + (", ..." if len(missing) > 10 else "")
        raise DatasetError(
            f"{name}: expected a complete regenerated dataset, found {chunks - len(missing)} of "
            f"{chunks} chunks committed (missing: {listed}); finish it by running the same "
            "`hsx regenerate` again (it redoes only the missing chunks)"
        )
    return [
        f"{folder}/{DATA_DIR}/{part_file(i, read_commit(fs, folder, i))}" for i in range(chunks)
    ]
