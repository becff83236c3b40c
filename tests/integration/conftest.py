"""Integration tests share one Prefect API server (tests/conftest.py's ``prefect_api``): every
CLI run and flow of the session reports to it rather than starting a server of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _shared_prefect_api(prefect_api: str) -> str:
    return prefect_api
