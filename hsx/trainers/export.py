"""Exporting a store into a trainer's own files: planned once, cut into units (one per committed
work chunk of the store), each unit written file by file atomically and then recorded; a
manifest with every file's checksum written last.

On disk, under the export's root ``OUT``:

    .hsx-export/plan.json              what the export was asked (refused on change, resume)
    .hsx-export/begun/unit-000012      unit 12 was begun (written before its first file)
    .hsx-export/parts/unit-000012.json the files of unit 12 with their xxh3-128 and size
    hsx-export.json                    the manifest: written last, only when every unit is
    <the trainer's files>

A unit without its record is written again; a file already there whose bytes equal what would be
written is kept (files are written under a temporary name and renamed, so one that exists is
whole): a killed export loses nothing and rewrites nothing whole. Only a unit begun before is
checked file by file: a first attempt writes without asking what is there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from hsx.errors import ConfigError, StoreError
from hsx.plan.building import code_version
from hsx.store.checksums import ALGORITHM
from hsx.store.reader import HiddenStatesReader
from hsx.store.storage_io import create_once, store_io, write_atomic
from hsx.store.zarr_store import fs_and_root
from hsx.trainers.final_norm import FinalNorm, load_final_norm, store_model_folder
from hsx.trainers.formats import ExportFile, TrainerFormat, trainer_format

logger = logging.getLogger(__name__)

MANIFEST = "hsx-export.json"
STATE = ".hsx-export"
EXPORT_SCHEMA = 1
_GROUP_BYTES = 256 << 20  # states of the samples read together (each object once)


@dataclass(frozen=True)
class ExportUnit:
    """One committed work chunk's samples, at consecutive positions of the export."""

    index: int
    samples: tuple[int, ...]  # store sample indices
    first_position: int


