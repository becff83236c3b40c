"""The Zarr v3 store of one extraction, through fsspec (local paths, file://, memory://, s3://...).

Layout (DESIGN.md §4):
    attrs           hsx metadata: schema, plan inputs + hash, model, layers, dtype, code version
    input_ids       int32  [T]        chunks (C,)
    loss_mask       uint8  [T]        chunks (C,)
    hidden_states   f32|u16 [T, K, H] chunks (C, K, H); bf16 stored as uint16 + logical_dtype
                    (u8 with state_encoding fp8_e4m3: fp8 bits, hsx.store.fp8_states)
    hidden_scales   f32    [T, K]     chunks (C, K); fp8 stores only: one scale per token, layer
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
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem

from hsx.errors import CorruptRecordError, StoreError
from hsx.plan.chunks import Plan, WorkChunk, token_object_rows
from hsx.store.checksums import digest
from hsx.store.fp8_states import ENCODING as FP8_ENCODING
from hsx.store.fp8_states import SCALES_ARRAY
from hsx.store.layout_copy import write_layout_copy
from hsx.store.storage_io import create_once, exists, storage_error, store_io, write_atomic

SCHEMA_VERSION = 1
HSX_ATTR = "hsx"
_BATCH_READERS = 16  # objects of one batch read at once (read_row_ranges)
CREATE_WRITERS = 16  # token-row objects a store's creation writes at once
COMMITS_DIR = "commits"
# Records of chunks computed by more than one attempt (ExtractionStore.write_collision).
COLLISIONS_DIR = "collisions"
# What a collision record keeps of each attempt.
_ATTEMPT_FIELDS = ("run_id", "attempt", "host", "pid", "started_at", "finished_at", "extra")
RUNS_DIR = "runs"
ROW_ARRAYS = ("input_ids", "loss_mask", "hidden_states", SCALES_ARRAY)  # those a store has
# Written once, at creation, in objects of token_rows_per_object rows (C in older stores).
TOKEN_ARRAYS = ("input_ids", "loss_mask")


@dataclass
class CommitRecord:
    """What one work chunk wrote: the audit truth of the store (Prefect's history is not)."""

    chunk_index: int
    row_start: int
    row_end: int
    sample_start: int
    sample_end: int
    tokens: int
    # array name -> digests of its storage objects over [row_start, row_end), one per Zarr chunk
    # of C rows in row order: verify names the exact object that changed.
    checksums: dict[str, list[str]]
    checksum_algorithm: str
    plan_hash: str
    run_id: str  # the Prefect flow run id
    attempt: int
    code_version: str
    host: str
    pid: int
    started_at: str
    finished_at: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    # Samples whose states failed a check and were kept out (capture.on_bad_states=skip):
    # [{"sample": index, "reason": "..."}]; readers leave them out.
    skipped_samples: list[dict[str, Any]] = field(default_factory=list)


def fs_and_root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
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
    fs_and_root(url)


def existing_store_meta(url: str) -> dict[str, Any] | None:
    """The hsx attributes of a complete store at ``url``, or None where there is none yet (an
    interrupted creation counts as none: planning re-creates it)."""
    fs, root = fs_and_root(url)
    if not exists(fs, url, f"{root}/zarr.json"):
        return None
    group = zarr.open_group(url, mode="r")  # type: ignore[arg-type]
    meta = dict(cast(dict[str, Any], group.attrs.get(HSX_ATTR, {})))
    return meta if meta.get("layout_complete") else None


def stored_state_dtype(meta: dict[str, Any]) -> str:
    """The physical dtype of hidden_states for store metadata ``meta``: fp8 bits as uint8,
    bf16 as uint16 (zarr has no bfloat16), else the logical dtype."""
    if meta.get("state_encoding") == FP8_ENCODING:
        return "uint8"
    return "uint16" if meta["logical_dtype"] == "bfloat16" else str(meta["logical_dtype"])


def bytes_per_row(meta: dict[str, Any]) -> int:
    """Stored bytes of one token row over every row array (ids, mask, states, scales)."""
    k, h = int(meta["num_layers_captured"]), int(meta["hidden_size"])
    states = k * h * np.dtype(stored_state_dtype(meta)).itemsize
    scales = 4 * k if meta.get("state_encoding") == FP8_ENCODING else 0
    return states + scales + 4 + 1  # + input_ids int32 + loss_mask uint8


def _sample_index_of(plan: Plan) -> dict[str, np.ndarray]:
    return {
        "sample_starts": np.asarray(plan.sample_starts, dtype=np.int64),  # [N]
        "sample_lengths": np.asarray(plan.sample_lengths, dtype=np.int32),  # [N]
    }


class ExtractionStore:
    """One extraction's Zarr group plus its commit and run records."""

    def __init__(self, url: str, group: zarr.Group, direct_io: bool = False) -> None:
        self.url = url
        self.group = group
        self.fs, self.root = fs_and_root(url)
        # Attributes are fixed once the layout is complete: read them once.
        self._meta: dict[str, Any] = dict(cast(dict[str, Any], group.attrs.get(HSX_ATTR, {})))
        self._arrays: dict[str, zarr.Array] = {}
        self._raw_chunks = {name: self._is_raw(name) for name in ROW_ARRAYS if name in group}
        # Chunk objects on local disks bypass the page cache (hsx.store.local_io says why).
        self.direct_io = direct_io
        self._sample_index: tuple[np.ndarray, np.ndarray] | None = None

    def _is_raw(self, name: str) -> bool:
        """True when the array's chunks are stored as plain little-endian bytes (no codec but
        the bytes codec), so a chunk object can be written without zarr's codec pipeline."""
        from zarr.codecs import BytesCodec

        codecs: tuple[Any, ...] = tuple(getattr(self.array(name).metadata, "codecs", ()))
        if len(codecs) != 1 or not isinstance(codecs[0], BytesCodec):
            return False
        endian = codecs[0].endian  # an Endian enum in zarr 3.1, a plain string in 3.4
        return endian is None or str(getattr(endian, "value", endian)) == "little"

    def layout_stamp(self) -> tuple[Any, ...]:
        """Identity of the group's metadata object: changes when the store is re-created."""
        info = self.fs.info(f"{self.root}/zarr.json")
        return tuple(info.get(key) for key in ("size", "mtime", "ino", "created"))

    @property
    def rows_per_chunk(self) -> int:
        return int(self._meta["rows_per_chunk"])

    def object_rows(self, name: str) -> int:
        """Rows per storage object of array ``name``: C, or the token arrays' own size."""
        if name in TOKEN_ARRAYS:
            return int(self._meta.get("token_rows_per_object", self.rows_per_chunk))
        return self.rows_per_chunk

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str, mode: str = "r", direct_io: bool = False) -> ExtractionStore:
        fs, root = fs_and_root(url)
        if not exists(fs, url, f"{root}/zarr.json"):
            raise StoreError(f"store {url}: expected a Zarr group (zarr.json), found nothing")
        group = zarr.open_group(url, mode=mode)  # type: ignore[arg-type]
        store = cls(url, group, direct_io)
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
        fs, root = fs_and_root(url)
        if exists(fs, url, f"{root}/zarr.json"):
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
            if exists(fs, url, f"{root}/{COMMITS_DIR}"):
                raise StoreError(
                    f"store {url}: layout incomplete but commit records exist; refusing to "
                    "recreate it. Inspect or delete the store."
                )
        return cls._create(url, plan, meta)

    @classmethod
    def _create(cls, url: str, plan: Plan, meta: dict[str, Any]) -> ExtractionStore:
        group = zarr.open_group(url, mode="w")  # type: ignore[arg-type]
        rows, c = plan.total_rows, plan.rows_per_chunk
        token_rows = token_object_rows(rows, c, plan.token_rows_per_object)
        k, h = int(meta["num_layers_captured"]), int(meta["hidden_size"])
        fp8 = meta.get("state_encoding") == FP8_ENCODING
        stored_dtype = stored_state_dtype(meta)
        # "c.I.0.0" keys: all chunk objects of an array in one folder. Zarr's default "c/I/0/0"
        # makes two directories per chunk on local disks (measured: mkdir cost more than the write).
        keys: Any = {"name": "default", "separator": "."}
        compressors: Any = None
        if meta.get("compressor") == "zstd":
            from zarr.codecs import ZstdCodec

            compressors = [ZstdCodec(level=1)]
        group.create_array(
            "input_ids",
            shape=(rows,),
            chunks=(token_rows,),
            dtype="int32",
            compressors=None,
            chunk_key_encoding=keys,
            fill_value=0,
        )
        group.create_array(
            "loss_mask",
            shape=(rows,),
            chunks=(token_rows,),
            dtype="uint8",
            compressors=None,
            chunk_key_encoding=keys,
            fill_value=0,
        )
        hidden = group.create_array(
            "hidden_states",
            shape=(rows, k, h),
            chunks=(c, k, h),
            dtype=stored_dtype,
            compressors=compressors,
            chunk_key_encoding=keys,
            fill_value=0,
            dimension_names=("token", "layer", "hidden"),
        )
        hidden.attrs["logical_dtype"] = meta["logical_dtype"]
        hidden.attrs["layer_ids"] = list(meta["layer_ids"])
        if fp8:
            hidden.attrs["state_encoding"] = FP8_ENCODING
            group.create_array(
                SCALES_ARRAY,
                shape=(rows, k),
                chunks=(c, k),
                dtype="float32",
                compressors=None,
                chunk_key_encoding=keys,
                fill_value=0,
                dimension_names=("token", "layer"),
            )
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
            chunk_key_encoding=keys,
        )
        attrs = {
            **meta,
            "schema_version": SCHEMA_VERSION,
            "plan_hash": plan.plan_hash,
            "plan_inputs": plan.inputs,
            "num_samples": plan.num_samples,
            "total_rows": plan.total_rows,
            "total_tokens": plan.total_tokens,
            "rows_per_chunk": c,
            "token_rows_per_object": token_rows,
            "work_chunks": [asdict(chunk) for chunk in plan.chunks],
            # Which samples were cut to data.max_length (with their full length) or left out.
            "overlength": plan.overlength or {},
            # The sample index is written once, here: its digests let verify find a flipped
            # byte in it (no commit record covers it), and planning rewrite it.
            "sample_index_checksums": {
                name: digest(values) for name, values in _sample_index_of(plan).items()
            },
            "layout_complete": False,
        }
        group.attrs[HSX_ATTR] = attrs
        store = cls(url, group)
        store.write_sample_index(plan)
        # Token ids and loss masks are known from the plan: written once, here, so work chunks
        # only read them (and checksum them in their commits).
        store.write_token_rows(plan)
        attrs["layout_complete"] = True  # last: an interrupted creation is recreated
        group.attrs[HSX_ATTR] = attrs
        store._meta = attrs
        # The metadata documents are final now: keep a copy that verify checks them against.
        write_layout_copy(store.fs, store.root, url)
        return store

    def write_token_rows(self, plan: Plan, chunks: Sequence[WorkChunk] | None = None) -> None:
        """The token arrays' objects from the plan: all of them (creation), or those holding
        the rows of ``chunks`` (a resumed run rewrites its pending chunks' rows: a repair
        dropped the commit of a chunk whose token object was corrupt). Objects are written
        whole, their other chunks' rows from the plan too, never from the object replaced.
        An object holds token_rows_per_object rows (many work chunks): each is a request on an
        object store (issue 29: C-row objects made 1.56M PUTs for 200M tokens at C=256).
        CREATE_WRITERS objects are written at once; rows are read from the plan's spool on
        this thread (it is one file), a few objects ahead."""
        size = self.object_rows("input_ids")
        wanted = None
        if chunks is not None:
            wanted = {o for c in chunks for o in range(c.row_start // size, -(-c.row_end // size))}
        pending: deque[Future[None]] = deque()
        with ThreadPoolExecutor(CREATE_WRITERS, thread_name_prefix="hsx-create") as pool:
            for row_start, block in self._token_blocks(plan):
                if wanted is not None and row_start // size not in wanted:
                    continue
                pending.append(pool.submit(self.write_rows, row_start, block))
                if len(pending) >= 2 * CREATE_WRITERS:
                    pending.popleft().result()  # the first failure raises here
            for future in pending:
                future.result()

    def _token_blocks(self, plan: Plan) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(first row, whole objects' rows) of the token arrays, from the work chunks in row
        order; the last object zero-padded to its full size (Zarr stores edge chunks whole)."""
        size = self.object_rows("input_ids")
        ids, mask = np.zeros(size, np.int32), np.zeros(size, np.uint8)  # [size] each
        filled = block_start = 0
        for chunk in plan.chunks:
            if chunk.row_start != block_start + filled:
                raise StoreError(
                    f"plan: expected work chunk {chunk.index} to start at row "
                    f"{block_start + filled}, found {chunk.row_start}"
                )
            chunk_ids, chunk_mask = plan.chunk_rows(chunk)
            taken = 0
            while taken < chunk_ids.size:
                n = min(size - filled, chunk_ids.size - taken)
                ids[filled : filled + n] = chunk_ids[taken : taken + n]
                mask[filled : filled + n] = chunk_mask[taken : taken + n]
                filled, taken = filled + n, taken + n
                if filled == size:
                    yield block_start, {"input_ids": ids, "loss_mask": mask}
                    ids, mask = np.zeros(size, np.int32), np.zeros(size, np.uint8)
                    filled, block_start = 0, block_start + size
        if filled:
            yield block_start, {"input_ids": ids, "loss_mask": mask}

    def write_sample_index(self, plan: Plan) -> None:
        """Write sample_starts and sample_lengths from the plan (creation, and repair)."""
        for name, values in _sample_index_of(plan).items():
            if values.size:
                self.array(name)[:] = values
        self._sample_index = None

    def sample_index_problems(self) -> list[str]:
        """What differs between the stored sample index and its digests from creation (stores
        written before hsx kept them have none to compare with)."""
        expected: dict[str, str] = self.meta.get("sample_index_checksums", {})
        problems = []
        for name, stored_digest in expected.items():
            array = self.array(name)
            try:
                values = np.asarray(array[:], dtype=array.dtype)
            except Exception as exc:  # a truncated object: zarr's codec refuses it
                problems.append(f"{name}: expected {array.shape[0]} values, found {exc!r}")
                continue
            found = digest(values)
            if found != stored_digest:
                problems.append(
                    f"{name}: stored and computed checksum do not match. Stored: {stored_digest} "
                    f"Computed: {found} (planning rewrites it: `hsx verify --repair` with "
                    "--model and --dataset, or a re-run of extract)"
                )
        return problems

    def sample_rows(self, sample_start: int, sample_end: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample_starts [n] int64, sample_lengths [n] int32) of samples [start, end)."""
        if self._sample_index is None:
            # Fixed once the layout is complete, and 12 bytes a sample: read once per store.
            self._sample_index = (
                np.asarray(self.array("sample_starts")[:], dtype=np.int64),
                np.asarray(self.array("sample_lengths")[:], dtype=np.int32),
            )
        starts, lengths = self._sample_index
        return starts[sample_start:sample_end], lengths[sample_start:sample_end]

    # ---- metadata ---------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        return self._meta

    @property
    def work_chunks(self) -> list[WorkChunk]:
        return [WorkChunk(**chunk) for chunk in self.meta["work_chunks"]]

    @property
    def logical_dtype(self) -> str:
        return str(self.meta["logical_dtype"])

    @property
    def state_encoding(self) -> str:
        """'plain' (states in the logical dtype) or 'fp8_e4m3' (uint8 bits plus scales)."""
        return str(self.meta.get("state_encoding", "plain"))

    @property
    def state_arrays(self) -> tuple[str, ...]:
        """The arrays a work chunk writes."""
        fp8 = self.state_encoding == FP8_ENCODING
        return ("hidden_states", SCALES_ARRAY) if fp8 else ("hidden_states",)

    @property
    def row_arrays(self) -> tuple[str, ...]:
        """Every array of one row per token, as commit records checksum them."""
        return ("input_ids", "loss_mask", *self.state_arrays)

    def array(self, name: str) -> zarr.Array:
        cached = self._arrays.get(name)
        if cached is not None:
            return cached
        node = self.group[name]
        if not isinstance(node, zarr.Array):
            raise StoreError(
                f"store {self.url}: expected array {name!r}, found {type(node).__name__}"
            )
        self._arrays[name] = node
        return node

    # ---- rows ----------------------------------------------------------------------------
    def write_rows(self, row_start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write whole storage objects of each array from ``row_start`` (a multiple of the
        array's object rows: C, or the token arrays' own)."""
        for name, rows in arrays.items():
            size, end = self.object_rows(name), row_start + rows.shape[0]
            if row_start % size or end % size:
                raise StoreError(
                    f"{name}: expected a write aligned to Zarr chunks of {size} rows, found rows "
                    f"[{row_start}, {end})"
                )
            for first in range(row_start, end, size):
                self.write_chunk(name, first, rows[first - row_start : first - row_start + size])

    def write_chunk(self, name: str, row_start: int, rows: np.ndarray) -> None:
        """Write one whole Zarr chunk (its object's rows). Uncompressed arrays are written as
        the chunk's storage object directly (its bytes are the rows in C order, little endian:
        what zarr itself would write), atomically; zarr's own write path measured 5-8x slower
        here."""
        array = self.array(name)
        size = self.object_rows(name)
        if row_start % size or rows.shape[0] != size:
            raise StoreError(
                f"{name}: expected one whole Zarr chunk of {size} rows at a multiple of {size}, "
                f"found {rows.shape[0]} rows at {row_start}"
            )
        if not self._raw_chunks.get(name, False):
            # The last chunk may reach past the array's end: zarr takes only the rows inside.
            array[row_start : min(row_start + size, array.shape[0])] = rows[
                : array.shape[0] - row_start
            ]
            return
        coords = (row_start // size,) + (0,) * (rows.ndim - 1)
        key = array.metadata.encode_chunk_key(coords)
        data = np.ascontiguousarray(rows, dtype=array.dtype)
        payload = memoryview(cast(Any, data)).cast("B")
        write_atomic(
            self.fs, f"{self.root}/{name}/{key}", payload, direct=self.direct_io, store=self.url
        )

    def read_rows(
        self, name: str, row_start: int, row_end: int, reuse: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows [row_start, row_end). Whole Zarr chunks of uncompressed arrays are read as their
        storage objects directly (into ``reuse`` where it has the rows' shape and dtype: fresh
        memory costs a page fault per 4 KiB, which halved verify's speed from memory), and a
        missing object raises: zarr would return fill values."""
        size = self.object_rows(name)
        # Token arrays' objects span many work chunks: their rows are read out of whole objects.
        aligned = row_start % size == 0 and row_end % size == 0
        if self._raw_chunks.get(name, False) and (aligned or name in TOKEN_ARRAYS):
            return self._read_objects(name, row_start, row_end, reuse)
        return np.asarray(self.array(name)[row_start:row_end])

    def read_row_ranges(
        self, names: Sequence[str], ranges: Sequence[tuple[int, int]]
    ) -> dict[str, list[np.ndarray]]:
        """Rows of each [start, end) range of each array in ``names``, every storage object
        they touch read once: the samples of a shuffled training batch often share objects
        (one object holds many short samples; a long one spans several), and reading per
        sample reads them again. The objects of all arrays are read at once, so an object
        store's latency is paid about once per batch, not once per array."""
        raw = [name for name in names if self._raw_chunks.get(name, False)]
        wanted = [
            (name, obj)
            for name in raw
            for obj in sorted(
                {
                    obj
                    for start, end in ranges
                    for obj in range(
                        start // self.object_rows(name), -(-end // self.object_rows(name))
                    )
                }
            )
        ]

        def read(key: tuple[str, int]) -> np.ndarray:
            size = self.object_rows(key[0])
            return self._read_objects(key[0], key[1] * size, (key[1] + 1) * size, None)

        if len(wanted) > 1:
            with ThreadPoolExecutor(min(len(wanted), _BATCH_READERS)) as pool:
                objects = dict(zip(wanted, pool.map(read, wanted), strict=True))
        else:
            objects = {key: read(key) for key in wanted}
        out: dict[str, list[np.ndarray]] = {}
        for name in names:
            if name not in raw:
                out[name] = [np.asarray(self.array(name)[start:end]) for start, end in ranges]
                continue
            out[name] = []
            c = self.object_rows(name)
            for start, end in ranges:
                parts = [
                    objects[name, obj][
                        max(start, obj * c) - obj * c : min(end, (obj + 1) * c) - obj * c
                    ]
                    for obj in range(start // c, -(-end // c))
                ]
                out[name].append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return out

    def read_rows_in_place(self, name: str, row_start: int, row_end: int) -> np.ndarray:
        """Rows [row_start, row_end) of an uncompressed array, reading only their bytes from
        each storage object (a byte range: a few rows of a 16 MiB object cost their own bytes,
        not the object's); other arrays as read_rows. A missing object, or one that ends before
        the rows, raises StoreError (a sampled reader: verify checks whole objects)."""
        if not self._raw_chunks.get(name, False):
            return self.read_rows(name, row_start, row_end)
        array = self.array(name)
        c = self.object_rows(name)
        dtype = np.dtype(array.dtype).newbyteorder("<")
        out = np.empty((row_end - row_start, *array.shape[1:]), dtype=dtype)
        row_bytes = out[:1].nbytes
        for obj in range(row_start // c, -(-row_end // c)):
            lo, hi = max(obj * c, row_start), min((obj + 1) * c, row_end)
            key = array.metadata.encode_chunk_key((obj,) + (0,) * (out.ndim - 1))
            path = f"{self.root}/{name}/{key}"
            first = (lo - obj * c) * row_bytes
            target = memoryview(cast(Any, out[lo - row_start : hi - row_start])).cast("B")
            try:
                found = self._read_range_into(path, first, target)
            except FileNotFoundError:
                raise StoreError(
                    f"{name} rows [{lo}, {hi}): expected storage object {path}, found none"
                ) from None
            if found != target.nbytes:
                raise StoreError(
                    f"{name} rows [{lo}, {hi}): expected bytes [{first}, {first + target.nbytes}) "
                    f"of {path}, found {found} of them"
                )
        return out

    def _read_range_into(self, path: str, first: int, target: memoryview) -> int:
        """Read ``target.nbytes`` bytes of the object at ``path`` from byte ``first``."""
        if isinstance(self.fs, LocalFileSystem):
            with open(path, "rb") as handle:
                return os.preadv(handle.fileno(), [target], first)
        end = first + target.nbytes
        try:
            data = self.fs.cat_file(path, start=first, end=end)
        except Exception as exc:
            error = storage_error(self.url, path, target.nbytes, exc, local=False, action="read")
            if error is None:
                raise
            raise error from exc
        target[: len(data)] = data
        return len(data)

    def _read_objects(
        self, name: str, row_start: int, row_end: int, reuse: np.ndarray | None
    ) -> np.ndarray:
        """Rows [row_start, row_end) from their storage objects; an object the range covers
        in part is read whole and its rows copied out."""
        array = self.array(name)
        c = self.object_rows(name)
        dtype = np.dtype(array.dtype).newbyteorder("<")
        shape = (row_end - row_start, *array.shape[1:])
        if reuse is not None and reuse.shape == shape and reuse.dtype == dtype:
            out = reuse
        else:
            out = np.empty(shape, dtype=dtype)
        for obj in range(row_start // c, -(-row_end // c)):
            first, last = obj * c, (obj + 1) * c
            whole = first >= row_start and last <= row_end
            rows = (
                out[first - row_start : last - row_start]
                if whole
                else np.empty((c, *shape[1:]), dtype)
            )
            path = f"{self.root}/{name}/{array.metadata.encode_chunk_key((obj,) + (0,) * (out.ndim - 1))}"
            target = memoryview(cast(Any, rows)).cast("B")
            try:
                found = self._read_object_into(path, target)
            except FileNotFoundError:
                raise StoreError(
                    f"{name} rows [{first}, {last}): expected storage object {path}, found none"
                ) from None
            if found != target.nbytes:
                raise StoreError(
                    f"{name} rows [{first}, {last}): expected {target.nbytes} bytes in {path}, "
                    f"found {found}"
                )
            if not whole:
                lo, hi = max(first, row_start), min(last, row_end)
                out[lo - row_start : hi - row_start] = rows[lo - first : hi - first]
        return out

    def _read_object_into(self, path: str, target: memoryview) -> int:
        """Read one object into ``target``; returns the object's size."""
        if isinstance(self.fs, LocalFileSystem):
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size == target.nbytes:
                    handle.readinto(target)
                return size
        try:
            data = self.fs.cat_file(path)
        except Exception as exc:
            error = storage_error(self.url, path, target.nbytes, exc, local=False, action="read")
            if error is None:
                raise
            raise error from exc
        if len(data) == target.nbytes:
            target[:] = data
        return len(data)

    # ---- commits and runs -------------------------------------------------------------------
    def _commit_path(self, index: int) -> str:
        return f"{self.root}/{COMMITS_DIR}/chunk-{index:06d}.json"

    def write_commit(self, record: CommitRecord) -> CommitRecord | None:
        """Commit a chunk exactly once: the record is created only where the chunk has none
        (put-if-absent), so of two attempts racing on one chunk (two nodes, or a retry beside a
        run thought dead) exactly one commits. Returns None when this record is the chunk's,
        else the record that was there first (the caller records the collision)."""
        path = self._commit_path(record.chunk_index)
        payload = json.dumps(asdict(record), indent=1, sort_keys=True).encode()
        if create_once(self.fs, path, payload, store=self.url):
            return None
        there = self._load_commit(path, record.chunk_index)
        # A conditional PUT retried after its answer was lost finds its own record: not a race.
        return None if there == record else there

    def write_collision(self, loser: CommitRecord, winner: CommitRecord) -> dict[str, Any]:
        """Record that ``loser`` computed a chunk ``winner`` had committed: both attempts, and
        whether their objects' digests agree (where they differ, the stored objects may mix
        the two attempts' bytes until ``hsx verify --repair`` redoes the chunk)."""
        attempts = {"winner": asdict(winner), "loser": asdict(loser)}  # copies
        collision = {
            "chunk_index": loser.chunk_index,
            "same_checksums": loser.checksums == winner.checksums,
            **{side: {k: v[k] for k in _ATTEMPT_FIELDS} for side, v in attempts.items()},
            "recorded_at": datetime.now(UTC).isoformat(),
        }
        name = f"chunk-{loser.chunk_index:06d}-{uuid.uuid4().hex[:12]}.json"
        payload = json.dumps(collision, indent=1, sort_keys=True).encode()
        write_atomic(self.fs, f"{self.root}/{COLLISIONS_DIR}/{name}", payload, durable=True)
        return collision

    def collisions(self) -> list[dict[str, Any]]:
        """Every recorded collision (a chunk computed by more than one attempt), oldest first."""
        directory = f"{self.root}/{COLLISIONS_DIR}"
        self._forget_listing(directory)
        if not exists(self.fs, self.url, directory):
            return []
        listing = self._io(directory, "list", lambda: self.fs.ls(directory, detail=False))
        found = [
            json.loads(self._io(str(path), "read", lambda p=path: self.fs.cat_file(p)))
            for path in listing
            if str(path).endswith(".json")
        ]
        return sorted(found, key=lambda c: (c["recorded_at"], c["chunk_index"]))

    def _forget_listing(self, path: str) -> None:
        """Drop what the filesystem cached of ``path`` and its folders: s3fs keeps a listing
        once made, so a long-lived process (a parent over many nodes, a flow verifying after
        its chunks) would not see records other processes wrote since (seen: a parent's Retry
        found committed chunks missing)."""
        self.fs.invalidate_cache(path)

    def _io(self, path: str, action: str, call: Any) -> Any:
        return store_io(self.fs, self.url, path, action, call)

    def _load_commit(self, path: str, index: int) -> CommitRecord:
        """The record at ``path``; CorruptRecordError (naming the file and what is wrong)
        where it does not parse as one, or belongs to another plan or chunk."""
        raw = self._io(path, "read", lambda: self.fs.cat_file(path))
        try:
            record = CommitRecord(**json.loads(raw))
        except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError, fields
            raise CorruptRecordError(
                f"commit record {path}: expected a JSON commit record, found {len(raw)} bytes "
                f"that do not parse ({exc}). Run `hsx verify {self.url} --repair` to drop it "
                "(the chunk is then extracted again).",
                index,
            ) from exc
        expected = (self.meta["plan_hash"], index)
        if (record.plan_hash, record.chunk_index) != expected:
            raise CorruptRecordError(
                f"commit record {path}: expected plan {expected[0]} and chunk {index}, found "
                f"plan {record.plan_hash} and chunk {record.chunk_index}",
                index,
            )
        return record

    def read_commit(self, index: int) -> CommitRecord | None:
        path = self._commit_path(index)
        self._forget_listing(path)
        if not exists(self.fs, self.url, path):
            return None
        return self._load_commit(path, index)

    def remove_commit(self, index: int) -> None:
        path = self._commit_path(index)
        if exists(self.fs, self.url, path):
            self._io(path, "delete", lambda: self.fs.rm_file(path))

    def committed_chunks(self, unreadable: dict[int, str] | None = None) -> dict[int, CommitRecord]:
        """All commit records, by chunk index. A record that does not parse raises
        CorruptRecordError, or, given ``unreadable``, is put there (index -> why) instead."""
        directory = f"{self.root}/{COMMITS_DIR}"
        self._forget_listing(directory)
        if not exists(self.fs, self.url, directory):
            return {}
        records: dict[int, CommitRecord] = {}
        listing = self._io(directory, "list", lambda: self.fs.ls(directory, detail=False))
        for path in sorted(listing):
            name = str(path).rsplit("/", 1)[-1]
            if not (name.startswith("chunk-") and name.endswith(".json")):
                continue  # temp files of an interrupted commit
            index = int(name.removeprefix("chunk-").removesuffix(".json"))
            try:
                records[index] = self._load_commit(str(path), index)
            except CorruptRecordError as exc:
                if unreadable is None:
                    raise
                unreadable[index] = str(exc)
        return records

    def committed_by(self, run_id: str, flow_run_attempt: int) -> list[CommitRecord]:
        """The commit records one attempt of one flow run wrote (a stopped run counts what it
        committed from these: a chunk in flight at the stop may have committed all the same).
        A record's ``attempt`` is its chunk task's; the flow run's is in its ``extra``."""
        return [
            record
            for record in self.committed_chunks().values()
            if record.run_id == run_id
            and int((record.extra or {}).get("flow_run_attempt", 1)) == flow_run_attempt
        ]

    def pending_chunks(self) -> list[WorkChunk]:
        done = self.committed_chunks()
        return [chunk for chunk in self.work_chunks if chunk.index not in done]

    def write_run_record(self, run_id: str, record: dict[str, Any]) -> None:
        payload = json.dumps(record, indent=1, sort_keys=True, default=str).encode()
        write_atomic(self.fs, f"{self.root}/{RUNS_DIR}/{run_id}.json", payload, durable=True)

    def run_records(self) -> Iterator[dict[str, Any]]:
        directory = f"{self.root}/{RUNS_DIR}"
        if not exists(self.fs, self.url, directory):
            return
        listing = self._io(directory, "list", lambda: self.fs.ls(directory, detail=False))
        for path in sorted(listing):
            if not str(path).endswith(".json"):
                continue
            raw = self._io(str(path), "read", lambda p=path: self.fs.cat_file(p))
            try:
                yield dict(json.loads(raw))
            except (ValueError, TypeError) as exc:  # audit shows a damaged record, never hides it
                yield {
                    "run_id": str(path).rsplit("/", 1)[-1],
                    "status": "unreadable",
                    "error": f"expected a JSON run record, found {exc!r}",
                }

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
