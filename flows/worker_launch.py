"""``prefect worker start`` as infra/start-worker.sh runs it, with one fix for Prefect 3.7's
worker: a flow run retried (the UI's Retry) while its last attempt's process is still exiting is
submitted again under the same id while the worker's ``--limit`` limiter still holds that id's
token, and ``acquire_on_behalf_of_nowait`` raises "this borrower is already holding one of this
CapacityLimiter's tokens" out of the worker's poll loop: the whole worker exits (seen in the
Prefect-stack tests: a restart of the worker in its log after each quick Retry). Here such a run
is left for the next poll, once the token is back; every other run is submitted as Prefect does.

A worker's stop (one SIGTERM or Ctrl-C: systemctl stop, docker stop, start-worker.sh's own
SIGTERM) lets the runs it holds end as a stopped run ends: Prefect 3.7's worker exits at once and
its event loop's teardown SIGKILLs the flow-run processes (measured: gone 0.35 s after the
SIGTERM, the store's record still "running", the run Running until the zombie automation
crashed it 65 s later, a chunk task Running for ever). Here the worker takes no new run, sends
each flow-run process SIGTERM (the flows record what they committed, abandoned and never
started, and end Cancelled), waits up to HSX_WORKER_STOP_GRACE_S (60 s) for them, kills what is
left, marks those runs Crashed, and only then stops as Prefect does. infra/systemd's and
infra/compose.yaml's stop timeouts are longer than that grace.

Whenever a flow-run process has ended (stopped, killed, crashed), its task runs still Running or
Pending are closed: Cancelled when the run was, else Crashed.

Run: ``python -m flows.worker_launch worker start --pool hsx-gpu --limit 1``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any
from uuid import UUID

logger = logging.getLogger("hsx.worker")

# Seconds the flow runs of a stopping worker get to end on their own (a stopped extraction
# records and ends in seconds: stop_wait_s, 5 s, for its chunks in flight, then its record).
# infra/systemd/hsx-worker.service (TimeoutStopSec) and infra/compose.yaml (stop_grace_period)
# give the whole stop 120 s: the grace, 10 s for a killed process, CLOSE_WAIT_S, the rest.
STOP_GRACE_S = 60.0
STOP_GRACE_VARIABLE = "HSX_WORKER_STOP_GRACE_S"
# Seconds a stopping worker gives the API to take its runs' last states (then it stops anyway).
CLOSE_WAIT_S = 15.0


def runs_to_submit(limiter: Any, flow_run_response: list[Any], stopping: bool = False) -> list[Any]:
    """The scheduled runs (WorkerFlowRunResponse entries) whose id holds no token of the
    worker's limiter (anyio's CapacityLimiter; None without ``--limit``); none once the worker
    is ``stopping`` (it starts nothing more)."""
    if stopping:
        return []
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
        submittable = runs_to_submit(
            getattr(self, "_limiter", None), flow_run_response, STOP.stopping.is_set()
        )
        return list(await original(self, submittable))

    submit._hsx_patched = True  # type: ignore[attr-defined]
    BaseWorker._submit_scheduled_flow_runs = submit  # type: ignore[method-assign]
    return True


def flow_run_processes(parent: int) -> dict[int, UUID]:
    """The running child processes of ``parent`` that Prefect started for a flow run: pid ->
    flow run id (their PREFECT__FLOW_RUN_ID)."""
    found: dict[int, UUID] = {}
    for pid in _children(parent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"PREFECT__FLOW_RUN_ID="):
                found[pid] = UUID(entry.split(b"=", 1)[1].decode())
    return found


def _children(parent: int) -> list[int]:
    """The child processes of ``parent``: /proc's children lists, or where the kernel has none
    (CONFIG_PROC_CHILDREN), every process whose parent it is."""
    lists = list(Path(f"/proc/{parent}/task").glob("*/children"))
    if lists:
        pids: list[int] = []
        for children in lists:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                pids.extend(int(p) for p in children.read_text().split())
        return pids
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
    return found


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by its parent has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def close_stale_task_runs(flow_run_id: UUID, ended_at: datetime.datetime) -> list[str]:
    """Close the task runs of a flow run whose process has ended (at ``ended_at``) that are
    still Running or Pending: nothing runs them any more. Cancelled when the flow run is
    Cancelled, else Crashed; task runs created after ``ended_at`` (a Retry's new attempt) are
    left alone. Returns the names of those closed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Crashed

    closed: list[str] = []
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        cancelled = state is not None and state.is_cancelled()
        stale = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(
                    type=TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]),
                    name=None,
                )
            ),
        )
        ended_as = state.name if state else "?"
        message = f"its flow run's process ended while it ran (flow run {ended_as})"
        for task_run in stale:
            if task_run.created is not None and task_run.created > ended_at:
                continue
            client.set_task_run_state(
                task_run.id,
                Cancelled(message=message) if cancelled else Crashed(message=message),
                force=True,
            )
            closed.append(task_run.name)
    if closed:
        logger.warning(
            "flow run %s: closed %d task runs its ended process left open: %s",
            flow_run_id,
            len(closed),
            ", ".join(sorted(closed)[:20]),
        )
    return closed


