"""The servers of ``engine.url`` for one process: each work chunk goes whole to one of them.

A chunk asks the pool for a server when it starts: the live one with the fewest prompt tokens
outstanding, so disjoint chunks of one plan spread over the servers. A server whose requests
fail (its process died, it restarted) is dropped; the chunk fails, and its retry asks the pool
again and lands on a server that answers. Servers that are down are asked again at most every
``timeouts.server_recheck_s``; with none up, a chunk waits up to ``engine.server_wait_s`` for one. A server
that serves something other than the run froze is refused (ServerMismatchError, fatal).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from hsx.engine.server_client import ServerEngine, ServerMismatchError
from hsx.errors import ConfigError, EngineError
from settings import TimeoutSettings

logger = logging.getLogger(__name__)


@dataclass
class PoolReport:
    """What preflight found of each server."""

    ready: dict[str, dict[str, Any]] = field(default_factory=dict)  # url -> its /hsx/info
    mismatched: dict[str, list[str]] = field(default_factory=dict)  # url -> each difference
    unreachable: dict[str, str] = field(default_factory=dict)  # url -> the last error


class ServerPool:
    def __init__(
        self,
        urls: Sequence[str],
        expected: dict[str, Any],
        hidden_size: int,
        ring_bytes: int,
        wait_s: float,
        api_key: str | None = None,
        timeouts: TimeoutSettings | None = None,
    ) -> None:
        if not urls:
            raise ConfigError("engine.url: expected at least one server URL, found none")
        self.urls = tuple(urls)
        self._expected = expected
        self._hidden_size = hidden_size
        self._ring_bytes = ring_bytes
        self._wait_s = wait_s
        self._api_key = api_key
        self._timeouts = timeouts or TimeoutSettings()
        self._clients: dict[str, ServerEngine] = {}
        self._down_since: dict[str, float] = {}
        self._last_error: dict[str, str] = {}
        self._connecting: set[str] = set()  # connect attempts in flight (threads of their own)
        self._refused: dict[str, ConfigError] = {}  # url -> why it serves nothing for this run
        self._closed = False
        self._lock = threading.Lock()

    def _start_connect_locked(self, url: str) -> None:
        """Connect to ``url`` in a thread of its own unless it is connected, being connected,
        or was down less than ``timeouts.server_recheck_s`` ago. The pool's lock is never held over network I/O
        (the /hsx/info fetch and the handshake take up to a minute): chunks that finish
        release, and chunks that start acquire a live server, meanwhile."""
        client = self._clients.get(url)
        if client is not None and client.alive:
            return
        if client is not None:
            self._drop_locked(client)
        if url in self._connecting or self._closed:
            return
        if time.monotonic() - self._down_since.get(url, -1e9) < self._timeouts.server_recheck_s:
            return
        self._connecting.add(url)
        threading.Thread(
            target=self._connect, args=(url,), name=f"hsx-connect-{url}", daemon=True
        ).start()

    def _connect(self, url: str) -> None:
        """One attempt (no wait on one server: the pool waits across all of them)."""
        client: ServerEngine | None = None
        error: str | None = None
        refusal: ConfigError | None = None
        try:
            client = ServerEngine(
                url,
                self._expected,
                self._hidden_size,
                self._ring_bytes,
                0.0,
                self._api_key,
                self._timeouts,
            )
        except ConfigError as exc:  # serves something else, or not an `hsx serve` at all
            refusal, error = exc, str(exc)
        except Exception as exc:  # down, restarting, a failed handshake: asked again later
            error = str(exc) if isinstance(exc, EngineError) else repr(exc)
        with self._lock:
            self._connecting.discard(url)
            if client is not None and not self._closed:
                self._clients[url] = client
                self._down_since.pop(url, None)
                self._refused.pop(url, None)
                return
            self._down_since[url] = time.monotonic()
            self._last_error[url] = error or "pool closed"
            if refusal is not None:
                self._refused[url] = refusal
        if client is not None:  # connected after the pool closed
            client.close()

    def _live_locked(self) -> list[ServerEngine]:
        for url in self.urls:
            self._start_connect_locked(url)
        return [c for c in self._clients.values() if c.alive]

    def acquire(self) -> ServerEngine:
        """The server for the next chunk (the one with the fewest chunks, then the fewest
        tokens outstanding); the caller releases it. ServerMismatchError (fatal) for a server
        that serves something else; EngineError when none answers within
        ``engine.server_wait_s``."""
        deadline = time.monotonic() + self._wait_s
        while True:
            with self._lock:
                if self._refused:
                    raise next(iter(self._refused.values()))
                live = self._live_locked()
                if live:
                    # Chunks first: chunks that start together have queued nothing yet.
                    chosen = min(live, key=lambda c: (c.chunks, c.outstanding_tokens))
                    chosen.chunks += 1
                    return chosen
                connecting = bool(self._connecting)
            if time.monotonic() >= deadline and not connecting:
                raise EngineError(
                    f"engine.url: expected one of {len(self.urls)} servers to answer within "
                    f"{self._wait_s:g} s (engine.server_wait_s), found none: "
                    + "; ".join(f"{u}: {self._last_error.get(u, 'down')}" for u in self.urls)
                )
            time.sleep(0.05)

    def check(self, wait_s: float) -> PoolReport:
        """Connect to every server (waiting up to ``wait_s`` for at least one to answer, and
        for the others as long as that took): each one's identity and a handshake."""
        report = PoolReport()
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self._live_locked()
                for url in self.urls:
                    client = self._clients.get(url)
                    if client is not None and client.alive:
                        report.ready[url] = client.info
                        report.unreachable.pop(url, None)
                    elif url in self._refused:
                        refusal = self._refused[url]
                        report.mismatched[url] = (
                            refusal.problems
                            if isinstance(refusal, ServerMismatchError)
                            else [str(refusal)]
                        )
                    elif url not in self._connecting and url in self._last_error:
                        report.unreachable[url] = self._last_error[url]
                tried_all = not self._connecting and all(
                    u in report.ready or u in report.mismatched or u in report.unreachable
                    for u in self.urls
                )
            if tried_all and (report.ready or report.mismatched or time.monotonic() >= deadline):
                return report
            time.sleep(0.05)

    def release(self, client: ServerEngine) -> None:
        """A chunk acquired from ``client`` is over (committed or failed)."""
        with self._lock:
            client.chunks -= 1

    def drop(self, client: ServerEngine) -> None:
        """Forget a client whose server failed it; the next acquire connects anew."""
        with self._lock:
            self._drop_locked(client)

    def _drop_locked(self, client: ServerEngine) -> None:
        if self._clients.get(client.url) is client:
            del self._clients[client.url]
        self._down_since[client.url] = time.monotonic()
        self._last_error[client.url] = f"dropped after a failure: {client.failure!r}"
        client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for client in list(self._clients.values()):
                client.close()
            self._clients.clear()


_POOLS: dict[str, ServerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_server_pool(
    urls: Sequence[str],
    expected: dict[str, Any],
    hidden_size: int,
    ring_bytes: int,
    wait_s: float,
    api_key: str | None = None,
    timeouts: TimeoutSettings | None = None,
) -> ServerPool:
    """The process's pool for these servers and this identity (kept across chunks and runs:
    a long-lived worker keeps its channels). Another key (rotated) is another pool."""
    key_digest = xxhash.xxh3_64_hexdigest((api_key or "").encode())
    timeouts = timeouts or TimeoutSettings()
    key = repr((tuple(urls), sorted(expected.items()), hidden_size, wait_s, key_digest, timeouts))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = ServerPool(urls, expected, hidden_size, ring_bytes, wait_s, api_key, timeouts)
            _POOLS[key] = pool
        return pool


@atexit.register
def close_all_pools() -> None:
    """Close every channel (their folders in /dev/shm go with them)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
