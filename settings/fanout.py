"""Settings of an extraction fanned out over many nodes (flows/fanout.py): how the parent cuts
the plan into work items and how it watches and resubmits them."""

from __future__ import annotations

from pydantic import Field

from settings.strict import StrictSection


class FanoutSettings(StrictSection):
    item_deployment: str = Field(
        "hsx-extract-item/extract-item",
        description="The deployment (FLOW/NAME) that extracts one work item on a node; its pool "
        "has one worker per GPU node, bound to that node's `hsx serve`.",
    )
    item_minutes: float = Field(
        10.0,
        gt=0,
        le=24 * 60,
        description="Minutes of one node's work per item: long enough that Prefect's per-run "
        "cost is small, short enough that a dead node loses little and the last items end "
        "together.",
    )
    node_tokens_per_s: float = Field(
        20_000.0,
        gt=0,
        description="One node's extraction rate, to size items, until the store has a measured "
        "one (the committed chunks' tokens over their seconds, used once there are some).",
    )
    min_items: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="At least this many items (a few per node, e.g. 4 x the nodes): a run "
        "shorter than nodes x item_minutes is cut finer, so no node sits idle (0 = no floor).",
    )
    max_resubmits: int = Field(
        2,
        ge=0,
        le=100,
        description="Times an item that ended Failed or Crashed (a dead node) is submitted "
        "again with only its uncommitted chunks, per attempt of the parent.",
    )
    poll_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Seconds between the parent's reads of its items' states (one filtered "
        "read per poll, whatever the number of items).",
    )