def crash_if_unfinished(flow_run_id: UUID, message: str) -> bool:
    """Mark a flow run Crashed when its process ended without reporting an end (killed)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_final():
            return False
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        return True


def close_runs_after_their_process() -> bool:
    """Patch the worker so that, once a flow-run process has ended and Prefect has reported
    it, the task runs it left open are closed (close_stale_task_runs)."""
    from prefect.workers.base import BaseWorker

    original = getattr(BaseWorker, "_submit_run_and_capture_errors", None)
    if original is None or getattr(original, "_hsx_patched", False):
        return original is not None

    async def submit_run(self: Any, flow_run: Any, *args: Any, **kwargs: Any) -> Any:
        import anyio

        try:
            return await original(self, flow_run, *args, **kwargs)
        finally:
            ended = datetime.datetime.now(datetime.UTC)
            try:
                # Shielded (a stopping worker cancels its tasks), bounded (an API that is away).
                with anyio.move_on_after(30, shield=True):
                    await anyio.to_thread.run_sync(
                        close_stale_task_runs, flow_run.id, ended, abandon_on_cancel=True
                    )
            except Exception as exc:  # the API away: the UI keeps the task Running, nothing else
                logger.warning("flow run %s: task runs not closed: %r", flow_run.id, exc)

    submit_run._hsx_patched = True  # type: ignore[attr-defined]
    BaseWorker._submit_run_and_capture_errors = submit_run  # type: ignore[method-assign]
    return True


class WorkerStop:
    """The worker's SIGTERM and SIGINT, as the module says: the first starts a graceful stop
    (a thread), a repeated SIGTERM is ignored (systemd's KillMode=control-group sends one to
    every process, start-worker.sh forwards its own), a second SIGINT (Ctrl-C twice) stops at
    once, as Prefect's worker does."""

    def __init__(self, grace_s: float, say: Callable[[str], None]) -> None:
        self.grace_s = grace_s
        self.say = say
        self.stopping = threading.Event()
        self._now = False  # the next signal raises KeyboardInterrupt: Prefect's own stop
        self.graceful = False  # the flow runs were let end before Prefect's stop
        self.thread: threading.Thread | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._now:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        if self.stopping.is_set():
            if signum == signal.SIGINT:
                self.say(f"hsx worker: {name} again: stopping now")
                raise KeyboardInterrupt
            self.say(f"hsx worker: {name} again: already stopping (at most {self.grace_s:.0f} s)")
            return
        self.stopping.set()
        self.thread = threading.Thread(
            target=self._stop, args=(name,), name="hsx-worker-stop", daemon=True
        )
        self.thread.start()

    def _stop(self, name: str) -> None:
        try:
            self.stop_flow_runs(name)
        except Exception as exc:  # never keep the worker from stopping
            self.say(f"hsx worker: stopping its flow runs failed: {exc!r}")
        self.graceful = self._now = True
        os.kill(os.getpid(), signal.SIGINT)  # a real signal: it wakes the event loop's select

    def stop_flow_runs(self, name: str) -> None:
        runs = flow_run_processes(os.getpid())
        self.say(
            f"hsx worker: {name} received: no new flow runs; "
            + (
                f"SIGTERM to the {len(runs)} running ({', '.join(map(str, runs.values()))}), "
                f"which get {self.grace_s:.0f} s to end Cancelled with their records"
                if runs
                else "none running"
            )
        )
        for pid in runs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        while any(not process_ended(pid) for pid in runs):
            if time.monotonic() - started > self.grace_s:
                break
            time.sleep(0.2)
        killed = {pid: run for pid, run in runs.items() if not process_ended(pid)}
        for pid, run in killed.items():
            self.say(f"hsx worker: flow run {run} did not end within {self.grace_s:.0f} s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if runs:
            self.say(
                f"hsx worker: {len(runs) - len(killed)} of {len(runs)} flow runs ended in "
                f"{time.monotonic() - started:.1f} s"
            )
        deadline = time.monotonic() + 10
        while any(not process_ended(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = datetime.datetime.now(datetime.UTC)

        def close() -> None:
            for pid, run in runs.items():
                try:
                    if pid in killed:
                        crash_if_unfinished(
                            run,
                            f"the worker stopped ({name}) and its process did not end within "
                            f"{self.grace_s:.0f} s: killed",
                        )
                    else:
                        # Ended on its own: a process that exited without reporting (its flow
                        # had not started yet) is crashed; the flow's own Cancelled stays.
                        crash_if_unfinished(
                            run,
                            f"the worker stopped ({name}); the run's process ended without an end",
                        )
                    close_stale_task_runs(run, ended)
                except Exception as exc:
                    self.say(f"hsx worker: flow run {run} not closed: {exc!r}")

        # The API may be away (the server stopped first): the stop must not wait on its client's
        # retries past the unit's stop timeout.
        closing = threading.Thread(target=close, name="hsx-worker-close", daemon=True)
        closing.start()
        closing.join(CLOSE_WAIT_S)
        if closing.is_alive():
            self.say(f"hsx worker: the API did not answer within {CLOSE_WAIT_S:.0f} s; stopping")


STOP = WorkerStop(STOP_GRACE_S, print)


def stop_grace_s(environ: dict[str, str] | os._Environ[str]) -> float:
    """HSX_WORKER_STOP_GRACE_S, or STOP_GRACE_S where unset."""
    raw = environ.get(STOP_GRACE_VARIABLE, "")
    if not raw:
        return STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise SystemExit(f"{STOP_GRACE_VARIABLE}: expected seconds (a number >= 0), found {raw!r}")
    return value


def stop_gracefully() -> bool:
    """Prefect's worker CLI installs its signal handlers through this function; replaced, the
    worker stops as WorkerStop says. False where the installed Prefect has no such function."""
    from prefect.utilities import processutils

    if not hasattr(processutils, "setup_signal_handlers_worker"):
        return False

    def install(pid: int, process_name: str, print_fn: Callable[..., Any]) -> None:
        STOP.say = lambda text: print_fn(text)
        STOP.install()

    processutils.setup_signal_handlers_worker = install
    return True


def main() -> None:
    # A job started with & by a non-interactive shell ignores SIGINT: restored, then replaced by
    # WorkerStop's handlers once the worker starts (a signal before that stops it at once).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    STOP.grace_s = stop_grace_s(os.environ)
    for patched, what in (
        (skip_runs_still_holding_a_slot(), "_submit_scheduled_flow_runs"),
        (close_runs_after_their_process(), "_submit_run_and_capture_errors"),
        (stop_gracefully(), "setup_signal_handlers_worker"),
    ):
        if not patched:
            print(f"hsx: this Prefect's worker has no {what}; unpatched", file=sys.stderr)
    from prefect.cli import app

    sys.argv[0] = "prefect"
    try:
        app()
    except KeyboardInterrupt:
        if STOP.graceful:  # the stop this module made, runs ended: done, not interrupted
            sys.exit(0)
        raise


if __name__ == "__main__":
    main()
