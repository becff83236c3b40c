"""The Zarr v3 store of one extraction, through fsspec (local paths, file://, memory://, s3://...).

Layout (DESIGN.md §4):
    attrs           hsx metadata: schema, plan inputs + hash, model, layers, dtype, code version
    input_ids       int32  [T]        chunks (C,)
    loss_mask       uint8  [T]        chunks (C,)
    hidden_states   f32|u16 [T, K, H] chunks (C, K, H); bf16 stored as uint16 + logical_dtype
    sample_starts   int64  [N]        row of sample i's first token
    sample_lengths  int32  [N]        rows of sample i (rows between samples are padding)
    commits/chunk-NNNNNN.json         written last, atomically: a chunk without one does not exist
    runs/RUN_ID.json                  one record per run that wrote to the store

Readers, resume and verify trust commit records only: a missing Zarr chunk reads back silently
as fill values, so readability proves nothing.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem

from hsx.errors import StoreError
from hsx.plan import Plan, WorkChunk

SCHEMA_VERSION = 1
HSX_ATTR = "hsx"
COMMITS_DIR = "commits"
RUNS_DIR = "runs"
ROW_ARRAYS = ("input_ids", "loss_mask", "hidden_states")


@dataclass
class CommitRecord:
    """What one work chunk wrote: the audit truth of the store (Prefect's history is not)."""

    chunk_index: int
    row_start: int
    row_end: int
    sample_start: int
    sample_end: int
    tokens: int
    checksums: dict[str, str]  # array name -> digest of its bytes over [row_start, row_end)
    checksum_algorithm: str
    plan_hash: str
    run_id: str
    attempt: int
    code_version: str
    host: str
    pid: int
    started_at: str
    finished_at: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def _fs_and_root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:
        known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) < 12)[:20])
        raise StoreError(
            f"store URL {url!r}: expected a local path or a known fsspec scheme "
            f"(file, memory, s3, gs, ...; available here: {known}), found: {exc}"
        ) from exc
    return fs, root.rstrip("/")


def check_store_url(url: str) -> None:
    """Raise StoreError for a URL whose scheme fsspec does not know (before anything is written)."""
    _fs_and_root(url)


