"""The store's audit report: the chunks' results merged, the verdicts (alignment, greedy
exactness, final state pre-norm, layers consistent across chunks), every finding, and the
report as JSON and as text (the CLI's, the flow's markdown artifact)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hsx.audit.agreement import alignment_verdict
from hsx.audit.data_shape import DataShape
from hsx.audit.results import (
    ERROR,
    NORM_BINS,
    NORM_LOG_MAX,
    NORM_LOG_MIN,
    NOTE,
    POSITION_BUCKETS,
    SHIFTS,
    WARNING,
    Agreement,
    ChunkAudit,
    Finding,
    Greediness,
    LayerStats,
    bucket_name,
)

# A chunk whose median norm of a layer is this many times off the store's median of that layer
# (over chunks) holds other states (layers in another order, another model's).
PROFILE_FACTOR = 2.0
MIN_CHUNKS_FOR_PROFILE = 3
# Findings that say the states do not line up with their tokens: they fail an extraction's
# end-of-run audit (the others are recorded).
ALIGNMENT_KINDS = ("shifted", "rows-short")


@dataclass
class AuditReport:
    store: str
    model: str
    head: dict[str, Any] | None
    layer_ids: list[int]
    final_layer: bool
    greedy: dict[str, Any]  # {"exact": bool, "reason": str}
    positions_requested: int
    chunks_planned: int
    chunks_committed: int
    chunks_audited: int = 0
    rows_read: int = 0
    masked: Agreement = field(default_factory=Agreement)
    other: Agreement = field(default_factory=Agreement)
    by_position: list[Agreement] = field(
        default_factory=lambda: [Agreement() for _ in POSITION_BUCKETS]
    )
    shift_hits: list[int] = field(default_factory=lambda: [0, 0, 0])
    shift_positions: int = 0
    alignment: str = "not measured"
    greedy_check: Greediness = field(default_factory=Greediness)
    layers: list[LayerStats] = field(default_factory=list)
    norm_percentiles: list[dict[str, Any]] = field(default_factory=list)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    data: DataShape = field(default_factory=DataShape)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def alignment_failures(self) -> list[Finding]:
        return [f for f in self.errors if f.kind in ALIGNMENT_KINDS]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for layer in data["layers"]:
            layer.pop("norm_histogram")  # in norm_percentiles, readably
        return data


def _median_norm(layer: LayerStats, skip_first: bool = True) -> float | None:
    """The median norm of a layer from its histogram (position 0 left out: attention sinks)."""
    counts = np.asarray(layer.norm_histogram[1 if skip_first else 0 :]).sum(axis=0)
    return _percentile(counts, 50)


def _percentile(counts: np.ndarray, q: float) -> float | None:
    total = int(counts.sum())
    if not total:
        return None
    index = int(np.searchsorted(np.cumsum(counts), q / 100 * total))
    width = (NORM_LOG_MAX - NORM_LOG_MIN) / NORM_BINS
    return float(10 ** (NORM_LOG_MIN + (index - 0.5) * width))  # the bin's centre


def merge(report: AuditReport, audits: list[ChunkAudit]) -> None:
    """The chunks' results into ``report``, in chunk order, with the store-wide findings."""
    audits = sorted(audits, key=lambda a: a.chunk)
    report.chunks_audited = len(audits)
    for audit in audits:
        report.rows_read += audit.rows_read
        report.masked.add(audit.masked)
        report.other.add(audit.other)
        for bucket, part in zip(report.by_position, audit.by_position, strict=True):
            bucket.add(part)
        report.shift_hits = [
            a + b for a, b in zip(report.shift_hits, audit.shift_hits, strict=True)
        ]
        report.shift_positions += audit.shift_positions
        report.greedy_check.add(audit.greedy)
        if not report.layers:
            report.layers = [LayerStats(layer.layer_id) for layer in audit.layers]
        for merged, layer in zip(report.layers, audit.layers, strict=True):
            merged.add(layer)
        report.findings += audit.findings
        report.chunks.append(_chunk_row(audit))
        report.samples += [asdict(s) for s in audit.sample_audits]
    report.norm_percentiles = [_percentiles(layer) for layer in report.layers]
    report.findings += _profile_findings(audits)
    report.findings += _verdicts(report)
    order = {ERROR: 0, WARNING: 1, NOTE: 2}
    report.findings.sort(key=lambda f: (order.get(f.severity, 3), f.chunks[:1], f.kind))


