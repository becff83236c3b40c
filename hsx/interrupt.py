"""A process-wide stop request: the first Ctrl-C (or SIGTERM) stops new work; chunks in flight
abandon at their next batch boundary, before their commit, so nothing is half-committed and a
re-run redoes exactly them. Set by the entry point's signal handler; read by the flow and by
extract_chunk."""

from __future__ import annotations

import threading

from hsx.errors import FatalError

_STOP = threading.Event()
_REASON: list[str] = []


class RunInterruptedError(FatalError):
    """The run was asked to stop (a signal): not retried; what is committed stays committed."""


def request_stop(reason: str) -> None:
    if not _STOP.is_set():
        _REASON.append(reason)
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def stop_reason() -> str:
    return _REASON[0] if _REASON else "not stopped"


def raise_if_stopped(where: str) -> None:
    if _STOP.is_set():
        raise RunInterruptedError(
            f"{where}: abandoned before its commit because the run was stopped ({stop_reason()}); "
            "a re-run extracts it again"
        )


def clear_stop() -> None:
    """For a long-lived process (tests, a worker) that runs again after a stop."""
    _STOP.clear()
    _REASON.clear()
