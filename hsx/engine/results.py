"""Where a request's hidden states meet the request: the connector delivers rows (in-process,
through a registered sink; from another process, as a spool file), the engine driver reports
the request finished, and whichever comes second resolves the caller's future.

With asynchronous device-to-host copies the rows of a request can arrive after vLLM returned it
as finished (the step does not wait for the copy), and from a child engine process a spool file
can appear after the finished output: neither side may assume the other came first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from hsx.engine.copier import SPOOL_SUFFIX, read_spool_file, spool_path
from hsx.errors import EngineError

Check = Callable[[str, int, torch.Tensor], torch.Tensor]
ERROR_SUFFIX = ".error"

# How often the spool is scanned while a finished request waits for its file (seconds).
_SPOOL_POLL = 0.002
# How long a request the engine reported finished may wait for its spool file before it fails
# (seconds). The engine process writes the file before the step returns the request, so only a
# broken engine process (or a spool on another machine) gets here: fail the chunk, never hang.
SPOOL_WAIT_LIMIT_S = 300.0


class ResultRendezvous:
    def __init__(
        self,
        check: Check,
        spool_dir: str | None = None,
        spool_wait_limit_s: float = SPOOL_WAIT_LIMIT_S,
    ) -> None:
        self._check = check  # shape validation: raises EngineError naming expected and found
        self._spool = spool_dir
        self._spool_wait_limit_s = spool_wait_limit_s
        self._expected_since: dict[str, float] = {}
        self._lock = threading.Condition()
        self._arrived: dict[str, torch.Tensor | BaseException] = {}
        self._expected: dict[str, tuple[int, Future[torch.Tensor]]] = {}
        self._closed = False
        self._poller: threading.Thread | None = None
        if spool_dir is not None:
            self._poller = threading.Thread(
                target=self._poll_spool, name="hsx-spool-poll", daemon=True
            )
            self._poller.start()

    # ---- connector side (in-process sink) -------------------------------------------------
    def deliver(self, key: str, rows: torch.Tensor | BaseException) -> None:
        with self._lock:
            waiting = self._expected.pop(key, None)
            self._expected_since.pop(key, None)
            if waiting is None:
                self._arrived[key] = rows
                return
        self._resolve(key, waiting, rows)

    # ---- driver side -------------------------------------------------------------------------
    def expect(self, key: str, tokens: int, future: Future[torch.Tensor]) -> None:
        """The engine reported ``key`` finished; resolve ``future`` when its rows are here."""
        with self._lock:
            rows = self._arrived.pop(key, None)
            if rows is None:
                self._expected[key] = (tokens, future)
                self._expected_since[key] = time.monotonic()
                self._lock.notify_all()
                return
        self._resolve(key, (tokens, future), rows)

    def pending(self) -> int:
        with self._lock:
            return len(self._expected)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiting = list(self._expected.values())
            self._expected.clear()
            self._expected_since.clear()
            self._arrived.clear()
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._poller is not None:
            self._poller.join(timeout=5)

    def _resolve(
        self,
        key: str,
        waiting: tuple[int, Future[torch.Tensor]],
        rows: torch.Tensor | BaseException,
    ) -> None:
        tokens, future = waiting
        if future.done():
            return
        if isinstance(rows, BaseException):
            failure = EngineError(f"request {key}: hidden-state copy failed: {rows!r}")
            failure.__cause__ = rows
            future.set_exception(failure)
            return
        try:
            future.set_result(self._check(key, tokens, rows))
        except EngineError as exc:
            future.set_exception(exc)

    # ---- spool (engine core in another process) ---------------------------------------------
    def _poll_spool(self) -> None:
        spool = self._spool
        if spool is None:
            return
        while True:
            with self._lock:
                while not self._expected and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                wanted = set(self._expected)
            found = []
            with os.scandir(spool) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(SPOOL_SUFFIX) and name[: -len(SPOOL_SUFFIX)] in wanted:
                        found.append((name[: -len(SPOOL_SUFFIX)], Path(entry.path), False))
                    elif name.endswith(ERROR_SUFFIX) and name[: -len(ERROR_SUFFIX)] in wanted:
                        found.append((name[: -len(ERROR_SUFFIX)], Path(entry.path), True))
            for key, path, is_error in found:
                rows: torch.Tensor | BaseException
                try:
                    if is_error:
                        rows = RuntimeError(path.read_text() or "copy failed (no message)")
                    else:
                        rows = read_spool_file(path)
                except Exception as exc:  # a broken file fails its request, not the poller
                    rows = EngineError(f"spool file {path} could not be read: {exc!r}")
                path.unlink(missing_ok=True)
                self.deliver(key, rows)
            self._fail_overdue()
            if not found:
                with self._lock:
                    self._lock.wait(timeout=_SPOOL_POLL)

    def _fail_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [
                key
                for key, since in self._expected_since.items()
                if now - since > self._spool_wait_limit_s
            ]
        for key in overdue:
            self.deliver(
                key,
                EngineError(
                    f"request {key} finished in the engine process, but its states did not "
                    f"appear in the spool {self._spool} within {self._spool_wait_limit_s:g} s "
                    "(expected a .rows or .error file written by hsx's connector in the engine "
                    "process: is that process running the same hsx code?)"
                ),
            )


def write_spool_error(spool_dir: str, key: str, error: BaseException) -> None:
    final = spool_path(spool_dir, key).with_suffix(ERROR_SUFFIX)
    temp = final.with_name(final.name + f".tmp{os.getpid()}")
    temp.write_text(repr(error))
    os.replace(temp, final)