def _chunk_row(audit: ChunkAudit) -> dict[str, Any]:
    both = Agreement()
    both.add(audit.masked)
    both.add(audit.other)
    verdict, _ = alignment_verdict(audit.shift_hits, audit.shift_positions)
    return {
        "chunk": audit.chunk,
        "samples": audit.samples,
        "tokens": audit.tokens,
        "rows read": audit.rows_read,
        "top-1": _rate(both.rate()),
        "top-1 masked": _rate(audit.masked.rate()),
        "top-5": _rate(both.rate("top5")),
        "mean log-prob": _number(both.rate("log_prob")),
        "alignment": verdict,
        "greedy disagreements": audit.greedy.disagree if audit.greedy.positions else "-",
        "zero/NaN vectors": sum(layer.zero + layer.nan + layer.inf for layer in audit.layers),
        "errors": sum(1 for f in audit.findings if f.severity == ERROR),
        "seconds": round(audit.seconds, 3),
    }


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _number(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _percentiles(layer: LayerStats) -> dict[str, Any]:
    rows = {}
    for bucket, counts in enumerate(layer.norm_histogram):
        values = np.asarray(counts)
        if values.sum():
            rows[bucket_name(bucket)] = {q: _percentile(values, q) for q in (1, 50, 99)}
    return {"layer_id": layer.layer_id, "by_position": rows}


def _profile_findings(audits: list[ChunkAudit]) -> list[Finding]:
    """Chunks whose median norm of some layer is far from that layer's median over chunks."""
    medians = [[_median_norm(layer) for layer in a.layers] for a in audits]
    usable = [(a, m) for a, m in zip(audits, medians, strict=True) if m and None not in m]
    if len(usable) < MIN_CHUNKS_FOR_PROFILE:
        return []
    typical = np.median(np.asarray([m for _, m in usable], dtype=float), axis=0)
    found = []
    for audit, values in usable:
        ratios = np.asarray(values, dtype=float) / typical
        if np.any((ratios > PROFILE_FACTOR) | (ratios < 1 / PROFILE_FACTOR)):
            found.append(
                Finding(
                    ERROR,
                    "layer-profile",
                    f"chunk {audit.chunk}: median norm by layer "
                    f"{[f'{v:.3g}' for v in values]}, expected near the store's "
                    f"{[f'{v:.3g}' for v in typical]} (ids {[la.layer_id for la in audit.layers]}): "
                    "layers in another order, or states of another model",
                    [audit.chunk],
                )
            )
    return found


def _verdicts(report: AuditReport) -> list[Finding]:
    """The store-wide verdicts: alignment, greedy exactness; notes where nothing was measured."""
    found = []
    if not report.final_layer or report.head is None:
        why = (
            "no weights to score with"
            if report.head is None
            else f"the last captured layer (id {report.layer_ids[-1]}) is not the final state"
        )
        report.alignment = f"not measured ({why})"
        return [Finding(NOTE, "not-scored", f"next-token agreement not measured: {why}")]
    verdict, shift = alignment_verdict(report.shift_hits, report.shift_positions)
    shifted = sorted({c for f in report.findings if f.kind == "shifted" for c in f.chunks})
    rates = ", ".join(
        f"{s:+d}: {h / max(report.shift_positions, 1):.1%}"
        for s, h in zip(SHIFTS, report.shift_hits, strict=True)
    )
    if shifted:
        report.alignment = f"states shifted in chunks {shifted} (top-1 by shift {rates})"
    elif verdict == "aligned":
        report.alignment = f"aligned: shift 0 predicts best (top-1 by shift {rates})"
    elif verdict == "shifted":
        report.alignment = f"states are shifted by {shift:+d} (top-1 by shift {rates})"
        found.append(
            Finding(
                ERROR, "shifted", f"states are shifted by {shift:+d} across the store ({rates})"
            )
        )
    else:
        report.alignment = f"undecided (top-1 by shift {rates})"
        found.append(
            Finding(
                NOTE,
                "alignment-undecided",
                "alignment undecided: no shift predicts the data's next tokens (top-1 below "
                f"10% at shifts -1, 0, +1: {rates}); the data is far from this model's own "
                "choices (random weights, or another model's text)",
            )
        )
    check = report.greedy_check
    if report.greedy.get("exact") and check.positions:
        found.append(
            Finding(
                NOTE if not check.disagree else ERROR,
                "greedy",
                f"greedy data: {check.agree} of {check.positions} generated positions agree "
                f"exactly, {check.ties} within the float tolerance of the store's dtype (ties), "
                f"{check.disagree} disagree",
            )
        )
    return found
