"""A channel of `hsx serve` as the server's engine holds it (hsx.engine.result_ring.RingWriter):
opened only with its client's secret, never written once given up (not even through a
descriptor number reused since), a stalled reader given up within a quarter second, and the
spool files of a client that does not read bounded by its ring and removed when it is given up.
Real folders, rings, FIFOs and files."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hsx.engine.channel_files import SECRET_FILE, ChannelOwnershipError, write_secret
from hsx.engine.copier import write_spool_file
from hsx.engine.result_ring import (
    ChannelClosedError,
    ChannelFullError,
    ChannelRefusedError,
    RingReader,
    RingWriter,
    ring_granules,
)
from hsx.engine.server_protocol import CHANNEL_PREFIX
from hsx.engine.shm_folders import make_owned_folder

pytestmark = pytest.mark.timeout(60)

CAPACITY = 4 << 16  # four granules: 256 KiB


@pytest.fixture
def channel() -> Iterator[tuple[str, str, RingReader]]:
    """A client's channel whose reader never reads: folder, secret, the reader's side."""
    folder = make_owned_folder(CHANNEL_PREFIX)
    secret = write_secret(folder)
    reader = RingReader(folder, CAPACITY)
    yield folder, secret, reader
    reader.close()
    shutil.rmtree(folder, ignore_errors=True)


def _writer(folder: str, secret: str | None) -> RingWriter:
    return RingWriter(folder, ring_granules(CAPACITY), nonblocking=True, secret=secret)


def test_a_channel_opens_only_with_its_secret(channel: tuple[str, str, RingReader]) -> None:
    folder, secret, _ = channel
    assert oct(os.stat(Path(folder) / SECRET_FILE).st_mode & 0o777) == "0o600"
    _writer(folder, secret).close()
    with pytest.raises(ChannelOwnershipError, match="belongs to another client"):
        _writer(folder, "0" * 64)
    os.unlink(Path(folder) / SECRET_FILE)
    with pytest.raises(ChannelOwnershipError, match="channel file secret: expected a file"):
        _writer(folder, secret)


def test_a_ring_of_another_size_is_refused_not_fatal(
    channel: tuple[str, str, RingReader],
) -> None:
    folder, secret, _ = channel
    with pytest.raises(ChannelRefusedError, match=r"expected 135168 bytes for 2 granules"):
        RingWriter(folder, 2, nonblocking=True, secret=secret)


def test_a_closed_channel_writes_nothing_not_even_to_a_reused_descriptor(
    channel: tuple[str, str, RingReader], tmp_path: Path
) -> None:
    folder, secret, _ = channel
    writer = _writer(folder, secret)
    writer.close()
    bystander = tmp_path / "bystander"
    with bystander.open("wb") as handle:  # likely the FIFO's old descriptor number
        for _ in range(3):
            with pytest.raises(ChannelClosedError, match="closed, nothing written"):
                writer.announce_error("k", RuntimeError("late"))
        handle.flush()
    assert bystander.read_bytes() == b""
    writer.close()  # twice: nothing


def test_a_reader_that_never_reads_is_given_up_within_a_quarter_second(
    channel: tuple[str, str, RingReader],
) -> None:
    folder, secret, _ = channel
    writer = _writer(folder, secret)
    sent = 0
    with pytest.raises(BlockingIOError):
        while True:  # the FIFO holds some hundreds of announcements
            started = time.monotonic()
            writer.announce_error(f"k{sent}", RuntimeError("x" * 100))
            sent += 1
    waited = time.monotonic() - started
    assert 100 < sent < 5000 and 0.2 < waited < 1.0, (sent, waited)
    writer.close(remove_unread=True)


def test_spool_files_of_a_client_that_does_not_read_are_bounded_and_removed(
    channel: tuple[str, str, RingReader],
) -> None:
    folder, secret, _ = channel
    writer = _writer(folder, secret)
    rows = torch.ones(64, 4, 64)  # 64 KiB a file: four fit beside a ring of 256 KiB
    written = []
    with pytest.raises(ChannelFullError, match=r"found the ring full and 4 spool files of 262144"):
        for i in range(10):
            writer.spool_room(rows.nbytes)
            path = write_spool_file(folder, f"k{i}", rows, writer.folder_fd)
            writer.spooled(path.name, rows.nbytes)
            written.append(path)
    assert len(written) == 4
    written[0].unlink()  # the reader reads one (and removes it): room for one more
    writer.spool_room(rows.nbytes)
    writer.close(remove_unread=True)
    assert not any(p.exists() for p in written)
    assert sorted(p.name for p in Path(folder).iterdir()) == ["ready.fifo", "ring", SECRET_FILE]
