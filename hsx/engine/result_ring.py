"""Hidden-state rows from an engine in another process, through one reused shared-memory file.

Measured on these machines (64 MiB per request): writing rows into a fresh /dev/shm file ran at
2.2 GB/s and mapping and copying them out at 2.6 GB/s, against 11-12 GB/s for a copy into and
out of memory that is already mapped: a fresh file costs a page allocation, zeroing and a page
fault per 4 KiB on both sides. On the H200 that held the child-process engine home at 0.89 of
plain prefill (0.74 with the store on disk). The ring is mapped once by both processes; its pages
stay warm and, on a GPU, are registered as pinned memory so the device-to-host copy lands in
them directly.

Layout of the ring file: a byte map (one byte per granule: 1 = in use) then the granules.
The engine process (writer) marks granules in use when it allocates; the hsx process (reader)
clears them when the last view of a request's rows is gone. Each byte changes hands in one
direction at a time, so no lock spans the processes. Which rows are where goes through a FIFO
(``ready.fifo``), one JSON line per request (each write below PIPE_BUF, so atomic). A request
that finds the ring full goes to a spool file instead: the engine never waits for hsx.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import select
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx import timings
from hsx.engine.channel_files import (
    ChannelRefusedError,
    OwnerRule,
    check_secret,
    open_channel_folder,
    open_in_channel,
)

logger = logging.getLogger(__name__)

RING_FILE = "ring"
READY_FIFO = "ready.fifo"
# Allocation unit: a few hundred thousand granules for a ring of GiBs keeps the writer's search
# to microseconds; a request wastes at most one granule.
GRANULE = 64 << 10
_PAGE = 4096
# Messages stay below PIPE_BUF (4096 on Linux) so that each write is atomic.
_MAX_MESSAGE = 4000
# How often the engine process sends its stage timings along (seconds).
_TIMINGS_EVERY_S = 1.0


def _map_bytes(granules: int) -> int:
    return -(-granules // _PAGE) * _PAGE


def ring_granules(capacity_bytes: int) -> int:
    return max(1, capacity_bytes // GRANULE)


def ring_file_bytes(granules: int) -> int:
    """The size of a ring file of ``granules``: its byte map, then the granules."""
    return _map_bytes(granules) + granules * GRANULE


class _Mapping:
    """The ring file mapped shared: the byte map and the granules as numpy views."""

    def __init__(self, path: Path, granules: int, fd: int | None = None) -> None:
        """Maps ``path``, or the open ``fd`` (which it closes) when given."""
        self.granules = granules
        self.data_start = _map_bytes(granules)
        size = ring_file_bytes(granules)
        fd = os.open(path, os.O_RDWR) if fd is None else fd
        try:
            found = os.fstat(fd).st_size
            if found != size:
                # A client's ring of another size than its request says (hsx serve): refused,
                # as any channel the server will not write into.
                raise ChannelRefusedError(
                    f"result ring {path}: expected {size} bytes for {granules} granules, "
                    f"found {found}"
                )
            self.mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.used = np.frombuffer(self.mapped, dtype=np.uint8, count=granules)  # 1 = in use
        self.base = np.frombuffer(self.mapped, dtype=np.uint8, offset=self.data_start)


# A non-blocking writer (hsx serve's channel to one client) waits this long for room in a full
# FIFO before it gives the channel up: a stalled client must not stall the server's steps (the
# FIFO holds hundreds of announcements: a reader that reads is never this far behind). Once per
# channel: a channel given up is not opened again.
_FULL_FIFO_WAIT_S = 0.25


class ChannelClosedError(OSError):
    """A write to a channel this server has given up (closed): its descriptors are gone, and a
    number reused by another file must never be written."""


class ChannelFullError(OSError):
    """A channel's ring is full and its unread spool files hold as many bytes as the ring: its
    client does not read; the request's rows are not written."""


