"""What a request can make `hsx serve`'s engine write: only into a channel folder of a client it
serves, never through a link, never outside the folder. Real folders, links, FIFOs and owners
(root here changes a folder's owner the way another user's folder would be)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hsx.engine.channel_files import ChannelRefusedError, OwnerRule
from hsx.engine.copier import read_spool_file, write_spool_file
from hsx.engine.result_ring import READY_FIFO, RING_FILE, RingWriter, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.engine.server_protocol import CHANNEL_PREFIX, ChannelRequest, shm_folder
from hsx.engine.shm_folders import make_owned_folder, remove_orphans
from tests.conftest import missing_component

CAPACITY = 4 << 16  # four granules
NOBODY = 65534
VICTIM_TEXT = b"precious contents\n"
SECRET = "0" * 64


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[Path, ResultRendezvous]]:
    """A client's channel as ServerEngine makes one: its folder, ring and FIFO."""
    folder = tmp_path / f"{CHANNEL_PREFIX}test"
    folder.mkdir(mode=0o700)
    reader = ResultRendezvous(lambda key, n, rows: rows, spool_dir=str(folder), ring_bytes=CAPACITY)
    yield folder, reader
    reader.close()


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the server may write (it often runs as root) that no request may touch."""
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM_TEXT)
    return path


def _writer(folder: Path) -> RingWriter:
    return RingWriter(str(folder), ring_granules(CAPACITY), nonblocking=True)


def test_a_client_channel_is_opened_and_written(channel: tuple[Path, ResultRendezvous]) -> None:
    folder, _reader = channel
    writer = _writer(folder)
    rows = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)  # [tokens, K, H]
    path = write_spool_file(str(folder), "k1:abc", rows, writer.folder_fd)
    assert path == folder / "k1:abc.rows"
    assert torch.equal(read_spool_file(path), rows)
    writer.close()


def test_a_linked_channel_folder_is_refused(
    channel: tuple[Path, ResultRendezvous], tmp_path: Path
) -> None:
    folder, _reader = channel
    link = tmp_path / f"{CHANNEL_PREFIX}link"
    link.symlink_to(folder)
    with pytest.raises(ChannelRefusedError, match=r"expected a directory \(not a link\)"):
        _writer(link)


@pytest.mark.parametrize("name", [READY_FIFO, RING_FILE])
def test_a_linked_file_inside_a_channel_is_refused_and_its_target_untouched(
    channel: tuple[Path, ResultRendezvous], victim: Path, name: str
) -> None:
    folder, _reader = channel
    (folder / name).unlink()
    (folder / name).symlink_to(victim)
    with pytest.raises(ChannelRefusedError, match=f"channel file {name}: expected a "):
        _writer(folder)
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_fifo_replaced_by_a_plain_file_is_refused(
    channel: tuple[Path, ResultRendezvous],
) -> None:
    folder, _reader = channel
    (folder / READY_FIFO).unlink()
    (folder / READY_FIFO).write_bytes(b"")
    with pytest.raises(ChannelRefusedError, match=f"channel file {READY_FIFO}: not a fifo"):
        _writer(folder)


def test_a_folder_of_another_user_is_refused_unless_its_group_is_allowed(
    channel: tuple[Path, ResultRendezvous],
) -> None:
    if os.geteuid() != 0:
        missing_component("making a folder of another user needs root")
    folder, _reader = channel
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(ChannelRefusedError, match=f"owned by uid {NOBODY} gid {NOBODY}, expected"):
        _writer(folder)
    for name in (RING_FILE, READY_FIFO):
        os.chown(folder / name, NOBODY, NOBODY)
    allowed = OwnerRule.of_this_process([NOBODY])
    writer = RingWriter(str(folder), ring_granules(CAPACITY), nonblocking=True, owners=allowed)
    writer.close()


def test_a_folder_writable_by_others_is_refused(channel: tuple[Path, ResultRendezvous]) -> None:
    folder, _reader = channel
    folder.chmod(0o777)
    with pytest.raises(ChannelRefusedError, match=r"writable by others \(mode drwxrwxrwx\)"):
        _writer(folder)


def test_a_link_planted_under_a_spool_name_is_replaced_not_written_through(
    channel: tuple[Path, ResultRendezvous], victim: Path
) -> None:
    folder, _reader = channel
    writer = _writer(folder)
    (folder / "k2:abc.rows").symlink_to(victim)
    (folder / f"k2:abc.rows.tmp{os.getpid()}").symlink_to(victim)
    rows = torch.ones(3, 2, 4)
    with pytest.raises(FileExistsError):  # O_EXCL: the planted temporary name is not reused
        write_spool_file(str(folder), "k2:abc", rows, writer.folder_fd)
    path = write_spool_file(str(folder), "k2:abc", rows, writer.folder_fd)
    assert not path.is_symlink() and torch.equal(read_spool_file(path), rows)
    assert victim.read_bytes() == VICTIM_TEXT
    writer.close()


@pytest.mark.parametrize(
    "key", ["../../tmp/evil", "/root/x", "a/b", "", ".hidden", "-x", "k\x00", "k" * 201]
)
def test_a_key_that_is_not_a_plain_name_is_refused(key: str) -> None:
    folder = f"{shm_folder()}/{CHANNEL_PREFIX}x"
    with pytest.raises(ValueError, match=r"kv_transfer_params\.hsx\.key: expected letters"):
        ChannelRequest.from_params({"channel": folder, "granules": 4, "key": key, "secret": SECRET})


def test_a_channel_path_that_is_not_normal_or_a_huge_ring_is_refused() -> None:
    parent = shm_folder()
    for bad in (f"{parent}/{CHANNEL_PREFIX}x/../{CHANNEL_PREFIX}y", f"{parent}//{CHANNEL_PREFIX}x"):
        with pytest.raises(ValueError, match="expected a folder hsx-channel-"):
            ChannelRequest.from_params(
                {"channel": bad, "granules": 4, "key": "k", "secret": SECRET}
            )
    with pytest.raises(ValueError, match=r"granules: expected 1\.\.16777216, found 0"):
        ChannelRequest.from_params(
            {"channel": f"{parent}/{CHANNEL_PREFIX}x", "granules": 0, "key": "k", "secret": SECRET}
        )


def test_folders_of_killed_processes_are_removed_by_the_next_one() -> None:
    import subprocess
    import sys

    prefix = "hsx-test-orphans-"
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from hsx.engine.shm_folders import make_owned_folder as m; print(m({prefix!r}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(made).is_dir()  # the process ended without removing it (as a SIGKILL would)
    mine = make_owned_folder(prefix)
    try:
        assert not Path(made).exists()
        assert remove_orphans(prefix, shm_folder()) == []  # this process's own stays
        assert Path(mine).is_dir()
    finally:
        os.rmdir(mine)
