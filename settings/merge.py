"""Partial settings over defaults: a deployment's run parameters name only what they change."""

from __future__ import annotations

from typing import Any


def merge_partial(defaults: dict[str, Any], partial: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``partial`` laid over it, section by section: a nested dict merges
    into the default's dict of the same key, any other value replaces it. Neither is changed.

    ``merge_partial({"engine": {"tensor_parallel_size": 8, "dtype": "auto"}},
    {"engine": {"tensor_parallel_size": 1}})`` keeps ``dtype``; Prefect itself replaces a
    deployment's whole ``settings`` parameter with a run's."""
    merged = dict(defaults)
    for key, value in partial.items():
        default = merged.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            merged[key] = merge_partial(default, value)
        else:
            merged[key] = value
    return merged
