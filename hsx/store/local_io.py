"""Writing storage objects to local disks: atomic (temp name, then rename), optionally with
O_DIRECT.

Hidden-state objects are written once and read much later (by verify, then by trainers), so
caching them in the page cache buys nothing. Buffered writes cost the writer CPU for every page
the kernel allocates and copies: measured here 0.16-1.65 s of system time per 528 MiB (the high end
when the VM touches fresh memory), against 0.045 s with O_DIRECT at 1.3 GiB/s. On a 2-core machine
that CPU comes straight out of the engine's time; on a node writing terabytes the page cache
also fills with dirty pages and throttles every writer.

O_DIRECT needs the buffer's address, the length and the file offset aligned to the device's
logical block size; hsx aligns staging buffers to ``DIRECT_ALIGNMENT`` (4096, a multiple of every
common block size). Anything unaligned, and file systems without O_DIRECT (tmpfs answers EINVAL),
fall back to a buffered write.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from typing import Any

import numpy as np
import torch

DIRECT_ALIGNMENT = 4096
# Devices (st_dev) where O_DIRECT was refused: not tried again in this process.
_NO_DIRECT: set[int] = set()
_NO_DIRECT_LOCK = threading.Lock()
# Not O_EXCL: a file system that refuses O_DIRECT may have created the file before refusing.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
# Linux writes at most this many bytes per write(2) call.
_MAX_WRITE = 0x7FFFF000 & ~(DIRECT_ALIGNMENT - 1)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a DIRECT_ALIGNMENT boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + DIRECT_ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % DIRECT_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def aligned_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose data starts on a DIRECT_ALIGNMENT boundary (torch's
    allocator promises 64 bytes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape, dtype=np.int64))
    raw = aligned_empty((count * itemsize,), np.dtype("uint8"))
    return torch.from_numpy(raw).view(dtype).view(shape)


def is_direct_aligned(payload: memoryview) -> bool:
    address = np.frombuffer(payload, dtype=np.uint8).ctypes.data if payload.nbytes else 0
    return (
        payload.nbytes > 0
        and address % DIRECT_ALIGNMENT == 0
        and payload.nbytes % DIRECT_ALIGNMENT == 0
    )


def _open_direct(path: str) -> int | None:
    """A file descriptor opened with O_DIRECT, or None where this file system refuses it."""
    device = os.stat(os.path.dirname(path)).st_dev
    with _NO_DIRECT_LOCK:
        if device in _NO_DIRECT:
            return None
    flags = _CREATE_FLAGS | getattr(os, "O_DIRECT", 0)
    if flags & getattr(os, "O_DIRECT", 0) == 0:
        return None  # no O_DIRECT on this platform
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        with _NO_DIRECT_LOCK:
            _NO_DIRECT.add(device)
        return None


def _write_all(fd: int, payload: memoryview) -> None:
    written = 0
    while written < payload.nbytes:
        count = os.write(fd, payload[written : written + _MAX_WRITE])
        if count <= 0:
            raise OSError(errno.EIO, f"write returned {count} after {written} bytes")
        written += count


def write_local_atomic(
    path: str, payload: memoryview, durable: bool = False, direct: bool = False
) -> bool:
    """Write ``payload`` to ``path`` under a temporary name, then rename it into place: a reader
    never sees a partial object. ``durable`` fsyncs before the rename (commit records);
    ``direct`` uses O_DIRECT where the payload and the file system allow it. Returns True when
    the object was written with O_DIRECT."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    payload = payload.cast("B")
    try:
        fd = _open_direct(temp) if direct and is_direct_aligned(payload) else None
        used_direct = fd is not None
        if fd is None:
            fd = os.open(temp, _CREATE_FLAGS, 0o644)
        try:
            _write_all(fd, payload)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return used_direct


def create_local_once(path: str, payload: memoryview, durable: bool = True) -> bool:
    """Create ``path`` holding ``payload`` only if nothing is there: written whole under a
    temporary name (fsynced where ``durable``), then hard-linked to ``path`` (link(2) fails
    where the name exists, on local and NFS file systems alike; O_EXCL on the final name would
    expose a partial file). Returns False, writing nothing, when ``path`` already existed."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        fd = os.open(temp, _CREATE_FLAGS, 0o644)
        try:
            _write_all(fd, payload.cast("B"))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
