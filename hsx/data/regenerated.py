"""The layout of a regenerated dataset (`hsx regenerate --out OUT`), and how it is read as a
dataset: only when every chunk is committed, its parts in chunk order.

    OUT/hsx-regeneration.json     what was regenerated, how (frozen inputs), how many chunks
    OUT/data/part-NNNNNN.jsonl    one chunk's rows: id, messages, input_ids, loss_mask, hsx_turns
    OUT/commits/part-NNNNNN.json  the chunk's commit record (created once, written last)
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
    return [f"{folder}/{DATA_DIR}/{part_name(i)}.jsonl" for i in range(chunks)]
