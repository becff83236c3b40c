"""Opening a client's channel folder in a server's engine without trusting its paths.

Under `hsx serve` a request names the folder the server writes rows into, and the server often
runs as a service user (root, on many GPU nodes). A request could name a folder that is a
symbolic link, or a folder whose ``ready.fifo`` or ring is a link to a file the server may
write: opened by path, the server would overwrite that file. So the folder is opened once
with ``O_NOFOLLOW | O_DIRECTORY`` and checked on the open descriptor (a directory, owned by the
server's user or an allowed group, not writable by others), every file in it is opened
relative to that descriptor with ``O_NOFOLLOW`` and checked for its kind and owner, and spool
files are created with ``O_EXCL`` and renamed within the folder (a rename replaces a link
planted under the final name; it never writes through it).

A channel belongs to the client that made it: the client writes a random secret into the folder
(``secret``, readable by its user alone) and sends it with every request that names the folder;
a request without it is refused (the folder's name is visible to every user in ``ls /dev/shm``).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
from collections.abc import Collection
from dataclasses import dataclass

# The client's secret: 32 random bytes as hex, in a file of this name in its channel folder.
SECRET_FILE = "secret"
SECRET_PATTERN = re.compile(r"[0-9a-f]{64}")
# A request key becomes a file name in the channel (KEY:DIGEST.rows): letters, digits and
# ``_.:-`` only, so that no key can name another folder ("../x", "/root/x").
KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")


class ChannelRefusedError(PermissionError):
    """A channel folder or a file in it that the server will not write into, and why."""


class ChannelOwnershipError(ChannelRefusedError):
    """A channel folder that is not the requesting client's: not a folder the server serves
    (a link, another user's, writable by others, gone), or a request without its secret. The
    channel stays usable by its own client."""


def key_problem(key: str) -> str | None:
    """What is wrong with a request key as a file-name part ("expected ..., found ..."), or None."""
    if KEY_PATTERN.fullmatch(key):
        return None
    from hsx.engine.log_safety import shown

    return (
        "expected letters, digits and _.:- (at most 200, not starting with . or -), found "
        f"{shown(key)}"
    )


def check_key(key: str) -> str:
    """``key`` when it is a plain file-name part, else ValueError naming what was expected."""
    problem = key_problem(key)
    if problem is not None:
        raise ValueError(f"kv_transfer_params.hsx.key: {problem}")
    return key


@dataclass(frozen=True)
class OwnerRule:
    """Whose folders and files the server accepts: its own user's, or those of an allowed
    group (clients running as other users of that group)."""

    uid: int
    gids: frozenset[int]

    @classmethod
    def of_this_process(cls, allowed_gids: Collection[int] = ()) -> OwnerRule:
        return cls(os.geteuid(), frozenset(int(g) for g in allowed_gids))

    def problem(self, status: os.stat_result) -> str | None:
        if status.st_uid != self.uid and status.st_gid not in self.gids:
            allowed = f" or group {sorted(self.gids)}" if self.gids else ""
            return (
                f"owned by uid {status.st_uid} gid {status.st_gid}, expected uid {self.uid}"
                f"{allowed} (the server's user)"
            )
        if status.st_mode & stat.S_IWOTH:
            return f"writable by others (mode {stat.filemode(status.st_mode)})"
        return None


def open_channel_folder(folder: str, owners: OwnerRule) -> int:
    """A descriptor of ``folder``, refused (ChannelRefusedError) when it is a link, not a
    directory, or owned by someone the server does not serve."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ChannelOwnershipError(
            f"channel {folder}: expected a directory (not a link) the server can open, "
            f"found {exc.strerror} (errno {exc.errno})"
        ) from exc
    problem = owners.problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise ChannelOwnershipError(f"channel {folder}: {problem}")
    return fd


_KINDS = {"file": stat.S_ISREG, "fifo": stat.S_ISFIFO}


def open_in_channel(folder_fd: int, name: str, flags: int, kind: str, owners: OwnerRule) -> int:
    """A descriptor of the existing file ``name`` in the channel, refused when it is a link,
    not of ``kind`` ('file' or 'fifo'), or not the client's."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError as exc:
        raise ChannelRefusedError(
            f"channel file {name}: expected a {kind} (not a link), found {exc.strerror} "
            f"(errno {exc.errno})"
        ) from exc
    status = os.fstat(fd)
    problem = None if _KINDS[kind](status.st_mode) else f"not a {kind}"
    problem = problem or owners.problem(status)
    if problem is not None:
        os.close(fd)
        raise ChannelRefusedError(f"channel file {name}: {problem}")
    return fd


def create_in_channel(folder_fd: int, name: str) -> int:
    """A new file ``name`` in the channel, for writing: never an existing file or link."""
    return os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o640,  # the group reads it where clients of an allowed group run as other users
        dir_fd=folder_fd,
    )


def write_secret(folder: str) -> str:
    """A new random secret in ``folder`` (the client's channel), readable by this user alone:
    the client sends it with every request that names the folder."""
    secret = secrets.token_hex(32)
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(
            SECRET_FILE,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=folder_fd,
        )
        try:
            os.write(fd, secret.encode())
        finally:
            os.close(fd)
    finally:
        os.close(folder_fd)
    return secret


def check_secret(folder_fd: int, folder: str, secret: str, owners: OwnerRule) -> None:
    """ChannelRefusedError unless the channel's secret file is its client's (a plain file, not
    a link, readable by no one else) and holds ``secret``."""
    try:
        fd = open_in_channel(folder_fd, SECRET_FILE, os.O_RDONLY, "file", owners)
    except ChannelRefusedError as exc:
        raise ChannelOwnershipError(
            f"channel {folder}: {exc} (its client writes its secret there and sends it with "
            "every request)"
        ) from exc
    try:
        mode = os.fstat(fd).st_mode
        if mode & stat.S_IROTH:
            raise ChannelOwnershipError(
                f"channel {folder}: its {SECRET_FILE} file is readable by others (mode "
                f"{stat.filemode(mode)}), expected it readable by its client alone"
            )
        found = os.read(fd, 128).strip()
    finally:
        os.close(fd)
    if not hmac.compare_digest(found, secret.encode()):
        raise ChannelOwnershipError(
            f"channel {folder} belongs to another client: expected the secret its client wrote "
            f"in {SECRET_FILE}, found another"
        )