def _write_atomic(fs: fsspec.AbstractFileSystem, path: str, payload: bytes) -> None:
    """Temp name then rename on local disks; object stores make a single PUT atomic anyway."""
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(temp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
    else:
        fs.pipe_file(path, payload)


class ExtractionStore:
    """One extraction's Zarr group plus its commit and run records."""

    def __init__(self, url: str, group: zarr.Group) -> None:
        self.url = url
        self.group = group
        self.fs, self.root = _fs_and_root(url)

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str, mode: str = "r") -> ExtractionStore:
        fs, root = _fs_and_root(url)
        if not fs.exists(f"{root}/zarr.json"):
            raise StoreError(f"store {url}: expected a Zarr group (zarr.json), found nothing")
        group = zarr.open_group(url, mode=mode)  # type: ignore[arg-type]
        store = cls(url, group)
        if HSX_ATTR not in group.attrs or not store.meta.get("layout_complete"):
            raise StoreError(
                f"store {url}: expected hsx metadata with layout_complete=true, found "
                f"{sorted(group.attrs.keys())} (creation was interrupted: re-run extract)"
            )
        return store

    @classmethod
    def open_or_create(cls, url: str, plan: Plan, meta: dict[str, Any]) -> ExtractionStore:
        """Open the store for ``plan``, creating it at final size if it does not exist yet.

        An existing store with another plan is refused with the differences: the plan never
        changes under a resumed run."""
        fs, root = _fs_and_root(url)
        if fs.exists(f"{root}/zarr.json"):
            group = zarr.open_group(url, mode="r+")  # type: ignore[arg-type]
            existing: dict[str, Any] = dict(cast(dict[str, Any], group.attrs.get(HSX_ATTR, {})))
            if existing.get("layout_complete"):
                if existing.get("plan_hash") != plan.plan_hash:
                    raise StoreError(
                        f"store {url} was planned with other inputs; refusing to mix them. "
                        + describe_plan_diff(existing.get("plan_inputs", {}), plan.inputs)
                        + " Use a new store URL, or delete this one to start over."
                    )
                return cls(url, group)
            if fs.exists(f"{root}/{COMMITS_DIR}"):
                raise StoreError(
                    f"store {url}: layout incomplete but commit records exist; refusing to "
                    "recreate it. Inspect or delete the store."
                )
        return cls._create(url, plan, meta)

    @classmethod
    def _create(cls, url: str, plan: Plan, meta: dict[str, Any]) -> ExtractionStore:
        group = zarr.open_group(url, mode="w")  # type: ignore[arg-type]
        rows, c = plan.total_rows, plan.rows_per_chunk
        k, h = int(meta["num_layers_captured"]), int(meta["hidden_size"])
        stored_dtype = "uint16" if meta["logical_dtype"] == "bfloat16" else meta["logical_dtype"]
        compressors: Any = None
        if meta.get("compressor") == "zstd":
            from zarr.codecs import ZstdCodec

            compressors = [ZstdCodec(level=1)]
        group.create_array(
            "input_ids", shape=(rows,), chunks=(c,), dtype="int32", compressors=None, fill_value=0
        )
        group.create_array(
            "loss_mask", shape=(rows,), chunks=(c,), dtype="uint8", compressors=None, fill_value=0
        )
        hidden = group.create_array(
            "hidden_states",
            shape=(rows, k, h),
            chunks=(c, k, h),
            dtype=stored_dtype,
            compressors=compressors,
            fill_value=0,
            dimension_names=("token", "layer", "hidden"),
        )
        hidden.attrs["logical_dtype"] = meta["logical_dtype"]
        hidden.attrs["layer_ids"] = list(meta["layer_ids"])
        n = max(plan.num_samples, 1)
        group.create_array(
            "sample_starts", shape=(plan.num_samples,), chunks=(n,), dtype="int64", compressors=None
        )
        group.create_array(
            "sample_lengths",
            shape=(plan.num_samples,),
            chunks=(n,),
            dtype="int32",
            compressors=None,
        )
        if plan.num_samples:
            cast(zarr.Array, group["sample_starts"])[:] = plan.sample_starts
            cast(zarr.Array, group["sample_lengths"])[:] = plan.sample_lengths
        attrs = {
            **meta,
            "schema_version": SCHEMA_VERSION,
            "plan_hash": plan.plan_hash,
            "plan_inputs": plan.inputs,
            "num_samples": plan.num_samples,
            "total_rows": plan.total_rows,
            "total_tokens": plan.total_tokens,
            "rows_per_chunk": c,
            "work_chunks": [asdict(chunk) for chunk in plan.chunks],
            "layout_complete": True,  # written last: an interrupted creation is recreated
        }
        group.attrs[HSX_ATTR] = attrs
        return cls(url, group)

    # ---- metadata ---------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        return dict(cast(dict[str, Any], self.group.attrs.get(HSX_ATTR, {})))

    @property
    def work_chunks(self) -> list[WorkChunk]:
        return [WorkChunk(**chunk) for chunk in self.meta["work_chunks"]]

    @property
    def logical_dtype(self) -> str:
        return str(self.meta["logical_dtype"])

    def array(self, name: str) -> zarr.Array:
        node = self.group[name]
        if not isinstance(node, zarr.Array):
            raise StoreError(
                f"store {self.url}: expected array {name!r}, found {type(node).__name__}"
            )
        return node

    # ---- rows -------------------------------------------------------------------------------
    def write_rows(self, row_start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write whole Zarr chunks starting at ``row_start`` (a multiple of C)."""
        c = int(self.meta["rows_per_chunk"])
        for name, rows in arrays.items():
            count = rows.shape[0]
            if row_start % c or (count % c and row_start + count != self.array(name).shape[0]):
                raise StoreError(
                    f"{name}: expected a write aligned to Zarr chunks of {c} rows, found rows "
                    f"[{row_start}, {row_start + count})"
                )
            self.array(name)[row_start : row_start + count] = rows

    def read_rows(self, name: str, row_start: int, row_end: int) -> np.ndarray:
        return np.asarray(self.array(name)[row_start:row_end])

    # ---- commits and runs -------------------------------------------------------------------
    def _commit_path(self, index: int) -> str:
        return f"{self.root}/{COMMITS_DIR}/chunk-{index:06d}.json"

    def write_commit(self, record: CommitRecord) -> None:
        payload = json.dumps(asdict(record), indent=1, sort_keys=True).encode()
        _write_atomic(self.fs, self._commit_path(record.chunk_index), payload)

    def read_commit(self, index: int) -> CommitRecord | None:
        path = self._commit_path(index)
        if not self.fs.exists(path):
            return None
        return CommitRecord(**json.loads(self.fs.cat_file(path)))

    def remove_commit(self, index: int) -> None:
        path = self._commit_path(index)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def committed_chunks(self) -> dict[int, CommitRecord]:
        """All commit records, by chunk index (records of another plan are refused)."""
        directory = f"{self.root}/{COMMITS_DIR}"
        if not self.fs.exists(directory):
            return {}
        records: dict[int, CommitRecord] = {}
        for path in sorted(self.fs.ls(directory, detail=False)):
            name = str(path).rsplit("/", 1)[-1]
            if not (name.startswith("chunk-") and name.endswith(".json")):
                continue  # temp files of an interrupted commit
            record = CommitRecord(**json.loads(self.fs.cat_file(path)))
            if record.plan_hash != self.meta["plan_hash"]:
                raise StoreError(
                    f"{path}: expected plan {self.meta['plan_hash']}, found {record.plan_hash}"
                )
            records[record.chunk_index] = record
        return records

    def pending_chunks(self) -> list[WorkChunk]:
        done = self.committed_chunks()
        return [chunk for chunk in self.work_chunks if chunk.index not in done]

    def write_run_record(self, run_id: str, record: dict[str, Any]) -> None:
        payload = json.dumps(record, indent=1, sort_keys=True, default=str).encode()
        _write_atomic(self.fs, f"{self.root}/{RUNS_DIR}/{run_id}.json", payload)

    def run_records(self) -> Iterator[dict[str, Any]]:
        directory = f"{self.root}/{RUNS_DIR}"
        if self.fs.exists(directory):
            for path in sorted(self.fs.ls(directory, detail=False)):
                if str(path).endswith(".json"):
                    yield json.loads(self.fs.cat_file(path))

    def nbytes_stored(self) -> int:
        """Bytes of the store's objects (as the filesystem reports them)."""
        return int(sum(self.fs.du(self.root, total=False).values()))


def describe_plan_diff(stored: dict[str, Any], wanted: dict[str, Any]) -> str:
    keys = sorted(set(stored) | set(wanted))
    changed = [
        f"{key}: stored {stored.get(key)!r}, this run {wanted.get(key)!r}"
        for key in keys
        if stored.get(key) != wanted.get(key)
    ]
    if not changed:
        return "Plan inputs are equal but work chunks differ."
    return "Changed: " + "; ".join(changed) + "."