class RingWriter:
    """The engine process's side: allocate rows in the ring, announce what arrived.

    The folder is named by the reader (under hsx serve: by a request), so it and its files are
    opened without following links and checked on the open descriptors (hsx.engine.channel_files):
    ChannelRefusedError for a folder or file the server must not write into."""

    def __init__(
        self,
        spool_dir: str,
        granules: int,
        nonblocking: bool = False,
        owners: OwnerRule | None = None,
        secret: str | None = None,
    ) -> None:
        """``secret``: the channel's (hsx serve): the folder's secret file must hold it."""
        self.folder = spool_dir
        self.secret = secret
        owners = owners or OwnerRule.of_this_process()
        self._folder_fd = open_channel_folder(spool_dir, owners)
        try:
            if secret is not None:  # before any file of the channel is touched
                check_secret(self._folder_fd, spool_dir, secret, owners)
            ring = open_in_channel(self._folder_fd, RING_FILE, os.O_RDWR, "file", owners)
            self._map = _Mapping(Path(spool_dir) / RING_FILE, granules, fd=ring)
            # The reader holds the FIFO open for reading and writing, so this open does not
            # wait. Non-blocking (a server's channel to a client): an open without a reader
            # fails (ENXIO) instead of waiting, and a full FIFO fails a write after
            # _FULL_FIFO_WAIT_S.
            flags = os.O_WRONLY | (os.O_NONBLOCK if nonblocking else 0)
            self._ready = open_in_channel(self._folder_fd, READY_FIFO, flags, "fifo", owners)
        except BaseException:
            os.close(self._folder_fd)
            raise
        self._cursor = 0
        self._lock = threading.Lock()
        self._allocated: dict[int, int] = {}  # data address -> granules, until announced
        self._timings_sent = 0.0
        self.pinned = False
        # Uses of the channel's descriptors (FIFO writes, spool files made in its folder) and
        # its close, one at a time: after close() nothing reaches a descriptor number the
        # process may have reused (the GPU copier delivers from a thread of its own).
        self._use_lock = threading.RLock()
        self.closed = False
        # Spool files announced and not yet read (the reader removes each it reads): name ->
        # bytes. A channel's are bounded by its ring's size and removed when it is given up.
        self._spooled: dict[str, int] = {}

    def pin(self) -> None:
        """Register the ring with CUDA as pinned memory, so copies from the device land in it
        directly (asynchronously). Left unpinned, where CUDA refuses, and copies go through
        pinned buffers and spool files as before."""
        address = self._map.base.ctypes.data
        nbytes = self._map.granules * GRANULE
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        code = int(getattr(error, "value", error))
        if code != 0:
            logger.warning(
                "result ring: cudaHostRegister of %d bytes failed (%r); rows go through pinned "
                "buffers and spool files",
                nbytes,
                error,
            )
            return
        self.pinned = True

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of ``shape`` in the ring, or None when no free run of granules is long
        enough (the caller falls back to a spool file)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        needed = max(1, -(-nbytes // GRANULE))
        with self._lock:
            start = self._find_free(needed)
            if start is None:
                return None
            self._map.used[start : start + needed] = 1
            self._cursor = start + needed
            view = self._map.base[start * GRANULE : start * GRANULE + nbytes]
            self._allocated[view.ctypes.data] = needed
        return torch.from_numpy(view).view(dtype).view(shape)

    def _find_free(self, needed: int) -> int | None:
        """Next fit from the cursor, wrapping once."""
        used, total = self._map.used, self._map.granules
        if needed > total:
            return None
        position, wrapped = self._cursor, False
        while True:
            if position + needed > total:
                if wrapped:
                    return None
                position, wrapped = 0, True
                continue
            if wrapped and position >= self._cursor:
                return None
            busy = np.flatnonzero(used[position : position + needed])
            if busy.size == 0:
                return position
            position += int(busy[-1]) + 1

    def owns(self, rows: torch.Tensor) -> bool:
        start = self._map.base.ctypes.data
        address = rows.data_ptr()
        return start <= address < start + self._map.granules * GRANULE

    def announce_rows(self, key: str, rows: torch.Tensor) -> None:
        """Hand rows that start an allocation of this ring to the reader (which frees them)."""
        with self._lock:
            granules = self._allocated.pop(rows.data_ptr(), None)
        if granules is None:
            raise RuntimeError(
                f"request {key}: rows at {rows.data_ptr():#x} start no ring allocation"
            )
        offset = rows.data_ptr() - self._map.base.ctypes.data
        message = {
            "key": key,
            "granule": offset // GRANULE,
            "granules": granules,
            "dtype": str(rows.dtype).removeprefix("torch."),
            "shape": list(rows.shape),
        }
        self._send(message)
        self._send_timings()

    def _send_timings(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._timings_sent < _TIMINGS_EVERY_S:
            return
        self._timings_sent = now
        stages = {
            name: [round(s.seconds, 6), s.count, s.nbytes] for name, s in timings.snapshot().items()
        }
        self._send({"timings": stages, "pid": os.getpid()})

    def reader_alive(self) -> bool:
        """Whether the reading process still holds the FIFO (a write to a FIFO nobody reads
        fails with EPIPE; the reader skips pings)."""
        try:
            self._send({"ping": 1})
        except OSError:
            return False
        return True

    @property
    def folder_fd(self) -> int:
        """The folder, open: spool files are created relative to it (never through a link)."""
        return self._folder_fd

    def announce_file(self, key: str, path: str) -> None:
        self._send({"key": key, "file": path})

    def announce_error(self, key: str, error: BaseException) -> None:
        self._send({"key": key, "error": repr(error)})

    def _send(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        if len(line) > _MAX_MESSAGE:  # only an error's text can be long: shorten it, keep it atomic
            cut = str(message.get("error", ""))[: _MAX_MESSAGE // 2] + "..."
            line = (json.dumps(dict(message, error=cut), separators=(",", ":")) + "\n").encode()
        deadline = time.monotonic() + _FULL_FIFO_WAIT_S
        with self.in_use():
            while True:
                try:
                    os.write(self._ready, line)  # below PIPE_BUF: all or nothing
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.001)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the channel open for a use of its descriptors; ChannelClosedError once closed."""
        with self._use_lock:
            if self.closed:
                raise ChannelClosedError(f"channel {self.folder}: closed, nothing written")
            yield

    def spool_room(self, nbytes: int) -> None:
        """ChannelFullError unless a spool file of ``nbytes`` fits beside the unread ones: their
        bytes stay within the ring's size (one file always fits when none is unread). Called
        within in_use()."""
        for name in list(self._spooled):
            try:
                os.stat(name, dir_fd=self._folder_fd, follow_symlinks=False)
            except FileNotFoundError:
                del self._spooled[name]  # read (the reader removes what it read)
        held = sum(self._spooled.values())
        limit = self._map.granules * GRANULE
        if self._spooled and held + nbytes > limit:
            raise ChannelFullError(
                f"channel {self.folder}: expected its client to read its results, found the "
                f"ring full and {len(self._spooled)} spool files of {held} bytes unread (at "
                f"most the ring's {limit} bytes)"
            )

    def spooled(self, name: str, nbytes: int) -> None:
        """A spool file of ``nbytes`` written (not yet announced or read)."""
        self._spooled[name] = nbytes

    def close(self, remove_unread: bool = False) -> None:
        """Close the channel's descriptors; ``remove_unread``: first remove the spool files its
        reader never read (a client that went away or stopped reading)."""
        try:
            if not self.closed:
                self._send_timings(force=True)
        except OSError:
            pass  # a reader gone or stalled: the timings go nowhere
        finally:
            with self._use_lock:
                if not self.closed:
                    self.closed = True
                    if remove_unread:
                        for name in self._spooled:
                            with contextlib.suppress(OSError):
                                os.unlink(name, dir_fd=self._folder_fd)
                    self._spooled.clear()
                    os.close(self._ready)
                    os.close(self._folder_fd)


class RingReader:
    """hsx's side: creates the ring and the FIFO, reads announcements, hands out rows as tensors
    whose granules return to the ring when the last view of them is gone."""

    def __init__(self, spool_dir: str, capacity_bytes: int) -> None:
        self.granules = ring_granules(capacity_bytes)
        path = Path(spool_dir) / RING_FILE
        with open(path, "wb") as handle:  # sparse: pages are allocated when first written
            handle.truncate(_map_bytes(self.granules) + self.granules * GRANULE)
        fifo = Path(spool_dir) / READY_FIFO
        os.mkfifo(fifo, 0o600)
        # Read and write: opening never waits for the engine process, and reads never see EOF
        # when it exits (an engine death is seen by the driver, a late file by the time limit).
        self._ready = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        self._map = _Mapping(path, self.granules)
        self._pending = b""

    def messages(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        """Announcements that arrived, waiting up to ``timeout_s`` for the first."""
        readable, _, _ = select.select([self._ready], [], [], timeout_s)
        if not readable:
            return
        try:
            chunk = os.read(self._ready, 1 << 16)
        except BlockingIOError:
            return
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if not line:
                continue
            message = json.loads(line)
            if "ping" in message:  # a server checking that this reader is alive
                continue
            if "timings" in message:  # the engine process's accumulators, as they stand
                if message.get("pid") == os.getpid():
                    continue  # an engine in this process: its stages are already here
                timings.replace(
                    {
                        f"engine:{name}": timings.Stage(float(s), int(c), int(b))
                        for name, (s, c, b) in message["timings"].items()
                    }
                )
                continue
            yield message

    def rows(self, message: dict[str, Any]) -> torch.Tensor:
        """The announced rows, in place in the ring (no copy)."""
        start, count = int(message["granule"]), int(message["granules"])
        if start < 0 or start + count > self.granules:
            raise RuntimeError(
                f"request {message.get('key')}: granules [{start}, {start + count}) outside the "
                f"ring's {self.granules}"
            )
        dtype = getattr(torch, str(message["dtype"]))
        shape = tuple(int(n) for n in message["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        # A fresh ndarray per request: torch keeps it alive as long as any view of the rows
        # lives, so its finalizer runs exactly when the granules are free to reuse.
        holder = self._map.base[start * GRANULE : start * GRANULE + nbytes].view()
        weakref.finalize(holder, _release, self._map.used, start, count)
        return torch.from_numpy(holder).view(dtype).view(shape)

    def in_use(self) -> int:
        """Granules held (by rows not yet released)."""
        return int(np.count_nonzero(self._map.used))

    def close(self) -> None:
        os.close(self._ready)


def _release(used: np.ndarray, start: int, count: int) -> None:
    used[start : start + count] = 0


def check_channel(folder: str, granules: int, secret: str, owners: OwnerRule) -> None:
    """ChannelRefusedError (ChannelOwnershipError: not the requesting client's) unless a
    request may have its rows written into ``folder``: a client's folder holding ``secret``,
    its ring of ``granules`` and its FIFO (each checked while it has its name: a client removes
    the names once the server holds them open). What the API server checks before the engine
    sees a request; the engine's RingWriter checks the same when it opens the channel."""
    folder_fd = open_channel_folder(folder, owners)
    try:
        check_secret(folder_fd, folder, secret, owners)
        for name, kind in ((RING_FILE, "file"), (READY_FIFO, "fifo")):
            try:
                # O_PATH: looked at, never opened for reading or writing (a FIFO's open has
                # effects); a link opens as itself, and its kind refuses it.
                fd = open_in_channel(folder_fd, name, os.O_PATH, kind, owners)
            except ChannelRefusedError as exc:
                if isinstance(exc.__cause__, FileNotFoundError):
                    continue  # removed after the handshake: the server holds it open already
                raise
            try:
                found = os.fstat(fd).st_size
            finally:
                os.close(fd)
            expected = ring_file_bytes(granules)
            if kind == "file" and found != expected:
                raise ChannelRefusedError(
                    f"channel {folder}: expected a ring of {expected} bytes for granules="
                    f"{granules}, found {found} bytes"
                )
    finally:
        os.close(folder_fd)
