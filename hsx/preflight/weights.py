"""Weights preflight: every shard present, every safetensors header readable, sizes consistent.

Reads only headers (an 8-byte little-endian length, then that many bytes of JSON) and file sizes:
no torch, no tensor data, seconds even for a 1 TB checkpoint. The safetensors layout:

    [u64 LE header_len][header JSON: {name: {dtype, shape, data_offsets: [begin, end]}, ...}][data]

where offsets are relative to the start of the data section, so a complete file is exactly
``8 + header_len + max(end)`` bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.preflight.report import CheckResult, Status
from hsx.preflight.resources import GIB, estimate_weight_bytes

INDEX_NAME = "model.safetensors.index.json"
# why: a real header is at most tens of MiB; a larger "length" means a corrupt or foreign file.
_MAX_HEADER_BYTES = 256 * 1024**2
# Stored bits per element of every dtype safetensors defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
# why: an estimate from config.json is rough (quantisation scales, unlisted buffers).
_ESTIMATE_TOLERANCE = 0.25
_MAX_LISTED = 5


class ShardError(ValueError):
    """A safetensors shard is unreadable, truncated or inconsistent (names the file)."""


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    header_len: int
    tensors: dict[str, dict[str, Any]]  # name -> {dtype, shape, data_offsets}
    data_bytes: int  # max end offset: bytes the data section must hold
    file_bytes: int

    @property
    def expected_file_bytes(self) -> int:
        return 8 + self.header_len + self.data_bytes


def read_header(path: Path) -> ShardHeader:
    """Parse one shard's header and validate dtypes, shapes and offsets against the file size."""
    file_bytes = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardError(
                f"{path.name}: expected >= 8 bytes (header length); found {file_bytes} bytes"
            )
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER_BYTES, file_bytes - 8):
            raise ShardError(
                f"{path.name}: header length {header_len:,} does not fit: expected <= "
                f"{min(_MAX_HEADER_BYTES, file_bytes - 8):,}; found file of {file_bytes:,} bytes "
                "(truncated, or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(f"{path.name}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ShardError(
            f"{path.name}: expected a JSON object header; found {type(header).__name__}"
        )
    header.pop("__metadata__", None)
    data_bytes = 0
    for name, info in header.items():
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise ShardError(
                f"{path.name}: tensor {name!r}: expected a dtype in {sorted(DTYPE_BITS)}; "
                f"found {dtype!r}"
            )
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ShardError(
                f"{path.name}: tensor {name!r}: expected a shape of ints; found {shape!r}"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
            raise ShardError(
                f"{path.name}: tensor {name!r}: expected data_offsets [begin, end]; found {offsets!r}"
            )
        size = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
        if offsets[1] - offsets[0] != size:
            raise ShardError(
                f"{path.name}: tensor {name!r} ({dtype} {shape}): expected {size:,} bytes; "
                f"found offsets spanning {offsets[1] - offsets[0]:,}"
            )
        data_bytes = max(data_bytes, offsets[1])
    shard = ShardHeader(path, header_len, header, data_bytes, file_bytes)
    if shard.expected_file_bytes != file_bytes:
        state = "truncated" if file_bytes < shard.expected_file_bytes else "has trailing bytes"
        raise ShardError(
            f"{path.name}: {state}: expected {shard.expected_file_bytes:,} bytes; "
            f"found {file_bytes:,}"
        )
    return shard


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _load_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ShardError(f"{path.name}: expected JSON with a 'weight_map'; found {exc!r}") from exc
    if not isinstance(weight_map, dict):
        raise ShardError(
            f"{path.name}: expected 'weight_map' object; found {type(weight_map).__name__}"
        )
    return {str(k): str(v) for k, v in weight_map.items()}


def check_weights(
    model_dir: Path, config: Mapping[str, Any], required: bool = False
) -> CheckResult:
    """Index against shards, every header parsed, sizes against the files and against config.

    ``required``: an extraction will load these weights (engine.load_format is not 'dummy'), so
    a folder without any fails here, before the model load, instead of in every work chunk
    after the store was planned; without it (a config-only folder checked by ``hsx preflight``)
    that is a warning."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards and not index_path.exists():
        if required:
            files = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
            return CheckResult(
                "weights",
                Status.FAIL,
                f"no weights in {model_dir}: expected *.safetensors shards (or {INDEX_NAME}) "
                f"for engine.load_format 'auto'/'safetensors', found {_listed(files) or 'no files'}",
            )
        return CheckResult(
            "weights",
            Status.WARN,
            f"no weights present in {model_dir}; probe runs on dummy weights",
        )
    failures: list[str] = []
    warnings: list[str] = []
    weight_map: dict[str, str] | None = None
    by_file: dict[str, list[str]] = {}  # shard file name -> tensors the index puts there
    if index_path.exists():
        try:
            weight_map = _load_index(index_path)
        except ShardError as exc:
            return CheckResult("weights", Status.FAIL, str(exc))
        for tensor, file in weight_map.items():
            by_file.setdefault(file, []).append(tensor)
        present = {p.name for p in shards}
        missing = sorted(set(by_file) - present)
        for file in missing:
            failures.append(
                f"{file}: expected (the index maps {len(by_file[file]):,} tensors to it); "
                "found missing"
            )
        unindexed = sorted(present - set(by_file))
        if unindexed:
            warnings.append(f"shards not named by {INDEX_NAME} (ignored): {_listed(unindexed)}")
        shards = [p for p in shards if p.name in by_file]

    headers: list[ShardHeader] = []
    for path in shards:
        try:
            headers.append(read_header(path))
        except ShardError as exc:
            failures.append(str(exc))
        except OSError as exc:
            failures.append(f"{path.name}: unreadable: {exc!r}")

    if weight_map is not None:
        for shard in headers:
            named = by_file.get(shard.path.name, [])
            absent = sorted(t for t in named if t not in shard.tensors)
            if absent:
                failures.append(
                    f"{shard.path.name}: index names {len(absent)} tensor(s) absent from its "
                    f"header: {_listed(absent)}"
                )
            extra = sorted(set(shard.tensors) - set(named))
            if extra:
                warnings.append(
                    f"{shard.path.name}: {len(extra)} tensor(s) not in the index: {_listed(extra)}"
                )

    total = sum(s.data_bytes for s in headers)
    tensors = sum(len(s.tensors) for s in headers)
    if failures:
        return CheckResult(
            "weights",
            Status.FAIL,
            f"{len(failures)} weight problem(s) in {model_dir}; first: {failures[0]}",
            tuple(failures + warnings),
        )
    try:
        expected = estimate_weight_bytes(config)
    except ValueError as exc:
        expected = 0
        warnings.append(f"no size estimate from config.json: {exc}")
    if expected and abs(total - expected) > _ESTIMATE_TOLERANCE * expected:
        warnings.append(
            f"weights total {total / GIB:,.1f} GiB: expected ~{expected / GIB:,.1f} GiB from "
            f"config.json (+/-{_ESTIMATE_TOLERANCE:.0%}); found {total / expected:.2f}x"
        )
    summary = f"{len(headers)} shard(s), {tensors:,} tensors, {total / GIB:,.2f} GiB: headers ok"
    if expected:
        summary += f" (config implies ~{expected / GIB:,.2f} GiB)"
    return CheckResult(
        "weights", Status.WARN if warnings else Status.PASS, summary, tuple(warnings)
    )
