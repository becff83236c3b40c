"""Work items of a run over many nodes: consecutive chunks of minutes of one node's work, the
same cut on every attempt of the parent, and only uncommitted chunks resubmitted."""

from __future__ import annotations

import pytest

from hsx.errors import ConfigError
from hsx.plan.chunks import WorkChunk
from hsx.plan.work_items import (
    cut_work_items,
    item_tokens,
    measured_rate,
    pending_items,
)

pytestmark = pytest.mark.timeout(60)


def _chunks(tokens: list[int]) -> list[WorkChunk]:
    out, row = [], 0
    for index, count in enumerate(tokens):
        out.append(WorkChunk(index, index * 4, index * 4 + 4, row, row + count, count, 0, 1))
        row += count
    return out


def test_items_hold_about_the_asked_tokens_and_every_chunk_once() -> None:
    chunks = _chunks([300, 500, 200, 900, 100, 100, 100, 50])
    items = cut_work_items(list(reversed(chunks)), 1000)  # any order in: plan order out
    assert [item.chunks for item in items] == [(0, 1, 2), (3, 4), (5, 6, 7)]
    assert [item.tokens for item in items] == [1000, 1000, 250]
    assert [item.index for item in items] == [0, 1, 2]
    # A chunk larger than an item is an item of its own, never split.
    assert [i.chunks for i in cut_work_items(_chunks([5000, 10]), 1000)] == [(0,), (1,)]


def test_the_cut_does_not_depend_on_what_is_committed() -> None:
    chunks = _chunks([400] * 10)
    items = cut_work_items(chunks, 1200)
    left = pending_items(items, committed=[0, 1, 2, 4, 9])
    # Item 0 is done and gone; the others keep their number and lose their committed chunks.
    assert [(item.index, item.chunks) for item in left] == [(1, (3, 5)), (2, (6, 7, 8))]
    assert pending_items(items, committed=range(10)) == []


def test_item_size_from_minutes_and_a_measured_rate() -> None:
    assert item_tokens(10, 20_000) == 12_000_000
    assert item_tokens(0.001, 1) == 1  # at least one token: one chunk per item
    # 200M tokens in 10-minute items at 20k tokens/s would be 17 items: 64 nodes want more.
    assert item_tokens(10, 20_000, total_tokens=200_000_000, min_items=256) == 781_250
    assert item_tokens(10, 20_000, total_tokens=200_000_000, min_items=4) == 12_000_000
    with pytest.raises(ConfigError, match=r"expected positive minutes and tokens/s, found 0"):
        item_tokens(0, 100)
    assert measured_rate([(1000, 0.5), (3000, 1.5)]) == pytest.approx(2000.0)
    assert measured_rate([]) is None
