"""Store I/O with its failures classified (DESIGN.md "Storage faults"): every write, read,
listing and existence check of a store goes through here, so a full disk, a read-only mount, an
EIO or a remote store's error reaches the run as an hsx error naming the store and the object,
never as a raw library error."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hsx.errors import (
    HsxError,
    StorageFullError,
    StorageIOError,
    StoreReadOnlyError,
    is_retryable,
)
from hsx.store.local_io import create_local_once, write_local_atomic


def _store_of(path: str) -> str:
    """The store a written object belongs to: every object hsx writes lies two levels under the
    store's root (``ROOT/<array>/<key>``, ``ROOT/commits/<name>``, ``ROOT/runs/<name>``)."""
    return path.rsplit("/", 2)[0] if path.count("/") >= 2 else path


def _free_space(path: str) -> tuple[int, int] | None:
    """(free bytes, total bytes) of the file system holding ``path`` (its nearest existing
    folder), or None where it cannot be asked."""
    folder = os.path.dirname(path)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder or "/")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def storage_error(
    store: str,
    path: str,
    nbytes: int | None,
    exc: BaseException,
    local: bool,
    action: str = "write",
) -> HsxError | None:
    """The hsx error for a failed store I/O ``exc`` on ``path``, naming the store, the object,
    what was expected and what was found; None where ``exc`` keeps its own type (hsx errors,
    programming errors, a missing object: their callers decide).

    Classification (DESIGN.md "Storage faults"): ENOSPC/EDQUOT and EROFS are fatal (a full or
    read-only disk does not heal within a retry's backoff); EIO and every other failure of a
    remote store are transient (retried by the chunk task)."""
    if isinstance(exc, HsxError) or not is_retryable(exc) or isinstance(exc, FileNotFoundError):
        return None
    size = f"{nbytes:,} bytes" if nbytes is not None else "an object"
    code = getattr(exc, "errno", None)
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if local and code in (errno.ENOSPC, errno.EDQUOT):
        space = _free_space(path)
        found = (
            f"found {space[0]:,} bytes free of {space[1]:,} on its file system"
            if space is not None
            else "found the file system full"
        )
        return StorageFullError(
            f"store {store}: no space left on device writing {path}: expected room for {size}, "
            f"{found} ({reason}). Free space (or move the store), then re-run: "
            "only the chunks without a commit are extracted."
        )
    if local and code == errno.EROFS:
        return StoreReadOnlyError(
            f"store {store} is on a read-only file system: expected to write {size} to {path}, "
            f"found EROFS ({reason}). Remount it read-write or use another store; "
            "retrying cannot help."
        )
    if local and code != errno.EIO:
        return None  # other local faults keep their type (an unknown OSError is retried)
    what = f"errno {errno.errorcode.get(code, code)}" if code else type(exc).__name__
    target = {"write": f"{size} to {path}", "read": f"{size} from {path}"}.get(action, path)
    return StorageIOError(
        f"store {store}: expected to {action} {target}, found an I/O error ({what}: {reason}); "
        "retried"
    )


def store_io(fs: fsspec.AbstractFileSystem, store: str, path: str, action: str, call: Any) -> Any:
    """``call()``, a metadata or record I/O on ``path`` (exists, ls, cat, rm), with its failure
    classified as storage_error() does: a remote store's botocore or aiohttp error becomes a
    StorageIOError naming the store and the object, never a raw library error."""
    try:
        return call()
    except Exception as exc:
        error = storage_error(store, path, None, exc, isinstance(fs, LocalFileSystem), action)
        if error is None:
            raise
        raise error from exc


def write_atomic(
    fs: fsspec.AbstractFileSystem,
    path: str,
    payload: bytes | memoryview,
    durable: bool = False,
    direct: bool = False,
    store: str | None = None,
) -> None:
    """Temp name then rename on local disks; object stores make a single PUT atomic anyway.

    ``durable`` fsyncs before the rename: for commit records, so a crash never leaves an empty
    record behind. Chunk data is not fsynced (verify re-reads it against the commit's checksums).
    ``direct``: O_DIRECT on local disks where possible (hsx.store.local_io). A failure raises the hsx
    error storage_error() gives (naming ``store``, by default the folder two levels up)."""
    local = isinstance(fs, LocalFileSystem)
    try:
        if local:
            write_local_atomic(path, memoryview(payload), durable=durable, direct=direct)
        else:
            fs.pipe_file(path, bytes(payload))
    except Exception as exc:
        error = storage_error(
            store or _store_of(path), path, memoryview(payload).nbytes, exc, local
        )
        if error is None:
            raise
        raise error from exc


def create_once(
    fs: fsspec.AbstractFileSystem,
    path: str,
    payload: bytes,
    store: str | None = None,
    durable: bool = True,
) -> bool:
    """Put-if-absent: write ``payload`` to ``path`` only if no object is there, atomically
    (two writers racing: exactly one creates it). Local disks: a whole temporary file
    (fsynced where ``durable``) hard-linked into place; object stores: a conditional PUT
    (``If-None-Match: *`` through fsspec's ``mode="create"``). Returns False, writing nothing,
    when ``path`` existed."""
    local = isinstance(fs, LocalFileSystem)
    try:
        if local:
            return create_local_once(path, memoryview(payload), durable)
        fs.pipe_file(path, payload, mode="create")
        return True
    except FileExistsError:
        return False
    except Exception as exc:
        error = storage_error(store or _store_of(path), path, len(payload), exc, local)
        if error is None:
            raise
        raise error from exc


def exists(fs: fsspec.AbstractFileSystem, store: str, path: str) -> bool:
    return bool(store_io(fs, store, path, "check", lambda: fs.exists(path)))


def free_bytes_at(store_url: str) -> tuple[Path, int] | None:
    """(checked folder, free bytes) for a local store URL; None where it cannot be known."""
    local = _local_path(store_url)
    return _free_bytes(local) if local is not None else None


def _local_path(store_url: str) -> Path | None:
    parsed = urlparse(store_url)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # len 1: a Windows drive letter
        return Path(parsed.path if parsed.scheme == "file" else store_url)
    return None


def _free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the filesystem of ``path`` or of its nearest existing parent."""
    probe = path.expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free
