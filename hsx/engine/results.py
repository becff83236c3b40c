"""Where a request's hidden states meet the request: the connector delivers rows (in-process,
through a registered sink; from another process, through the shared-memory result ring or, when
that is full, a spool file), the engine driver reports the request finished, and whichever comes
second resolves the caller's future.

With asynchronous device-to-host copies the rows of a request can arrive after vLLM returned it
as finished (the step does not wait for the copy), and from a child engine process the rows can
be announced after the finished output: neither side may assume the other came first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from hsx import timings
from hsx.engine.copier import read_spool_file
from hsx.engine.result_ring import RingReader
from hsx.errors import EngineError

Check = Callable[[str, int, torch.Tensor], torch.Tensor]

# How long the announcement reader waits before it looks for overdue requests (seconds).
_POLL_S = 0.05
# How long a request the engine reported finished may wait for its states before it fails
# (seconds). The engine process announces them right after the copy, so only a broken engine
# process (or a spool on another machine) gets here: fail the chunk, never hang.
SPOOL_WAIT_LIMIT_S = 300.0


class ResultRendezvous:
    def __init__(
        self,
        check: Check,
        spool_dir: str | None = None,
        ring_bytes: int = 0,
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
        self._ring: RingReader | None = None
        self._reader: threading.Thread | None = None
        if spool_dir is not None:
            self._ring = RingReader(spool_dir, ring_bytes)
            self._reader = threading.Thread(
                target=self._read_announcements, name="hsx-ring-reader", daemon=True
            )
            self._reader.start()

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
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._ring is not None:
            self._ring.close()

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

    # ---- engine core in another process: the ring's announcements ---------------------------
    def _read_announcements(self) -> None:
        ring = self._ring
        if ring is None:
            return
        while not self._closed:
            for message in ring.messages(timeout_s=_POLL_S):
                key = str(message.get("key", ""))
                rows: torch.Tensor | BaseException
                try:
                    if "error" in message:
                        rows = RuntimeError(message["error"] or "copy failed (no message)")
                    elif "file" in message:
                        started = time.perf_counter()
                        path = Path(message["file"])
                        rows = read_spool_file(path)
                        path.unlink(missing_ok=True)
                        timings.add("handover_file", time.perf_counter() - started, rows.nbytes)
                    else:
                        rows = ring.rows(message)
                        timings.add("handover_ring", 0.0, rows.nbytes)
                except Exception as exc:  # a broken announcement fails its request, not the reader
                    rows = EngineError(
                        f"request {key}: states could not be read ({message}): {exc!r}"
                    )
                self.deliver(key, rows)
                del rows  # held here, the rows' ring granules would wait for the next message
            self._fail_overdue()

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
                    f"request {key} finished in the engine process, but its states were not "
                    f"announced in {self._spool} within {self._spool_wait_limit_s:g} s "
                    "(expected hsx's connector in the engine process to announce them: is that "
                    "process running the same hsx code?)"
                ),
            )
