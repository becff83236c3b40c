"""Work items: the plan's chunks cut into runs of a few minutes of one node's work, each run on
one node by a child flow (flows/fanout.py). Cut over every chunk of the plan, not only the
pending ones, so an item's number and chunks are the same on every attempt of the parent (its
children's idempotency keys re-attach to the runs it made before)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hsx.errors import ConfigError
from hsx.plan.chunks import WorkChunk


@dataclass(frozen=True)
class WorkItem:
    """Consecutive work chunks of the plan, run by one child flow on one node."""

    index: int
    chunks: tuple[int, ...]
    tokens: int

    @property
    def name(self) -> str:
        return f"item-{self.index:05d}"


def item_tokens(
    minutes: float, tokens_per_s: float, total_tokens: int = 0, min_items: int = 0
) -> int:
    """Tokens of ``minutes`` of one node's work at ``tokens_per_s``; fewer where that would
    make less than ``min_items`` items of ``total_tokens``."""
    if minutes <= 0 or tokens_per_s <= 0:
        raise ConfigError(
            f"work items: expected positive minutes and tokens/s, found {minutes} min at "
            f"{tokens_per_s} tokens/s"
        )
    size = int(minutes * 60 * tokens_per_s)
    if min_items > 0 and total_tokens > 0:
        size = min(size, -(-total_tokens // min_items))
    return max(1, size)


def cut_work_items(chunks: Sequence[WorkChunk], tokens_per_item: int) -> list[WorkItem]:
    """Every chunk in plan order, a new item started once the current one holds
    ``tokens_per_item`` tokens (an item holds at least one chunk)."""
    items: list[WorkItem] = []
    current: list[int] = []
    tokens = 0
    for chunk in sorted(chunks, key=lambda c: c.index):
        current.append(chunk.index)
        tokens += chunk.tokens
        if tokens >= tokens_per_item:
            items.append(WorkItem(len(items), tuple(current), tokens))
            current, tokens = [], 0
    if current:
        items.append(WorkItem(len(items), tuple(current), tokens))
    return items


def pending_items(items: Sequence[WorkItem], committed: Iterable[int]) -> list[WorkItem]:
    """The items with uncommitted chunks, each keeping only those (its number unchanged)."""
    done = set(committed)
    left = []
    for item in items:
        chunks = tuple(index for index in item.chunks if index not in done)
        if chunks:
            left.append(WorkItem(item.index, chunks, item.tokens))
    return left


def measured_rate(tokens_and_seconds: Iterable[tuple[int, float]]) -> float | None:
    """One node's tokens/s from committed chunks (tokens, seconds each); None without any.
    A node runs several chunks at once, so the summed chunk seconds overstate its time: the
    rate is a lower bound, and items cut with it come out shorter than asked, not longer."""
    tokens = seconds = 0.0
    for chunk_tokens, chunk_seconds in tokens_and_seconds:
        tokens += chunk_tokens
        seconds += chunk_seconds
    return tokens / seconds if tokens > 0 and seconds > 0 else None
