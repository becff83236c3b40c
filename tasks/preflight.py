"""Preflight tasks: placeholder until the preflight checks land (issue 3)."""

from __future__ import annotations

from settings import HsxSettings


def preflight_tasks(settings: HsxSettings) -> None:
    return None
