"""What every hsx task shares: the retry policy and logging of failures with their traceback."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.logging import get_run_logger
from prefect.states import State

from hsx.errors import is_retryable, portable_error
from hsx.interrupt import RunInterruptedError, stop_requested


def retry_unless_fatal(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect's retry_condition_fn: fatal hsx errors (bad config, signature or data mismatch)
    end the task at once; transient ones (engine crash, I/O) go on to the retry policy."""
    if stop_requested():  # the run is stopping: a retry would be abandoned anyway
        return False
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, BaseException) or is_retryable(exc)


def backoff(first_delay: float, retries: int) -> list[float]:
    """Doubling delays: first, 2*first, 4*first, ... (Prefect adds jitter)."""
    return [first_delay * (2**attempt) for attempt in range(max(retries, 1))]


@contextmanager
def logged_failures(what: str) -> Iterator[logging.Logger | logging.LoggerAdapter[Any]]:
    """Log ``repr(exc)`` and the full traceback of any failure, then re-raise.

    Prefect shows a retried task's traceback, but a task refused by retry_condition_fn is logged
    without one; this makes every failure carry its traceback in the run's logs."""
    logger = get_run_logger()
    try:
        yield logger
    except RunInterruptedError as exc:  # a stop asked for, not a fault: no traceback
        logger.warning("%s", exc)
        raise
    except Exception as exc:
        kind = (
            "transient, will retry if attempts remain"
            if is_retryable(exc)
            else "fatal, not retried"
        )
        logger.error("%s failed (%s): %r", what, kind, exc, exc_info=True)
        portable = portable_error(exc)
        if portable is exc:
            raise
        # Prefect stores a failed task's exception as its result, by pickling it: one that does
        # not pickle (pydantic's ValidationError) would log a serializer warning instead.
        raise portable from None


def describe(exc: BaseException) -> str:
    """Never an empty message: the seed's `ERROR in batch 0-4: ` came from str() of an error
    without one."""
    return repr(exc) if str(exc) else f"{type(exc).__name__} (no message) {exc!r}"


RetryCondition = Callable[[Task[..., Any], TaskRun, State[Any]], bool]