@dataclass
class ExportPlan:
    out: str
    store: str
    format: str
    model: str | None
    units: list[ExportUnit]
    left_out: dict[int, str]  # sample -> why it is not exported
    inputs: dict[str, Any]  # frozen: a resume with other inputs is refused

    @property
    def positions(self) -> list[int]:
        """Store sample index of each export position, in order."""
        return [sample for unit in self.units for sample in unit.samples]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "left_out": {str(k): v for k, v in self.left_out.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportPlan:
        units = [
            ExportUnit(
                int(u["index"]), tuple(int(s) for s in u["samples"]), int(u["first_position"])
            )
            for u in data["units"]
        ]
        left_out = {int(k): str(v) for k, v in data["left_out"].items()}
        return cls(
            data["out"],
            data["store"],
            data["format"],
            data["model"],
            units,
            left_out,
            data["inputs"],
        )


@dataclass
class UnitResult:
    unit: int
    files_written: int = 0
    files_kept: int = 0  # already there, whole and equal
    bytes_written: int = 0
    skipped: bool = False  # its record and every file checked out: nothing done


@dataclass
class ExportVerifyReport:
    out: str
    files: int = 0
    bytes_read: int = 0
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    complete: bool = True  # False: no manifest (the export never finished)
    missing_units: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.complete and not self.missing and not self.mismatched

    def summary(self) -> str:
        if not self.complete:
            return (
                f"INCOMPLETE: no {MANIFEST} (the export did not finish); "
                f"{len(self.missing_units)} units not written"
            )
        if self.ok:
            return f"OK: {self.files} files verified ({self.bytes_read / 1e6:,.1f} MB read)"
        return (
            f"FAILED: {self.files} files listed, {len(self.missing)} missing, "
            f"{len(self.mismatched)} with mismatches"
        )


def parse_samples(value: str | None) -> tuple[int, int | None]:
    """``START:END`` (either side may be empty) -> (start, end or None)."""
    if value is None or value.strip() in ("", ":"):
        return 0, None
    start, sep, end = value.partition(":")
    try:
        if not sep:
            raise ValueError(value)
        first = int(start) if start.strip() else 0
        last = int(end) if end.strip() else None
    except ValueError:
        raise ConfigError(
            f"--samples: expected START:END of sample indices (e.g. 0:1000, 500:), found {value!r}"
        ) from None
    if first < 0 or (last is not None and last <= first):
        raise ConfigError(f"--samples: expected 0 <= START < END, found {value!r}")
    return first, last


def _digest(payload: bytes | memoryview) -> str:
    import xxhash

    return str(xxhash.xxh3_128(payload).hexdigest())


class Exporter:
    """One export (see the module docstring): built once where the export starts and passed to
    every unit; holds the store's reader, the trainer's format and, where it needs one, the
    model's final norm."""

    def __init__(self, plan: ExportPlan) -> None:
        self.plan = plan
        self.reader = HiddenStatesReader(plan.store)
        meta = self.reader.store.meta
        num_layers = int(meta["model"]["num_hidden_layers"])
        self.format: TrainerFormat = trainer_format(plan.format, self.reader.layer_ids, num_layers)
        self.norm: FinalNorm | None = None
        if self.format.needs_final_norm:
            self.norm = _final_norm_of(plan.model, meta)
        self.fs, self.root = fs_and_root(plan.out)

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    # -- files --------------------------------------------------------------------------------
    def _existing_digest(self, relative: str, size: int) -> str | None:
        """The digest of the file at ``relative`` when it exists with ``size`` bytes."""
        path = self.path(relative)
        try:
            found = store_io(self.fs, self.plan.out, path, "check", lambda: self.fs.size(path))
        except FileNotFoundError:
            return None
        if found != size:
            return None
        data = store_io(self.fs, self.plan.out, path, "read", lambda: self.fs.cat_file(path))
        return _digest(data)

    def write_file(
        self, file: ExportFile, result: UnitResult, maybe_there: bool = True
    ) -> dict[str, Any]:
        """Write ``file`` unless, where it may already be there (``maybe_there``), a whole copy
        with its bytes is."""
        digest = _digest(file.payload)
        if maybe_there and self._existing_digest(file.path, len(file.payload)) == digest:
            result.files_kept += 1  # whole (renamed into place) and equal: not rewritten
        else:
            write_atomic(self.fs, self.path(file.path), file.payload, store=self.plan.out)
            result.files_written += 1
            result.bytes_written += len(file.payload)
        return {"bytes": len(file.payload), ALGORITHM: digest}

    def _part_path(self, unit: int) -> str:
        return self.path(f"{STATE}/parts/unit-{unit:06d}.json")

    def _begin(self, unit: int) -> bool:
        """Mark the unit as begun; True when an earlier attempt had begun it (its files may be
        there, whole or not). A first attempt skips a size check per file: one request a unit,
        not one a file, on an object store (a HEAD per file cost 0.72 of a raw copy on S3)."""
        path = self.path(f"{STATE}/begun/unit-{unit:06d}")
        # One request; not fsynced (a marker lost to a crash makes the next attempt check
        # nothing: the files it finds are rewritten, whole or not, never taken as done).
        return not create_once(self.fs, path, b"begun", store=self.plan.out, durable=False)

    def read_part(self, unit: int) -> dict[str, Any] | None:
        path = self._part_path(unit)
        try:
            data = store_io(self.fs, self.plan.out, path, "read", lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        try:
            return dict(json.loads(data))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # torn by a crash of an older writer: the unit is written again

    def _part_checks_out(self, part: dict[str, Any]) -> bool:
        return all(
            self._existing_digest(relative, int(entry["bytes"])) == entry[ALGORITHM]
            for relative, entry in part["files"].items()
        )

    # -- units ---------------------------------------------------------------------------------
    def export_unit(self, index: int) -> UnitResult:
        """Write one unit's files (those not already there and equal), then its record."""
        unit = self.plan.units[index]
        result = UnitResult(unit.index)
        part = self.read_part(unit.index)
        if part is not None and self._part_checks_out(part):
            result.skipped = True
            return result
        files: dict[str, dict[str, Any]] = {}
        position = unit.first_position
        again = part is not None or self._begin(unit.index)
        for group in self._read_groups(unit.samples):
            # Each storage object of the group read once (a sample's rows rarely fill one).
            for sample in self.reader.samples(group):
                for file in self.format.sample_files(sample, position, self.norm):
                    entry = self.write_file(file, result, maybe_there=again)
                    files[file.path] = {**entry, "sample": sample.index}
                position += 1
        record = {"unit": unit.index, "samples": list(unit.samples), "files": files}
        write_atomic(
            self.fs,
            self._part_path(unit.index),
            json.dumps(record, sort_keys=True).encode(),
            durable=True,
            store=self.plan.out,
        )
        return result

    def _read_groups(self, samples: tuple[int, ...]) -> list[list[int]]:
        """Consecutive samples in groups of at most _GROUP_BYTES of states (memory bound)."""
        row_bytes = len(self.reader.layer_ids) * self.reader.hidden_size * 4
        _, lengths = self.reader.store.sample_rows(0, self.reader.num_samples)
        groups: list[list[int]] = [[]]
        held = 0
        for sample in samples:
            size = int(lengths[sample]) * row_bytes
            if groups[-1] and held + size > _GROUP_BYTES:
                groups.append([])
                held = 0
            groups[-1].append(sample)
            held += size
        return [group for group in groups if group]

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Every unit recorded: the trainer's index files, then the manifest (last)."""
        parts = {unit.index: self.read_part(unit.index) for unit in self.plan.units}
        missing = sorted(index for index, part in parts.items() if part is None)
        if missing:
            raise StoreError(
                f"export {self.plan.out}: expected every unit written before the manifest, found "
                f"{len(missing)} missing (units {missing[:20]}); re-run the export"
            )
        files: dict[str, dict[str, Any]] = {}
        for part in parts.values():
            files.update((part or {})["files"])
        result = UnitResult(-1)
        for file in self.index_files():
            files[file.path] = self.write_file(file, result)
        manifest = {
            "schema_version": EXPORT_SCHEMA,
            "hsx_code_version": code_version(),
            "created_at": datetime.now(UTC).isoformat(),
            **self.format.describe(),
            "final_norm": None if self.norm is None else self.norm.source,
            "store": self.plan.store,
            "inputs": self.plan.inputs,
            "samples": len(self.plan.positions),
            "sample_of_position": self.plan.positions,
            "left_out": {str(k): v for k, v in sorted(self.plan.left_out.items())},
            "checksum_algorithm": ALGORITHM,
            "files": dict(sorted(files.items())),
        }
        write_atomic(
            self.fs,
            self.path(MANIFEST),
            json.dumps(manifest, indent=1).encode(),
            durable=True,
            store=self.plan.out,
        )
        return manifest

    def index_files(self) -> list[ExportFile]:
        """Files that index the samples (speculators: its dataset and token_freq.pt)."""
        if self.format.name != "speculators":
            return []
        from hsx.trainers.speculators_index import dataset_files
        from hsx.trainers.vocab import token_freq_file

        positions = self.plan.positions
        return [*dataset_files(self.reader, positions), token_freq_file(self.reader, positions)]


def _final_norm_of(model: str | None, meta: dict[str, Any]) -> FinalNorm:
    """The final norm of the store's model: ``model`` or the folder the store names; its
    config must be the one the store was extracted with."""
    folder, config = store_model_folder(model, meta, "export")
    return load_final_norm(folder, config)


def plan_export(
    store: str,
    out: str,
    format_name: str,
    model: str | None = None,
    samples: str | None = None,
    unit_samples: int = 0,
) -> ExportPlan:
    """The export's plan, checked against what an earlier run of the same export froze."""
    reader = HiddenStatesReader(store)
    meta = reader.store.meta
    fmt = trainer_format(format_name, reader.layer_ids, int(meta["model"]["num_hidden_layers"]))
    start, end = parse_samples(samples)
    end = reader.num_samples if end is None else min(end, reader.num_samples)
    if start >= end:
        raise ConfigError(
            f"--samples: expected a range within the store's {reader.num_samples} samples, "
            f"found {start}:{end}"
        )
    norm_source = None
    if fmt.needs_final_norm:
        norm_source = _final_norm_of(model, meta).source  # fails here, before any file
    usable = set(reader.available_samples.tolist())
    left_out: dict[int, str] = {}
    units: list[ExportUnit] = []
    position = 0
    for chunk in reader.store.work_chunks:
        lo, hi = max(chunk.sample_start, start), min(chunk.sample_end, end)
        chosen = []
        for sample in range(lo, hi):
            if sample in usable:
                chosen.append(sample)
            else:
                left_out[sample] = reader.skipped_samples.get(
                    sample, "its work chunk is not committed"
                )
        for begin in range(0, len(chosen), unit_samples or max(len(chosen), 1)):
            part = tuple(chosen[begin : begin + (unit_samples or len(chosen))])
            units.append(ExportUnit(len(units), part, position))
            position += len(part)
    if position == 0:
        raise StoreError(
            f"export: expected committed samples in {store} within {start}:{end}, found none"
        )
    inputs = {
        "format": fmt.name,
        "store_plan_hash": meta["plan_hash"],
        "samples": [start, end],
        # Which samples, in which units: a store committed further since is another export.
        "exported": _digest(json.dumps([list(u.samples) for u in units]).encode()),
        "final_state": fmt.final_state,
        "final_norm": norm_source,
        "layer_ids_vllm": list(reader.layer_ids),
    }
    plan = ExportPlan(out, store, fmt.name, model, units, left_out, inputs)
    _freeze(plan)
    return plan


def _freeze(plan: ExportPlan) -> None:
    """Write the plan at the export's root, or check it against the one there."""
    fs, root = fs_and_root(plan.out)
    path = f"{root}/{STATE}/plan.json"
    try:
        stored = json.loads(store_io(fs, plan.out, path, "read", lambda: fs.cat_file(path)))
    except FileNotFoundError:
        stored = None
    if stored is not None:
        changed = [
            f"{key}: stored {stored['inputs'].get(key)!r}, this run {value!r}"
            for key, value in plan.inputs.items()
            if stored["inputs"].get(key) != value
        ]
        if changed:
            raise ConfigError(
                f"export {plan.out} was made with other inputs; a resume keeps them. Changed: "
                + "; ".join(changed)
                + ". Use another --out, or delete it to start over."
            )
        return
    write_atomic(fs, path, json.dumps(plan.to_json()).encode(), durable=True, store=plan.out)


def load_plan(out: str) -> ExportPlan:
    fs, root = fs_and_root(out)
    path = f"{root}/{STATE}/plan.json"
    try:
        return ExportPlan.from_json(
            json.loads(store_io(fs, out, path, "read", lambda: fs.cat_file(path)))
        )
    except FileNotFoundError:
        raise ConfigError(f"export {out}: expected {STATE}/plan.json, found none") from None


def is_export(url: str) -> bool:
    """Whether ``url`` is an hsx export (finished or not) rather than a store."""
    fs, root = fs_and_root(url)
    return bool(fs.exists(f"{root}/{MANIFEST}") or fs.exists(f"{root}/{STATE}/plan.json"))


def verify_export(
    out: str, readers: int | None = None, progress: Callable[[int], None] | None = None
) -> ExportVerifyReport:
    """Every file the manifest lists, re-read and hashed; an export without its manifest is
    INCOMPLETE (its missing units named)."""
    from concurrent.futures import ThreadPoolExecutor

    fs, root = fs_and_root(out)
    report = ExportVerifyReport(out)
    path = f"{root}/{MANIFEST}"
    try:
        manifest = json.loads(store_io(fs, out, path, "read", lambda: fs.cat_file(path)))
    except FileNotFoundError:
        report.complete = False
        exporter = Exporter(load_plan(out))
        report.missing_units = [
            unit.index for unit in exporter.plan.units if exporter.read_part(unit.index) is None
        ]
        return report
    listed: dict[str, dict[str, Any]] = manifest["files"]
    report.files = len(listed)

    def check(item: tuple[str, dict[str, Any]]) -> tuple[str, str | None, int]:
        relative, entry = item
        target = f"{root}/{relative}"
        try:
            data = store_io(fs, out, target, "read", lambda: fs.cat_file(target))
        except FileNotFoundError:
            return relative, "missing", 0
        if len(data) != int(entry["bytes"]):
            return relative, f"expected {entry['bytes']} bytes, found {len(data)}", len(data)
        found = _digest(data)
        if found != entry[ALGORITHM]:
            return relative, f"expected {ALGORITHM} {entry[ALGORITHM]}, found {found}", len(data)
        return relative, None, len(data)

    with ThreadPoolExecutor(readers or max(8, os.cpu_count() or 2)) as pool:
        for done, (relative, problem, nbytes) in enumerate(pool.map(check, listed.items()), 1):
            report.bytes_read += nbytes
            if problem == "missing":
                report.missing.append(relative)
            elif problem is not None:
                report.mismatched.append(f"{relative}: {problem}")
            if progress is not None:
                progress(done)
    return report
