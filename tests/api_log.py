"""The Prefect server's API requests, counted from its access log as they happen.

With ``PREFECT_SERVER_LOGGING_LEVEL=INFO`` the server's uvicorn logs one line per HTTP request
(``INFO: 127.0.0.1:PORT - "POST /api/flow_runs/filter HTTP/1.1" 200 OK``) and one per websocket
it accepts (events in and out; the events themselves travel inside those sockets and are not
requests). The lines carry no time, so a thread reads the growing log every POLL_S and stamps
each new line with its arrival: peaks per second are good to about POLL_S.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.2
# The request line of an access log entry: method and path without the query string.
REQUEST = re.compile(r'"(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (/[^ ?"]*)[^"]* HTTP/[0-9.]+"')
WEBSOCKET = re.compile(r'"WebSocket (/[^ ?"]*)')


@dataclass
class ApiWindow:
    """The requests seen between two instants."""

    requests: int
    websockets: int
    seconds: float
    peak_per_s: int
    by_path: Counter[str] = field(default_factory=Counter)

    @property
    def mean_per_s(self) -> float:
        return self.requests / max(self.seconds, 1e-9)


class ApiLogTally:
    """``with ApiLogTally(server_log) as tally: ...; tally.window(t0, t1)``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.requests: list[tuple[float, str]] = []  # (monotonic arrival, "METHOD /path")
        self.websockets: list[tuple[float, str]] = []
        self._offset = log.stat().st_size if log.exists() else 0  # earlier lines: not ours
        self._partial = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._follow, name="api-log", daemon=True)

    def __enter__(self) -> ApiLogTally:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _follow(self) -> None:
        while not self._stop.is_set():
            self._read()
            time.sleep(POLL_S)
        self._read()

    def _read(self) -> None:
        if not self.log.exists():
            return
        with self.log.open("r", errors="replace") as file:
            file.seek(self._offset)
            text = file.read()
            self._offset = file.tell()
        now = time.monotonic()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # a line still being written
        with self._lock:
            for line in lines:
                if request := REQUEST.search(line):
                    self.requests.append((now, f"{request[1]} {_route(request[2])}"))
                elif socket := WEBSOCKET.search(line):
                    self.websockets.append((now, socket[1]))

    def window(self, start: float, end: float) -> ApiWindow:
        """Requests that arrived in [start, end] (time.monotonic() instants)."""
        self._read()
        with self._lock:
            inside = [(t, r) for t, r in self.requests if start <= t <= end]
            sockets = [s for t, s in self.websockets if start <= t <= end]
        per_second = Counter(int(t - start) for t, _ in inside)
        return ApiWindow(
            requests=len(inside),
            websockets=len(sockets),
            seconds=end - start,
            peak_per_s=max(per_second.values(), default=0),
            by_path=Counter(r for _, r in inside),
        )


def _route(path: str) -> str:
    """A path with its ids replaced (``/api/flow_runs/{id}/set_state``): one route, one row."""
    return re.sub(r"/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "/{id}", path)
