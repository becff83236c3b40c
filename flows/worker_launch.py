"""``prefect worker start`` as infra/start-worker.sh runs it, with one fix for Prefect 3.7's
worker: a flow run retried (the UI's Retry) while its last attempt's process is still exiting is
submitted again under the same id while the worker's ``--limit`` limiter still holds that id's
token, and ``acquire_on_behalf_of_nowait`` raises "this borrower is already holding one of this
CapacityLimiter's tokens" out of the worker's poll loop: the whole worker exits (seen in the
Prefect-stack tests: a restart of the worker in its log after each quick Retry). Here such a run
is left for the next poll, once the token is back; every other run is submitted as Prefect does.

Run: ``python -m flows.worker_launch worker start --pool hsx-gpu --limit 1``.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

logger = logging.getLogger("hsx.worker")


def runs_to_submit(limiter: Any, flow_run_response: list[Any]) -> list[Any]:
    """The scheduled runs (WorkerFlowRunResponse entries) whose id holds no token of the
    worker's limiter (anyio's CapacityLimiter; None without ``--limit``)."""
    if limiter is None:
        return flow_run_response
    held = set(limiter.statistics().borrowers)
    for entry in flow_run_response:
        if entry.flow_run.id in held:
            logger.info(
                "flow run %s is scheduled again while its last attempt still holds a slot: "
                "left for the next poll",
                entry.flow_run.id,
            )
    return [entry for entry in flow_run_response if entry.flow_run.id not in held]


def skip_runs_still_holding_a_slot() -> bool:
    """Patch the installed Prefect's worker as the module says; False (and Prefect unchanged)
    where it does not have the method and limiter this relies on."""
    from prefect.workers.base import BaseWorker

    original = getattr(BaseWorker, "_submit_scheduled_flow_runs", None)
    if original is None or getattr(original, "_hsx_patched", False):
        return original is not None

    async def submit(self: Any, flow_run_response: list[Any]) -> list[Any]:
        submittable = runs_to_submit(getattr(self, "_limiter", None), flow_run_response)
        return list(await original(self, submittable))

    submit._hsx_patched = True  # type: ignore[attr-defined]
    BaseWorker._submit_scheduled_flow_runs = submit  # type: ignore[method-assign]
    return True


def main() -> None:
    # A job started with & by a non-interactive shell ignores SIGINT, and Prefect's worker turns
    # SIGTERM into a SIGINT to itself: restored, one SIGTERM stops it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not skip_runs_still_holding_a_slot():
        print(
            "hsx: this Prefect's worker has no _submit_scheduled_flow_runs; unpatched",
            file=sys.stderr,
        )
    from prefect.cli import app

    sys.argv[0] = "prefect"
    sys.exit(app())


if __name__ == "__main__":
    main()
