"""A work item's state watch (flows/extract_item.py) on a real Prefect engine and API: it reads
its run's state every ``timeouts.state_watch_s`` and stops the run once it is no longer Running."""

from __future__ import annotations

import time
from collections.abc import Iterator
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelling

from flows.extract_item import RunStateWatch
from hsx.interrupt import clear_stop, stop_reason, stop_requested
from settings import HsxSettings

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _no_stop_left() -> Iterator[None]:
    clear_stop()
    yield
    clear_stop()


def _cancelled_while_watched(period_s: float, seen: dict[str, float | str]) -> None:
    """Starts the watch, has the run set to Cancelling from the API (as the parent's or an
    operator's Cancel does), and notes in ``seen`` how long the watch took to stop the run."""
    watch = RunStateWatch(period_s)
    watch.start()
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(str(flow_run.get_id())), Cancelling(), force=True)
        asked = time.monotonic()
        while not stop_requested() and time.monotonic() - asked < 4 * period_s + 10:
            time.sleep(0.05)
        seen["stopped_after_s"] = time.monotonic() - asked if stop_requested() else -1.0
        seen["reason"] = stop_reason()
    finally:
        watch.stop()


@pytest.mark.parametrize("period_s", [0.5, 4.0])
def test_the_state_watch_stops_a_run_no_longer_running_within_its_period(
    period_s: float, prefect_harness: None
) -> None:
    settings = HsxSettings(model="m", dataset="d", store="s", timeouts={"state_watch_s": period_s})
    seen: dict[str, float | str] = {}
    # A closure: Prefect copies a flow's parameters, so ``seen`` must not be one.
    watched = flow(name="hsx-test-state-watch")(
        lambda: _cancelled_while_watched(settings.timeouts.state_watch_s, seen)
    )
    watched(return_state=True)
    stopped_after = float(seen["stopped_after_s"])
    assert stopped_after >= 0, f"expected the run stopped once Cancelling, found {seen}"
    assert "Cancelling in Prefect" in str(seen["reason"]), seen
    # Read once per period: not before the first read, and within one period (plus the read).
    assert stopped_after <= period_s + 2.0, (period_s, stopped_after)
    if period_s >= 4.0:
        assert stopped_after >= 0.5, (
            f"expected a wait for the next read, found {stopped_after:.2f} s"
        )
