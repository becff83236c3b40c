"""A run's throughput over time, from what its chunks committed and when, drawn one way for
every reader: the flow run's page in Prefect (flows/reporting.py's plot artifact, as chunks
commit) and a store's audit (``hsx info STORE --plot FILE``, from the commit records).

The drawing is a plain SVG (no plotting library: it must render in Prefect's UI, in a browser
opening the file, and cost nothing in the flow)."""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Iterable
from dataclasses import dataclass

from hsx.store.zarr_store import CommitRecord

# Bins of the plot: enough to see a slowdown, few enough that each holds several chunks.
MAX_BINS = 60
WIDTH, HEIGHT = 640, 240
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 36


@dataclass(frozen=True)
class Commit:
    """One committed chunk: when its commit finished (seconds since the epoch) and its tokens."""

    at: float
    tokens: int


def commits_of(records: Iterable[CommitRecord]) -> list[Commit]:
    """The commits of these records, in time order (records whose time does not parse are left
    out: the audit shows them elsewhere)."""
    found = []
    for record in records:
        try:
            at = datetime.datetime.fromisoformat(record.finished_at.replace("Z", "+00:00"))
        except (AttributeError, ValueError):
            continue
        if at.tzinfo is None:
            at = at.replace(tzinfo=datetime.UTC)
        found.append(Commit(at.timestamp(), int(record.tokens)))
    return sorted(found, key=lambda c: c.at)


def throughput_series(
    commits: list[Commit], start: float | None = None, bins: int = MAX_BINS
) -> list[tuple[float, float]]:
    """(seconds since ``start``, tokens/s over the bin ending there) for equal bins from
    ``start`` (default: the first commit) to the last commit. Empty without commits."""
    if not commits:
        return []
    first = commits[0].at if start is None else min(start, commits[0].at)
    span = max(commits[-1].at - first, 1e-6)
    count = max(1, min(bins, len(commits)))
    width = span / count
    tokens = [0] * count
    for commit in commits:
        index = min(int((commit.at - first) / width), count - 1)
        tokens[index] += commit.tokens
    return [((i + 1) * width, tokens[i] / width) for i in range(count)]


def _nice_ceiling(value: float) -> float:
    """1, 2 or 5 times a power of ten, at or above ``value`` (the y axis' top)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value)


def throughput_svg(series: list[tuple[float, float]], title: str) -> str:
    """The series as an SVG line plot: tokens/s against minutes (or seconds) since the start,
    with the mean in the title line."""
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
    ]
    if not series:
        parts.append(f'<text x="{_LEFT}" y="{_TOP + 20}">{html.escape(title)}: no commits</text>')
        return "".join(parts) + "</svg>"
    end = series[-1][0]
    width = end / len(series)
    mean = sum(rate for _, rate in series) * width / end
    top = _nice_ceiling(max(rate for _, rate in series))
    minutes = end >= 180
    unit, scale = ("min", 60.0) if minutes else ("s", 1.0)
    parts.append(
        f'<text x="{_LEFT}" y="16" font-size="12">{html.escape(title)} — mean '
        f"{mean:,.0f} tokens/s over {end / scale:,.1f} {unit}</text>"
    )
    for fraction in (0.0, 0.5, 1.0):  # the y axis: 0, half, top
        y = _TOP + plot_h * (1 - fraction)
        parts.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{WIDTH - _RIGHT}" y2="{y:.1f}" '
            f'stroke="#ddd"/><text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{top * fraction:,.0f}</text>"
        )
    for fraction in (0.0, 0.5, 1.0):  # the x axis: start, middle, end
        x = _LEFT + plot_w * fraction
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - _BOTTOM + 16}" text-anchor="middle">'
            f"{end * fraction / scale:,.1f}</text>"
        )
    parts.append(
        f'<text x="{_LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
        f"{unit} since the start (tokens/s per {width / scale:,.1f} {unit})</text>"
    )
    points = [(0.0, series[0][1]), *series]  # each bin's rate held over the bin
    coordinates = " ".join(
        f"{_LEFT + plot_w * t / end:.1f},{_TOP + plot_h * (1 - rate / top):.1f}"
        for t, rate in points
    )
    parts.append(
        f'<polyline points="{coordinates}" fill="none" stroke="#2563eb" stroke-width="2"/>'
    )
    return "".join(parts) + "</svg>"
