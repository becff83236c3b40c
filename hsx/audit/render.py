"""The audit report as text: the summary lines the CLI prints, and the markdown of the flow's
artifact (with the plots inline)."""

from __future__ import annotations

import base64

from hsx.audit.report import AuditReport
from hsx.audit.results import Agreement

_LISTED_FINDINGS = 40


def _agreement(name: str, value: Agreement) -> str:
    if not value.positions:
        return f"{name}: no positions"
    return (
        f"{name}: top-1 {value.rate():.3f}, top-5 {value.rate('top5'):.3f}, mean log-prob "
        f"{value.rate('log_prob'):.3f} over {value.positions:,} positions"
    )


def summary_lines(report: AuditReport) -> list[str]:
    """What a user reads first: scope, agreement, alignment, greedy check, layers, data."""
    state = "OK" if report.ok else f"PROBLEMS ({len(report.errors)} errors)"
    lines = [
        f"audit of {report.store}: {state}",
        f"model {report.model}; head {report.head['tensor'] if report.head else 'not read'}"
        + (" (tied embeddings)" if report.head and report.head["tied"] else "")
        + (f" on {report.head['device']} ({report.head['compute_dtype']})" if report.head else ""),
        f"{report.chunks_audited} of {report.chunks_committed} committed chunks "
        f"({report.chunks_planned} planned), {report.rows_read:,} rows read "
        f"(positions asked {report.positions_requested or 'all'}), {report.seconds:.2f} s",
        f"layers {report.layer_ids}: "
        + ("the last is the final pre-norm state" if report.final_layer else "no final state"),
        _agreement("next token, loss-masked positions", report.masked),
        _agreement("next token, other positions", report.other),
        f"alignment: {report.alignment}",
        f"greedy data: {'yes' if report.greedy['exact'] else 'no'} ({report.greedy['reason']})",
    ]
    check = report.greedy_check
    if check.positions:
        lines.append(
            f"greedy check: {check.agree:,} of {check.positions:,} generated positions exact, "
            f"{check.ties} ties within tolerance, {check.disagree} disagree"
        )
    for layer in report.layers:
        scales = (
            f", fp8 scales {layer.scale_min:.3g}..{layer.scale_max:.3g}"
            if layer.scale_min is not None and layer.scale_max is not None
            else ""
        )
        lines.append(
            f"layer id {layer.layer_id}: {layer.vectors:,} vectors, NaN {layer.nan}, inf "
            f"{layer.inf}, zero {layer.zero}, constant {layer.constant}, repeated "
            f"{layer.repeated}{scales}"
        )
    data = report.data
    if data.samples:
        lines.append(
            f"data: {data.samples:,} samples, {data.tokens:,} tokens (lengths p50 "
            f"{data.length_percentiles.get('p50')}, p99 {data.length_percentiles.get('p99')}, max "
            f"{data.length_percentiles.get('max')}), loss mask {data.masked_tokens / max(data.tokens, 1):.1%} "
            f"of tokens ({data.samples_without_masked_tokens} samples with none); draft "
            f"vocabulary {data.draft_vocab_size:,} of {data.vocab_size:,} ids covers "
            f"{data.draft_vocab_coverage:.1%} of trained tokens"
        )
    return lines


def brief(report: AuditReport) -> str:
    """One line: the outcome, alignment and agreement (a run's summary, `hsx runs`)."""
    state = "ok" if report.ok else f"{len(report.errors)} errors"
    both = Agreement()
    both.add(report.masked)
    both.add(report.other)
    top1 = both.rate()
    masked = report.masked.rate()
    scored = (
        f", top-1 {top1:.3f} ({masked:.3f} loss-masked)"
        if top1 is not None and masked is not None
        else ""
    )
    return (
        f"{state}: {report.alignment.split(' (')[0]}{scored}, {report.rows_read:,} rows of "
        f"{report.chunks_audited} chunks"
    )


def finding_lines(report: AuditReport) -> list[str]:
    lines = [f"[{f.severity}] {f.message}" for f in report.findings[:_LISTED_FINDINGS]]
    if len(report.findings) > _LISTED_FINDINGS:
        lines.append(f"... {len(report.findings) - _LISTED_FINDINGS} more (--json lists all)")
    return lines


def markdown(report: AuditReport, images: dict[str, bytes] | None = None) -> str:
    """The report's markdown: summary, findings, norms by layer, plots inline (PNG data)."""
    parts = [f"# hsx audit of `{report.store}`", ""]
    parts += [f"- {line}" for line in summary_lines(report)]
    parts += ["", "## Findings", ""]
    parts += [f"- {line}" for line in finding_lines(report)] or ["- none"]
    parts += ["", "## Norms by layer and position (p1 / p50 / p99)", ""]
    for layer in report.norm_percentiles:
        cells = [
            f"{where}: {v[1]:.3g} / {v[50]:.3g} / {v[99]:.3g}"
            for where, v in layer["by_position"].items()
            if None not in v.values()
        ]
        parts.append(f"- layer id {layer['layer_id']}: " + "; ".join(cells))
    for name, png in (images or {}).items():
        encoded = base64.b64encode(png).decode()
        parts += ["", f"## {name}", "", f"![{name}](data:image/png;base64,{encoded})"]
    return "\n".join(parts)
