"""Where the time goes: process-wide accumulators of seconds (and counts, bytes) per stage,
cheap enough to stay on in production (one perf_counter pair and a lock per event).

Stages: "engine_step" (the driver thread inside vLLM's step), "d2h_copy" (the connector's
device-to-host copies, on their own stream), "append" (rows copied and hashed into staging),
"write" (storage objects written), "commit" (commit records). The benchmark prints them.
An engine in a child process sends its own accumulators along with the states it hands over;
they appear here as "engine:<stage>".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Stage:
    seconds: float = 0.0
    count: int = 0
    nbytes: int = 0


_STAGES: dict[str, Stage] = {}
_LOCK = threading.Lock()


def add(stage: str, seconds: float, nbytes: int = 0) -> None:
    with _LOCK:
        entry = _STAGES.setdefault(stage, Stage())
        entry.seconds += seconds
        entry.count += 1
        entry.nbytes += nbytes


@contextmanager
def timed(stage: str, nbytes: int = 0) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        add(stage, time.perf_counter() - started, nbytes)


def snapshot() -> dict[str, Stage]:
    with _LOCK:
        return {name: Stage(s.seconds, s.count, s.nbytes) for name, s in _STAGES.items()}


def reset() -> None:
    with _LOCK:
        _STAGES.clear()


def replace(stages: dict[str, Stage]) -> None:
    """Set stages to the given totals (another process's accumulators, e.g. the engine's)."""
    with _LOCK:
        _STAGES.update(stages)
