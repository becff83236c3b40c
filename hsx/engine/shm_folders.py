"""Folders hsx makes in this node's shared memory (an engine's spool, a client's channel), named
so that those of a killed process can be found and removed by the next one.

A folder is ``PREFIX{host}-{pid}-{random}``: a process that ends normally removes its own; one
killed (SIGKILL, the kernel's OOM killer) leaves it, with its ring of up to GiBs, until the next
hsx process on the same host makes a folder of the same prefix and finds that pid gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile

import xxhash

from hsx.engine.server_protocol import shm_folder

logger = logging.getLogger(__name__)


def _host_tag() -> str:
    # The host's name, hashed: pids mean something only on the host (container) that made them.
    return xxhash.xxh32_hexdigest(socket.gethostname().encode())


def make_owned_folder(prefix: str) -> str:
    """A new folder for this process under shm_folder(), after removing orphans of ``prefix``."""
    parent = shm_folder()
    remove_orphans(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{_host_tag()}-{os.getpid()}-", dir=parent)


def remove_orphans(prefix: str, parent: str) -> list[str]:
    """Remove this host's folders of ``prefix`` in ``parent`` whose process is gone and that
    this user owns; the paths removed."""
    pattern = re.compile(re.escape(f"{prefix}{_host_tag()}-") + r"(\d+)-")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(parent):
            match = pattern.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            if _alive(int(match.group(1))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    if removed:
        logger.info("removed %d folder(s) of processes that are gone: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
