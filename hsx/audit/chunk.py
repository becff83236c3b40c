"""The audit of one work chunk: its token rows, the states of the rows chosen for it (a group of
windows at a time, within a memory budget), the layer statistics and the next-token agreement,
and what they flag."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from hsx.audit.agreement import (
    alignment_verdict,
    gather_positions,
    greedy_finding,
    score_positions,
)
from hsx.audit.head import OutputHead
from hsx.audit.layer_stats import POST_NORM_FRACTION, LayerScan, post_norm_finding
from hsx.audit.results import ERROR, SHIFTS, ChunkAudit, Finding, SampleAudit
from hsx.audit.scope import ChunkScope, Window
from hsx.store.fp8_states import SCALES_ARRAY
from hsx.store.reader import states_tensor
from hsx.store.zarr_store import ExtractionStore

_GROUP_BYTES = 256 << 20  # float32 states read and held at once
# Windows covering less than 1/_SPARSE of the objects they touch read their rows' bytes only.
_SPARSE = 4


@dataclass(frozen=True)
class AuditContext:
    """What every chunk of one audit shares (built once: the store opened, the head loaded)."""

    store: ExtractionStore
    head: OutputHead | None  # None: no weights to score with (layer statistics only)
    layer_ids: list[int]
    final_layer: bool  # the last captured layer is the final pre-norm state (id L)
    exact: bool  # loss-masked tokens are the target's greedy choices
    eps: float  # relative error of a stored element (the store's dtype)
    post_norm_tolerance: float


def _groups(windows: tuple[Window, ...], row_bytes: int) -> Iterator[list[Window]]:
    """Windows in groups of at most _GROUP_BYTES of float32 states; a longer window in pieces
    (each piece still knows its sample's bounds)."""
    limit = max(1, _GROUP_BYTES // row_bytes)
    group: list[Window] = []
    rows = 0
    for window in windows:
        for first in range(window.row_start, window.row_end, limit):
            piece = replace(window, row_start=first, row_end=min(first + limit, window.row_end))
            size = piece.row_end - piece.row_start
            if group and rows + size > limit:
                yield group
                group, rows = [], 0
            group.append(piece)
            rows += size
    if group:
        yield group


def _read_states(
    store: ExtractionStore, windows: list[Window]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per window: states ``[rows, K, H]`` float32 and, for fp8 stores, scales ``[rows, K]``
    (each storage object the windows touch read once)."""
    names = store.state_arrays
    ranges = [(w.row_start, w.row_end) for w in windows]
    c = store.object_rows("hidden_states")
    objects = {o for a, b in ranges for o in range(a // c, -(-b // c))}
    if sum(b - a for a, b in ranges) * _SPARSE < len(objects) * c:
        # A few rows of each object (the end-of-run audit's sample): their bytes alone.
        parts = {name: [store.read_rows_in_place(name, a, b) for a, b in ranges] for name in names}
    else:
        parts = store.read_row_ranges(names, ranges)  # each object read once, whole
    out = []
    for n in range(len(windows)):
        scales = parts[SCALES_ARRAY][n] if SCALES_ARRAY in parts else None
        states = states_tensor(parts["hidden_states"][n], scales, store.logical_dtype).float()
        out.append(
            (states, None if scales is None else torch.from_numpy(np.ascontiguousarray(scales)))
        )
    return out


def audit_chunk(context: AuditContext, scope: ChunkScope) -> ChunkAudit:
    """Read, check and score one chunk's chosen rows."""
    started = time.perf_counter()
    store = context.store
    _, lengths = store.sample_rows(0, max(scope.samples) + 1)
    audit = ChunkAudit(
        scope.chunk,
        len(scope.samples),
        int(sum(int(lengths[s]) for s in scope.samples)),
        scope.positions,
    )
    ids = store.read_rows("input_ids", scope.row_start, scope.row_end).astype(np.int64)
    mask = store.read_rows("loss_mask", scope.row_start, scope.row_end)
    audit.sample_audits = [
        SampleAudit(w.sample, scope.chunk, w.sample_end - w.sample_start, w.row_end - w.row_start)
        for w in scope.windows
    ]
    scan = LayerScan(audit, context.layer_ids, ids, scope.row_start)
    scoring = context.head is not None and context.final_layer
    failing: list[int] = []
    causes: list[str] = []
    post_norm: dict[int, list[int]] = {}  # sample -> [vectors that look post-norm, vectors]
    row_bytes = len(context.layer_ids) * int(store.meta["hidden_size"]) * 4
    for group in _groups(scope.windows, row_bytes):
        states = _read_states(store, group)
        scan.add(group, [s for s, _ in states], [c for _, c in states])
        if not scoring or context.head is None:
            continue
        found = gather_positions(group, [s for s, _ in states], ids, mask, scope.row_start)
        wrong, cause = score_positions(context.head, found, audit, context.exact, context.eps)
        failing += wrong
        causes.append(cause)
        ratio = context.head.post_norm_ratio(torch.cat([s[:, -1] for s, _ in states]))
        post = ((ratio - 1).abs() <= context.post_norm_tolerance).numpy()  # [rows]
        audit.post_norm_vectors += int(post.sum())
        first = 0
        for window, (rows, _) in zip(group, states, strict=True):
            counts = post_norm.setdefault(window.sample, [0, 0])
            counts[0] += int(post[first : first + rows.shape[0]].sum())
            counts[1] += rows.shape[0]
            first += rows.shape[0]
    audit.findings += scan.finish()
    if failing:
        audit.findings.append(greedy_finding(audit, sorted(set(failing)), causes))
    if scoring:
        final = context.layer_ids[-1]
        samples = [s for s, (post, n) in post_norm.items() if post >= POST_NORM_FRACTION * n]
        finding = post_norm_finding(audit, final, context.post_norm_tolerance, samples)
        audit.findings += [finding] if finding else []
        audit.findings += shift_findings(audit)
    audit.seconds = time.perf_counter() - started
    return audit


def shift_findings(audit: ChunkAudit) -> list[Finding]:
    """States shifted against their tokens, in the whole chunk or in some of its samples."""
    verdict, shift = alignment_verdict(audit.shift_hits, audit.shift_positions)
    rates = ", ".join(
        f"{s:+d}: {h / max(audit.shift_positions, 1):.1%}"
        for s, h in zip(SHIFTS, audit.shift_hits, strict=True)
    )
    if verdict == "shifted":
        shifted = [
            s.sample
            for s in audit.sample_audits
            if alignment_verdict(s.shift_hits, s.shift_positions)[0] != "aligned"
        ]
        return [
            Finding(
                ERROR,
                "shifted",
                f"chunk {audit.chunk}: states are shifted by {shift:+d} (the state at row t "
                f"predicts token {_token(shift)}, expected t+1; top-1 by shift {rates})",
                [audit.chunk],
                shifted,
            )
        ]
    found = []
    for sample in audit.sample_audits:
        verdict, shift = alignment_verdict(sample.shift_hits, sample.shift_positions)
        if verdict == "shifted":
            found.append(
                Finding(
                    ERROR,
                    "shifted",
                    f"chunk {audit.chunk}, sample {sample.sample}: states are shifted by "
                    f"{shift:+d} (the state at row t predicts token {_token(shift)}; top-1 "
                    f"by shift {[h for h in sample.shift_hits]} of {sample.shift_positions})",
                    [audit.chunk],
                    [sample.sample],
                )
            )
    return found


def _token(shift: int | None) -> str:
    """Which token the state at row t predicts at ``shift``: "t", "t+1", "t+2"."""
    offset = 1 + (shift or 0)
    return "t" if offset == 0 else f"t{offset:+d}"
