"""What the CLI wraps around a flow run: its own temporary Prefect server, and a stop on signal.

The first Ctrl-C or SIGTERM asks the run to stop (hsx.interrupt): no new chunk starts, chunks in
flight commit or abandon at their next batch, and the CLI reports and exits within seconds. If
it has not exited after a short grace (an engine that does not return), or on a second signal,
the process exits at once: the store never holds anything half-committed, whatever the moment.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from flows.temporary_server import TemporaryServer
from hsx.interrupt import request_stop, stop_requested

# Seconds between the first signal and a forced exit: enough for chunks in flight to reach a
# batch boundary and for the CLI to print what is committed.
STOP_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + signum


class SignalStop:
    """Signal handlers for the lifetime of a run; ``signum`` is the first signal received."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            # A second signal: the user does not want to wait. Commits are atomic, so nothing
            # half-written can be taken as done.
            sys.stderr.write(f"\nhsx: {name} again: exiting now\n")
            sys.stderr.flush()
            os._exit(exit_code(signum))
        self.signum = signum
        request_stop(f"{name} received")
        sys.stderr.write(
            f"\nhsx: {name} received: no new chunks start; chunks in flight commit or are "
            f"abandoned (a re-run redoes them). Exiting within {self.grace_s:.0f} s; "
            "send it again to exit now.\n"
        )
        sys.stderr.flush()
        threading.Thread(
            target=self._exit_after_grace, args=(signum,), name="hsx-stop-watchdog", daemon=True
        ).start()

    def _exit_after_grace(self, signum: int) -> None:
        threading.Event().wait(self.grace_s)
        sys.stderr.write(
            f"hsx: still running {self.grace_s:.0f} s after {signal.Signals(signum).name}: "
            "exiting now (nothing half-committed is ever taken as done)\n"
        )
        sys.stderr.flush()
        os._exit(exit_code(signum))

    @property
    def stopped(self) -> bool:
        return stop_requested()


@contextmanager
def guarded_run(log_dir: Path) -> Iterator[SignalStop]:
    """A temporary Prefect server owned by this process (when no PREFECT_API_URL is set) and the
    stop-on-signal handlers, for one flow run. Call before prefect is imported: Prefect reads
    PREFECT_API_URL once."""
    server: TemporaryServer | None = None
    # Where prefect is already imported (a test harness, a worker), its settings are fixed and
    # its own server, if any, is used.
    if not os.environ.get("PREFECT_API_URL") and "prefect" not in sys.modules:
        server = TemporaryServer(log_dir)
        os.environ["PREFECT_API_URL"] = server.api_url
    stop = SignalStop()
    stop.install()
    try:
        yield stop
    finally:
        stop.restore()
        if server is not None:
            drain_prefect_workers(timeout_s=3.0)  # the run's last logs and events reach it
            server.stop()


def drain_prefect_workers(timeout_s: float) -> None:
    """Send what Prefect's log and event workers still hold, within ``timeout_s``; without it
    they retry a stopped server at exit ("Still processing items")."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s / 2)
