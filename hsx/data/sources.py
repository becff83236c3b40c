"""Where a dataset's rows come from: JSONL and JSON-array files, Parquet files (read by row
group), Arrow folders written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` with
``data.split``), and several of any of these at once (a glob, or a folder of files).

Every row comes with where it was read (file and line, or file, row group and row), which every
error names, and a position the plan records. Memory stays bounded by one line, one row group or
one Arrow batch, whatever the file's size (a JSON array is the exception: it is one document,
parsed whole). Nothing is fetched from a hub.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from hsx.data.regenerated import is_regenerated, regenerated_parts
from hsx.errors import DatasetError

FORMATS = ("jsonl", "json", "parquet", "arrow")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
_BOM = b"\xef\xbb\xbf"
_ARROW_BATCH = 1024
_FINGERPRINT_BLOCK = 8 * 1024 * 1024
# Longest excerpt of a bad value quoted in an error: enough to recognise it, not a whole document.
EXCERPT = 80


def excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= EXCERPT else text[: EXCERPT - 3] + "..."


@dataclass(frozen=True)
class DatasetFile:
    """One file (or save_to_disk folder) of a dataset, and how it is read: a local path or an
    fsspec URL (s3://, gs://, ...), read through its filesystem."""

    name: str  # as the user would write it: the local path, or the URL
    format: str  # one of FORMATS
    fs: Any = None  # fsspec filesystem
    path: str = ""  # in ``fs``

    def __str__(self) -> str:
        return self.name

    @property
    def local(self) -> bool:
        return "file" in _protocols(self.fs)

    def open(self) -> Any:
        """A binary file object with ``readline(limit)`` (fsspec's remote files take no
        limit: they are wrapped in a buffered reader)."""
        handle = self.fs.open(self.path, "rb")
        return handle if self.local else io.BufferedReader(handle, buffer_size=1 << 20)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _name(fs: Any, path: str) -> str:
    return path if "file" in _protocols(fs) else str(fs.unstrip_protocol(path))


@dataclass(frozen=True)
class SourceRow:
    """One row as read, before it is checked as a conversation."""

    record: Any  # a JSON object (dict) when the row is well formed
    where: str  # "file:line" or "file: row group g, row r": what errors name
    line_number: int  # 1-based line (JSONL) or row (others) in its file
    byte_offset: int  # of the line in a JSONL file; the row's index in other formats


def dataset_files(
    dataset: Path | str, fmt: str = "auto", split: str | None = None
) -> list[DatasetFile]:
    """The files ``dataset`` names (a file, a save_to_disk folder, a folder of data files, or a
    glob; a local path or an fsspec URL), in a stable order, each with its format (``fmt``, or
    detected from the path)."""
    import fsspec.core

    text = str(dataset)
    fs, root = fsspec.core.url_to_fs(text)
    if fs.isdir(root) and is_regenerated(fs, root):
        parts = regenerated_parts(fs, root, text)
        return [DatasetFile(_name(fs, path), "jsonl", fs, path) for path in parts]
    if any(char in text for char in "*?["):
        paths = sorted(fs.glob(root))
        if not paths:
            raise DatasetError(f"{text}: expected the glob to match dataset files, found none")
    elif fs.isdir(root) and not _is_saved_dataset(fs, root):
        listing = sorted(str(p) for p in fs.ls(root, detail=False))
        paths = [p for p in listing if _suffix(p) in _SUFFIXES]
        if not paths:
            raise DatasetError(
                f"{text}: expected a save_to_disk folder (dataset_info.json, state.json or "
                f"dataset_dict.json) or files ending in {sorted(_SUFFIXES)}, found "
                f"{[p.rsplit('/', 1)[-1] for p in listing][:8]}"
            )
    elif fs.exists(root):
        paths = [root]
    else:
        raise DatasetError(f"{text}: expected a dataset file or folder, found nothing there")
    files = []
    for path in paths:
        path = _with_split(fs, path, split)
        # One file named as the user named it (errors quote the user's own path).
        name = text if path == root and len(paths) == 1 else _name(fs, path)
        files.append(DatasetFile(name, _format_of(fs, path, fmt), fs, path))
    return files


def _suffix(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""


def _is_saved_dataset(fs: Any, folder: str) -> bool:
    return any(fs.isfile(f"{folder}/{name}") for name in ("state.json", "dataset_dict.json"))


def _with_split(fs: Any, path: str, split: str | None) -> str:
    """A DatasetDict folder's split (data.split), refused naming the splits it has."""
    listing = f"{path}/dataset_dict.json"
    if not fs.isfile(listing):
        return path
    splits = list(json.loads(fs.cat_file(listing)).get("splits", []))
    if split is None or split not in splits:
        raise DatasetError(
            f"{_name(fs, path)}: a DatasetDict with splits {splits}: expected data.split to name "
            f"one, found {split!r}"
        )
    return f"{path}/{split}"


def _format_of(fs: Any, path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if fs.isdir(path):
        return "arrow"
    found = _SUFFIXES.get(_suffix(path))
    if found == "json" and _first_byte(fs, path) != b"[":
        return "jsonl"  # many .json files hold one object per line
    if found is None:
        raise DatasetError(
            f"{_name(fs, path)}: expected a name ending in {sorted(_SUFFIXES)} or a save_to_disk "
            f"folder, found {path.rsplit('/', 1)[-1]!r}: set data.format to one of {list(FORMATS)}"
        )
    return found


def _first_byte(fs: Any, path: str) -> bytes:
    with fs.open(path, "rb") as source:
        head = bytes(source.read(4096)).removeprefix(_BOM).lstrip()
    return head[:1]


def iter_rows(files: list[DatasetFile], max_line_bytes: int) -> Iterator[SourceRow]:
    """Every row of every file, in order."""
    readers = {"jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows}
    for file in files:
        if file.format == "arrow":
            yield from _arrow_rows(file)
        elif file.format in readers:
            yield from readers[file.format](file, max_line_bytes)
        else:
            raise DatasetError(
                f"data.format: expected one of {list(FORMATS)} or auto, found {file.format!r}"
            )


def _bounded_lines(source: BinaryIO, path: DatasetFile, max_line_bytes: int) -> Iterator[bytes]:
    """The file's lines, each read with a limit: memory stays at ``max_line_bytes`` whatever the
    line, and an over-long line is refused by its number before anything parses it."""
    line_number = 0
    while raw := source.readline(max_line_bytes + 1):
        line_number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):  # its newline may be byte L+1
            raise DatasetError(
                f"{path}:{line_number}: expected a line of at most {max_line_bytes:,} bytes "
                f"(data.max_line_bytes), found a longer one (more than {max_line_bytes:,} bytes "
                "read without reaching its end); split the conversation, or raise "
                "data.max_line_bytes"
            )
        yield raw


def _jsonl_rows(path: DatasetFile, max_line_bytes: int) -> Iterator[SourceRow]:
    offset = 0
    with path.open() as lines:
        for line_number, raw in enumerate(_bounded_lines(lines, path, max_line_bytes), start=1):
            # A byte-order mark (some editors save UTF-8 with one) is not part of the JSON.
            body = raw.removeprefix(_BOM) if line_number == 1 else raw
            if body.strip():
                where = f"{path}:{line_number}"
                yield SourceRow(_parse_json(body, where), where, line_number, offset)
            offset += len(raw)


def _parse_json(raw: bytes, where: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{where}: expected a JSON object in UTF-8 text, found a byte that is not UTF-8 "
            f"({exc.reason}: {raw[exc.start : exc.start + 1]!r} at byte {exc.start} of the line): "
            f"{excerpt(raw.decode('utf-8', errors='replace').strip())}"
        ) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{where}: expected a JSON object, found text that is not JSON ({exc}): "
            f"{excerpt(text.strip())}"
        ) from exc


def _json_rows(path: DatasetFile, max_line_bytes: int) -> Iterator[SourceRow]:
    document = _parse_json(bytes(path.fs.cat_file(path.path)).removeprefix(_BOM), str(path))
    if not isinstance(document, list):
        raise DatasetError(
            f"{path}: expected a JSON array of conversations, found {type(document).__name__} "
            f"{excerpt(document)}"
        )
    for row, record in enumerate(document):
        yield SourceRow(record, f"{path}: element {row}", row + 1, row)


def _parquet_rows(path: DatasetFile, max_line_bytes: int) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path.open())
    except Exception as exc:  # pyarrow's own errors: not Parquet, truncated, ...
        raise DatasetError(f"{path}: expected a Parquet file, found {exc!r}") from exc
    row = 0
    for group in range(parquet.num_row_groups):
        for position, record in enumerate(parquet.read_row_group(group).to_pylist()):
            yield SourceRow(record, f"{path}: row group {group}, row {position}", row + 1, row)
            row += 1


def _arrow_rows(folder: DatasetFile) -> Iterator[SourceRow]:
    import datasets

    try:
        if folder.local:
            saved = datasets.load_from_disk(folder.path)
        else:
            saved = datasets.load_from_disk(
                folder.name, storage_options=dict(folder.fs.storage_options)
            )
    except Exception as exc:
        raise DatasetError(
            f"{folder}: expected a folder written by datasets' save_to_disk, found {exc!r}"
        ) from exc
    if isinstance(saved, datasets.DatasetDict):  # a split folder named without data.split
        raise DatasetError(
            f"{folder}: a DatasetDict with splits {list(saved)}: expected data.split to name one"
        )
    row = 0
    for batch in saved.iter(batch_size=_ARROW_BATCH):  # memory-mapped Arrow, read by batches
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield SourceRow(
                dict(zip(columns, values, strict=True)), f"{folder}: row {row}", row + 1, row
            )
            row += 1


def fingerprint_file(path: Path, cache: dict[tuple[str, int, int, int, int], str]) -> str:
    """xxh3-128 hex digest of a local file's bytes, read in 8 MiB blocks; ``cache`` keeps it per
    version of the file (path, device, inode, size, mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    known = cache.get(key)
    if known is None:
        with path.open("rb") as source:
            known = cache[key] = _digest(source)
    return known


def _digest(source: BinaryIO) -> str:
    digest = xxhash.xxh3_128()
    while block := source.read(_FINGERPRINT_BLOCK):
        digest.update(block)
    return digest.hexdigest()


def fingerprint_files(
    files: list[DatasetFile], cache: dict[tuple[str, int, int, int, int], str]
) -> str:
    """The dataset's digest: one file's own digest (as stores frozen before other formats
    recorded it), else a digest of each file's name and digest (a save_to_disk folder: its
    Arrow files), so that a resume refuses any changed file of any format. Remote files are
    read through their filesystem."""
    parts = [(file.fs, p) for file in files for p in _data_files(file)]
    digests = []
    for fs, part in parts:
        if "file" in _protocols(fs):
            digests.append(fingerprint_file(Path(part), cache))
        else:
            with fs.open(part, "rb") as source:
                digests.append(_digest(source))
    if len(parts) == 1:
        return digests[0]
    combined = xxhash.xxh3_128()
    for (_, part), found in zip(parts, digests, strict=True):
        combined.update(f"{part.rsplit('/', 1)[-1]}\0{found}\0".encode())
    return combined.hexdigest()


def _data_files(file: DatasetFile) -> list[str]:
    if not file.fs.isdir(file.path):
        return [file.path]
    found = file.fs.find(file.path)
    return sorted(str(p) for p in found if _suffix(str(p)) in {".arrow", ".json"})
