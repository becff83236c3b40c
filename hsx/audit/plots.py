"""The audit's plots, as PNG bytes (matplotlib, Agg: no display): next-token agreement by
position, norms by layer, sample lengths, loss-mask and draft-vocabulary coverage. Imported only
when plots are asked for (matplotlib takes a second or two to import)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from hsx.audit.data_shape import COVERAGE_EDGES, LENGTH_EDGES
from hsx.audit.report import AuditReport
from hsx.audit.results import POSITION_BUCKETS, bucket_name

PLOTS = ("agreement", "norms", "lengths", "coverage")
_SIZE = (6.4, 3.6)
_DPI = 80


def _figure(columns: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(_SIZE[0] * (1 if columns == 1 else 1.4), _SIZE[1]))


def _png(figure: Any) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=_DPI)
    plt.close(figure)
    return buffer.getvalue()


def _bucket_labels() -> list[str]:
    return [bucket_name(i) for i in range(len(POSITION_BUCKETS))]


def agreement_plot(report: AuditReport) -> bytes:
    """Top-1 and top-5 agreement by position within the sample, and by shift."""
    figure, (left, right) = _figure(2)
    labels = _bucket_labels()
    x = np.arange(len(labels))
    top1 = [b.rate() or 0.0 for b in report.by_position]
    top5 = [b.rate("top5") or 0.0 for b in report.by_position]
    left.bar(x - 0.2, top1, 0.4, label="top-1")
    left.bar(x + 0.2, top5, 0.4, label="top-5")
    left.set_xticks(x, labels)
    left.set_ylim(0, 1)
    left.set_xlabel("position in the sample")
    left.set_title("next-token agreement by position")
    left.legend()
    rates = [h / max(report.shift_positions, 1) for h in report.shift_hits]
    right.bar(["-1", "0", "+1"], rates, color=["grey", "tab:green", "grey"])
    right.set_ylim(0, 1)
    right.set_xlabel("shift (state at t against token t+1+shift)")
    right.set_title("alignment: top-1 by shift")
    return _png(figure)


def norms_plot(report: AuditReport) -> bytes:
    """Median norm (p1-p99 band) of each captured layer, by position bucket."""
    figure, axis = _figure()
    labels = _bucket_labels()
    for layer in report.norm_percentiles:
        by = layer["by_position"]
        x = [i for i, name in enumerate(labels) if name in by]
        values = [by[labels[i]] for i in x]
        axis.plot(x, [v[50] for v in values], marker="o", label=f"layer {layer['layer_id']}")
        axis.fill_between(x, [v[1] for v in values], [v[99] for v in values], alpha=0.15)
    axis.set_yscale("log")
    axis.set_xticks(range(len(labels)), labels)
    axis.set_xlabel("position in the sample")
    axis.set_ylabel("L2 norm (p50, p1-p99 band)")
    axis.set_title("norms by layer")
    axis.legend(fontsize="small")
    return _png(figure)


def lengths_plot(report: AuditReport) -> bytes:
    figure, axis = _figure()
    counts = report.data.length_histogram or [0] * (len(LENGTH_EDGES) - 1)
    axis.bar(range(len(counts)), counts)
    axis.set_xticks(range(len(counts))[::2], [str(e) for e in LENGTH_EDGES[:-1]][::2], rotation=45)
    axis.set_xlabel("sample length (tokens, from)")
    axis.set_ylabel("samples")
    axis.set_title(f"lengths of {report.data.samples:,} samples")
    return _png(figure)


def coverage_plot(report: AuditReport) -> bytes:
    """Loss-mask coverage per sample, and the draft vocabulary's coverage by its size."""
    figure, (left, right) = _figure(2)
    counts = report.data.coverage_histogram or [0] * (len(COVERAGE_EDGES) - 1)
    left.bar([f"{e:.1f}" for e in COVERAGE_EDGES[:-1]], counts)
    left.set_xlabel("loss-masked share of the sample's tokens (from)")
    left.set_ylabel("samples")
    left.set_title("loss-mask coverage")
    curve = report.data.coverage_curve
    if curve:
        right.plot([n for n, _ in curve], [c for _, c in curve], marker=".")
        right.axvline(report.data.draft_vocab_size, color="grey", linestyle="--")
    right.set_xscale("log")
    right.set_ylim(0, 1.02)
    right.set_xlabel("draft vocabulary size")
    right.set_ylabel("share of trained tokens")
    right.set_title("draft vocabulary coverage")
    return _png(figure)


def draw(report: AuditReport, out: Path | None = None) -> dict[str, bytes]:
    """Every plot as PNG bytes by name; written as ``out/<name>.png`` when ``out`` is given."""
    images = {
        "agreement": agreement_plot(report),
        "norms": norms_plot(report),
        "lengths": lengths_plot(report),
        "coverage": coverage_plot(report),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, png in images.items():
            (out / f"{name}.png").write_bytes(png)
    return images
