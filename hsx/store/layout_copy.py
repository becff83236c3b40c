"""A copy of a store's metadata documents (the group's and each array's ``zarr.json``), written
once its layout is complete, as ``hsx-layout.json`` in the store.

Zarr trusts these documents blindly: a flipped digit in a shape or dtype reads every chunk
wrong, a flipped brace makes the store unopenable, and no commit record covers them. Verify
compares each with its copy (before zarr opens anything); repair rewrites it from the copy. A
store written before hsx kept the copy has nothing to compare with and is reported as such.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import xxhash

from hsx.store.storage_io import exists, store_io, write_atomic

COPY_NAME = "hsx-layout.json"
METADATA_DOCUMENTS = (
    "zarr.json",
    "input_ids/zarr.json",
    "loss_mask/zarr.json",
    "hidden_states/zarr.json",
    "sample_starts/zarr.json",
    "sample_lengths/zarr.json",
)


def _digest(data: bytes) -> str:
    return str(xxhash.xxh3_128_hexdigest(data))


def _read(fs: fsspec.AbstractFileSystem, url: str, path: str) -> bytes:
    return bytes(store_io(fs, url, path, "read", lambda: fs.cat_file(path)))


def write_layout_copy(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    """Copy every metadata document as it is now (the layout just completed)."""
    documents = {name: _read(fs, url, f"{root}/{name}").decode() for name in METADATA_DOCUMENTS}
    body = json.dumps(documents, sort_keys=True)
    payload = {"documents": documents, "digest": _digest(body.encode())}
    write_atomic(fs, f"{root}/{COPY_NAME}", json.dumps(payload).encode(), durable=True, store=url)


def _copy(fs: fsspec.AbstractFileSystem, root: str, url: str) -> tuple[dict[str, str] | None, str]:
    """(documents, problem): the copy's documents, or None and why they cannot be used."""
    path = f"{root}/{COPY_NAME}"
    if not exists(fs, url, path):
        return None, ""
    raw = _read(fs, url, path)
    try:
        payload: dict[str, Any] = json.loads(raw)
        documents = {str(k): str(v) for k, v in payload["documents"].items()}
        stored = str(payload["digest"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{COPY_NAME}: expected the copy of the metadata documents, found {exc!r}"
    computed = _digest(json.dumps(documents, sort_keys=True).encode())
    if computed != stored:
        return None, (
            f"{COPY_NAME}: stored and computed checksum do not match. Stored: {stored} "
            f"Computed: {computed} (the copy itself is damaged; the documents are not checked)"
        )
    return documents, ""


def metadata_problems(fs: fsspec.AbstractFileSystem, root: str, url: str) -> list[str]:
    """Each metadata document that differs from its copy (or is missing), one line each."""
    documents, problem = _copy(fs, root, url)
    if documents is None:
        return [problem] if problem else []
    problems = []
    for name, text in documents.items():
        path = f"{root}/{name}"
        if not exists(fs, url, path):
            problems.append(f"{name}: expected the metadata document, found none")
            continue
        found = _digest(_read(fs, url, path))
        expected = _digest(text.encode())
        if found != expected:
            problems.append(
                f"{name}: stored and computed checksum do not match. Copy: {expected} "
                f"Found: {found} (`hsx verify --repair` rewrites it from {COPY_NAME})"
            )
    return problems


def repair_metadata(fs: fsspec.AbstractFileSystem, root: str, url: str) -> list[str]:
    """Rewrite every metadata document that differs from its copy; returns their names."""
    documents, _ = _copy(fs, root, url)
    if documents is None:
        return []
    repaired = []
    for name, text in documents.items():
        path = f"{root}/{name}"
        if not exists(fs, url, path) or _digest(_read(fs, url, path)) != _digest(text.encode()):
            write_atomic(fs, path, text.encode(), durable=True, store=url)
            repaired.append(name)
    return repaired


def has_layout_copy(fs: fsspec.AbstractFileSystem, root: str, url: str) -> bool:
    return bool(exists(fs, url, f"{root}/{COPY_NAME}"))


def layout_differences(documents: dict[str, dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """What the arrays' metadata documents say against what the store recorded at its creation
    (rows, samples, rows per chunk, layers, hidden size): one line per difference. A store of
    an older hsx is upgraded (its copy written) only when there is none."""
    rows, samples = int(meta["total_rows"]), int(meta["num_samples"])
    step, layers = int(meta["rows_per_chunk"]), len(meta["layer_ids"])
    hidden = int(meta["hidden_size"])
    token_step = int(meta.get("token_rows_per_object", step))  # C in stores before it
    expected = {
        "input_ids/zarr.json": ([rows], [token_step]),
        "loss_mask/zarr.json": ([rows], [token_step]),
        "hidden_states/zarr.json": ([rows, layers, hidden], [step, layers, hidden]),
        "sample_starts/zarr.json": ([samples], None),
        "sample_lengths/zarr.json": ([samples], None),
    }
    problems = []
    for name, (shape, chunks) in expected.items():
        document = documents.get(name, {})
        found_shape = document.get("shape")
        grid = document.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
        if found_shape != shape:
            problems.append(f"{name}: shape {found_shape}, the store recorded {shape}")
        if chunks is not None and grid != chunks:
            problems.append(f"{name}: chunks {grid}, the store recorded {chunks}")
    return problems


def upgrade_layout_copy(
    fs: fsspec.AbstractFileSystem, root: str, url: str, meta: dict[str, Any]
) -> list[str]:
    """For a store written before hsx kept ``hsx-layout.json``: check every metadata document
    (it parses; the arrays' shapes and chunks are the ones the store recorded) and write the
    copy. Returns the problems found instead (nothing written then)."""
    documents: dict[str, dict[str, Any]] = {}
    for name in METADATA_DOCUMENTS:
        try:
            documents[name] = json.loads(_read(fs, url, f"{root}/{name}"))
        except (FileNotFoundError, ValueError) as exc:
            return [f"{name}: expected a JSON metadata document, found {exc!r}"]
    problems = layout_differences(documents, meta)
    if not problems:
        write_layout_copy(fs, root, url)
    return problems
