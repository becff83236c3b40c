"""A run's throughput over time, drawn one way for the flow run's page and `hsx info --plot`."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from types import SimpleNamespace
from typing import Any

import pytest

from hsx.store.throughput import Commit, commits_of, throughput_series, throughput_svg

pytestmark = pytest.mark.timeout(60)


def test_tokens_per_second_per_bin_from_the_start() -> None:
    commits = [Commit(100.0 + t, 1000) for t in (1, 2, 3, 4, 6, 8, 10)]
    series = throughput_series(commits, start=100.0, bins=5)
    assert [round(t, 3) for t, _ in series] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert [round(rate) for _, rate in series] == [500, 1000, 500, 500, 1000]
    # Every token is in one bin: the rates integrate to the tokens committed.
    assert sum(rate * 2.0 for _, rate in series) == pytest.approx(7000)
    assert throughput_series([]) == []
    assert len(throughput_series(commits, bins=60)) == len(commits)  # no more bins than commits


def test_the_plot_is_an_svg_with_the_mean_and_a_line() -> None:
    commits = [Commit(float(t), 500) for t in range(0, 600, 10)]
    svg = throughput_svg(throughput_series(commits, start=0.0), "s3://b/run.zarr: attempt <1>")
    root = ET.fromstring(svg)  # well-formed, the title escaped; 30,000 tokens over 590 s
    ns = "{http://www.w3.org/2000/svg}"
    (line,) = root.iter(f"{ns}polyline")
    assert len(line.get("points", "").split()) == len(commits) + 1
    texts = [t.text or "" for t in root.iter(f"{ns}text")]
    assert any("attempt <1>" in t and "mean 51 tokens/s over 9.8 min" in t for t in texts), texts
    empty = ET.fromstring(throughput_svg([], "nothing yet"))
    assert any("no commits" in (t.text or "") for t in empty.iter(f"{ns}text"))


def test_commit_records_give_their_commits_in_time_order() -> None:
    def record(finished_at: str, tokens: int) -> Any:
        return SimpleNamespace(finished_at=finished_at, tokens=tokens)

    found = commits_of(
        [
            record("2026-12-07T21:00:10Z", 30),
            record("2026-12-07T21:00:05+00:00", 20),
            record("not a time", 10),
        ]
    )
    assert [c.tokens for c in found] == [20, 30]
    assert found[1].at - found[0].at == pytest.approx(5.0)
