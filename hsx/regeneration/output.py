"""Writing a regenerated dataset (layout: hsx.data.regenerated): the manifest created once with
the run's frozen inputs (a resume with other inputs is refused, naming each), each chunk's rows
written atomically and then its commit record created once (put-if-absent: of two attempts at
one chunk, one commits), and a verify of every committed part against its digest."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import fsspec.core
import xxhash

from hsx.data.regenerated import (
    COMMITS_DIR,
    DATA_DIR,
    FORMAT_NAME,
    MANIFEST,
    committed_parts,
    part_file,
    part_name,
    read_commit,
)
from hsx.errors import StoreError
from hsx.store.storage_io import create_once, store_io, write_atomic

MANIFEST_VERSION = 1


class RegenerationMismatchError(StoreError):
    """A resume whose frozen inputs differ from the ones the output was started with."""


@dataclass(frozen=True)
class PartCommit:
    """A chunk's commit record: what its part holds and how it was made."""

    index: int
    conversations: int  # rows read from the dataset for this chunk
    rows: int  # rows written (the others failed or were dropped, listed below)
    generated_tokens: int
    xxh3: str  # of the part's bytes
    nbytes: int
    seconds: float
    failed: list[dict[str, Any]]  # {"id", "error"}
    dropped: list[dict[str, Any]]  # {"id", "reason"}
    finish_reasons: dict[str, int]
    run_id: str
    attempt: int  # of the chunk's task (2 after one retry)
    finished_at: float
    part: str = ""  # the part file's name in data/, chosen by write_part
    flow_run_attempt: int = 1  # of the flow run (2 after a Retry from the UI)

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()


class RegeneratedOutput:
    """One regenerated dataset being written (a local folder or an fsspec URL)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")

    def _io(self, path: str, action: str, call: Any) -> Any:
        return store_io(self.fs, self.url, path, action, call)

    def open_or_create(self, frozen: dict[str, Any], chunks: int, conversations: int) -> None:
        """Create the manifest, or check this run's frozen inputs against the existing one."""
        manifest = {
            "format": FORMAT_NAME,
            "version": MANIFEST_VERSION,
            "chunks": chunks,
            "conversations": conversations,
            "frozen_inputs": frozen,
            "created_at": time.time(),
        }
        path = f"{self.root}/{MANIFEST}"
        self._io(self.root, "create", lambda: self.fs.makedirs(self.root, exist_ok=True))
        if create_once(self.fs, path, json.dumps(manifest, indent=1).encode(), store=self.url):
            return
        stored = json.loads(self._io(path, "read", lambda: self.fs.cat_file(path)))
        was = stored.get("frozen_inputs", {})
        changed = [
            f"{key}: stored {was.get(key)!r}, this run {frozen.get(key)!r}"
            for key in sorted(set(was) | set(frozen))
            if was.get(key) != frozen.get(key)
        ]
        if stored.get("chunks") != chunks:
            changed.append(f"chunks: stored {stored.get('chunks')}, this run {chunks}")
        if changed:
            raise RegenerationMismatchError(
                f"{self.url} was regenerated with other inputs; a resume must generate the same "
                "data. Changed: " + "; ".join(changed) + ". Use a new --out, or delete this one "
                "to start over."
            )

    def committed_indices(self) -> set[int]:
        """The chunks with a commit record (one listing, no record read)."""
        return set(self._io(self.root, "list", lambda: committed_parts(self.fs, self.root)))

    def is_committed(self, index: int) -> bool:
        path = self._commit_path(index)
        return bool(self._io(path, "check", lambda: self.fs.exists(path)))

    def committed(self) -> dict[int, dict[str, Any]]:
        return {
            index: self._io(
                self._commit_path(index), "read", lambda i=index: read_commit(self.fs, self.root, i)
            )
            for index in sorted(committed_parts(self.fs, self.root))
        }

    def committed_by(self, run_id: str, flow_run_attempt: int) -> list[dict[str, Any]]:
        """The commit records one attempt of one flow run wrote: a stopped run counts what it
        committed from these, since a chunk in flight at the stop may have committed all the
        same. (Records written before the field existed count as a first attempt.)"""
        return [
            record
            for record in self.committed().values()
            if record.get("run_id") == run_id
            and int(record.get("flow_run_attempt", 1)) == flow_run_attempt
        ]

    def _commit_path(self, index: int) -> str:
        return f"{self.root}/{COMMITS_DIR}/{part_name(index)}.json"

    def write_part(self, index: int, payload: bytes, commit: PartCommit) -> bool:
        """The part's rows (atomically, in a file of this attempt's own), then its commit
        record naming that file, created once. False when another attempt committed the chunk:
        its record and its part stand, this attempt's file is removed."""
        if self.is_committed(index):
            return False
        return self.write_and_commit(index, payload, commit)

    def write_and_commit(self, index: int, payload: bytes, commit: PartCommit) -> bool:
        """write_part past its committed check (what an attempt that lost the race to a commit
        made after that check does)."""
        for folder in (DATA_DIR, COMMITS_DIR):
            path = f"{self.root}/{folder}"
            self._io(path, "create", lambda p=path: self.fs.makedirs(p, exist_ok=True))
        commit = replace(commit, part=f"{part_name(index)}.{uuid.uuid4().hex[:12]}.jsonl")
        part = f"{self.root}/{DATA_DIR}/{commit.part}"
        write_atomic(self.fs, part, payload, store=self.url)
        if create_once(self.fs, self._commit_path(index), commit.to_json(), store=self.url):
            return True
        self._io(part, "delete", lambda: self.fs.rm(part))
        return False

    def verify(self) -> list[str]:
        """Problems of the committed parts: a missing part or one whose bytes changed."""
        problems = []
        for index, record in self.committed().items():
            path = f"{self.root}/{DATA_DIR}/{part_file(index, record)}"
            try:
                data = self._io(path, "read", lambda p=path: self.fs.cat_file(p))
            except Exception as exc:
                problems.append(f"{part_name(index)}: expected its rows, found {exc!r}")
                continue
            digest = xxhash.xxh3_128_hexdigest(data)
            if digest != record["xxh3"]:
                problems.append(
                    f"{part_name(index)}: expected xxh3 {record['xxh3']}, found {digest}"
                )
        return problems

    def part_path(self, index: int) -> str:
        """The committed part file of chunk ``index`` (its commit record names it)."""
        record = self._io(
            self._commit_path(index), "read", lambda: read_commit(self.fs, self.root, index)
        )
        return f"{self.root}/{DATA_DIR}/{part_file(index, record)}"


def part_digest(payload: bytes) -> str:
    return str(xxhash.xxh3_128_hexdigest(payload))
