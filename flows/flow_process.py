"""The process a worker starts for a flow run of hsx's deployments (infra/prefect.yaml's
``command``): Prefect's own engine, ``python -m prefect.engine``, with one difference: once the
engine has reported the run's end (Failed, say), the process exits 0.

Why: Prefect 3.7.7's runner and process worker each report a "Crashed" state ("Flow run process
exited with non-zero status code 1", "Flow run infrastructure exited ...") for a flow-run process
that exits non-zero, seconds after the exit. The engine exits 1 for a run that failed, whose
Failed state it has already reported. Refused while the run is Failed, those late reports are
taken once a user pressed Retry (the run is then AwaitingRetry): the retry was lost, the run
Crashed, with a message that hid the real cause. A process that ends before reporting its run's
end (killed, the engine itself failing) still exits non-zero and is reported Crashed.
"""

from __future__ import annotations

import os
import runpy
import sys
from uuid import UUID


def main() -> None:
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (0, None) and _end_reported():
            print(
                f"hsx: the flow run's end is reported ({exc.code!r} from the engine): exiting 0 "
                "so that Prefect reports no crash over it (a Retry pressed now must stand)",
                file=sys.stderr,
            )
            sys.exit(0)
        raise


def _end_reported() -> bool:
    """Whether the run is past its Running state (ended, or already retried or rescheduled)."""
    run_id = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PREFECT__FLOW_RUN_ID")
    if not run_id:
        return False
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state
    except Exception as exc:  # the API unreachable: keep the engine's exit code
        print(f"hsx: could not read flow run {run_id}'s state: {exc!r}", file=sys.stderr)
        return False
    return state is not None and not (state.is_running() or state.is_pending())


if __name__ == "__main__":
    main()
