"""Local object writes: atomic, with O_DIRECT where the file system and the buffer allow it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from hsx.store import local_io
from hsx.store.local_io import DIRECT_ALIGNMENT, aligned_empty, write_local_atomic

pytestmark = pytest.mark.timeout(60)


def _supports_direct(folder: Path) -> bool:
    probe = folder / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return True


@pytest.mark.parametrize("shape", [(1,), (7, 3), (256, 4, 33)])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_aligned_empty_is_aligned_contiguous_and_sized(shape: tuple[int, ...], dtype: str) -> None:
    array = aligned_empty(shape, np.dtype(dtype))
    assert array.ctypes.data % DIRECT_ALIGNMENT == 0
    assert array.shape == shape and array.dtype == np.dtype(dtype)
    assert array.flags.c_contiguous and array.flags.writeable


def test_direct_write_is_used_where_supported_and_bytes_are_exact(tmp_path: Path) -> None:
    if not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    payload = aligned_empty((4 * DIRECT_ALIGNMENT,), np.dtype("uint8"))
    payload[:] = np.random.default_rng(0).integers(0, 256, payload.size, dtype=np.uint8)
    target = tmp_path / "objects" / "c.0"
    assert write_local_atomic(str(target), memoryview(payload), direct=True) is True
    assert target.read_bytes() == payload.tobytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["c.0"]  # no temp file left


def test_unaligned_payload_falls_back_to_a_buffered_write(tmp_path: Path) -> None:
    buffer = aligned_empty((DIRECT_ALIGNMENT + 1,), np.dtype("uint8"))
    buffer[:] = 7
    target = tmp_path / "c.1"
    # Length not a multiple of the alignment, then an address off the alignment.
    assert write_local_atomic(str(target), memoryview(buffer), direct=True) is False
    assert target.read_bytes() == buffer.tobytes()
    assert write_local_atomic(str(target), memoryview(buffer[1:]), direct=True) is False
    assert target.read_bytes() == buffer[1:].tobytes()


def test_file_system_without_direct_io_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file system that refuses O_DIRECT (older tmpfs, some FUSE and network mounts) cannot be
    # had here (this kernel's tmpfs accepts it): refuse it the way Linux does, after creating the
    # file, with EINVAL.
    real_open = os.open
    refused: list[str] = []

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            refused.append(os.path.basename(path))
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(local_io, "_NO_DIRECT", set())
    payload = aligned_empty((DIRECT_ALIGNMENT,), np.dtype("uint8"))
    payload[:] = 3
    for name in ("c.0", "c.1"):
        assert write_local_atomic(str(tmp_path / name), memoryview(payload), direct=True) is False
        assert (tmp_path / name).read_bytes() == payload.tobytes()
    assert len(refused) == 1  # the refusal is remembered for the device
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.0", "c.1"]  # no temp file left


def test_durable_write_replaces_an_existing_object(tmp_path: Path) -> None:
    target = tmp_path / "commit.json"
    write_local_atomic(str(target), memoryview(b"old"), durable=True)
    write_local_atomic(str(target), memoryview(b'{"new": true}'), durable=True)
    assert target.read_bytes() == b'{"new": true}'
