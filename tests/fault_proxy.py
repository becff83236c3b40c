"""A TCP proxy on 127.0.0.1 between an S3 client (s3fs/botocore) and an S3-compatible server
(moto), that injects the faults object stores really produce, per HTTP request:

- ``slowdown``: answer the request with HTTP 503 and S3's SlowDown error body (throttling);
- ``drop``: read the request, then close the connection without an answer (a dropped
  connection mid-request);
- ``fail``: a persistent HTTP 500 InternalError for every request whose method and path match
  (a key that cannot be written until the rule is cleared);
- ``refuse``: every new connection is closed at once and open ones are cut (a dead endpoint).

HTTP/1.1 requests on one connection are sequential (the client does not pipeline), so the
proxy relays bytes both ways and only parses request heads and Content-Length bodies going
upstream: a fault is decided at each request boundary. A faulted connection is closed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>hsx-fault-proxy</RequestId></Error>"
)
INTERNAL_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message>"
    b"<RequestId>hsx-fault-proxy</RequestId></Error>"
)


def _response(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class FaultPlan:
    """Which requests fail: every ``period``-th request (counting from the first after
    ``arm``), cycling through ``kinds``, at most ``limit`` of them."""

    period: int = 0
    kinds: tuple[str, ...] = ()
    limit: int = 0
    # (method, path substring): answered 500 InternalError while present.
    failing: list[tuple[str, str]] = field(default_factory=list)


class FaultProxy:
    """``with FaultProxy(upstream_port) as proxy: ... proxy.url``; thread-safe controls."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._plan = FaultPlan()
        self._seen = 0  # requests since the plan was armed
        self.refuse = False
        self.injected: Counter[str] = Counter()  # faults answered, by kind
        self.requests: Counter[str] = Counter()  # requests seen, by method
        self.paths: Counter[tuple[str, str]] = Counter()  # requests seen, by method and path
        self._open: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    # ---- controls ----------------------------------------------------------------------------
    def arm(self, period: int, kinds: tuple[str, ...], limit: int) -> None:
        with self._lock:
            self._plan = FaultPlan(period, kinds, limit, self._plan.failing)
            self._seen = 0

    def fail_requests(self, method: str, path_part: str) -> None:
        with self._lock:
            self._plan.failing.append((method.upper(), path_part))

    def clear(self) -> None:
        with self._lock:
            self._plan = FaultPlan()
            self.refuse = False

    def refuse_all(self) -> None:
        with self._lock:
            self.refuse = True
            open_now = list(self._open)
        for sock in open_now:  # cut the pooled keep-alive connections too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # ---- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self.refuse
            if refuse:
                self.injected["refuse"] += 1
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    # ---- one client connection -----------------------------------------------------------------
    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests[method] += 1
            self.paths[(method, path.split("?", 1)[0])] += 1
            if self.refuse:
                return "refuse"
            if any(method == m and part in path for m, part in self._plan.failing):
                return "fail"
            plan = self._plan
            self._seen += 1
            if (
                plan.period
                and plan.kinds
                and sum(self.injected[k] for k in plan.kinds) < plan.limit
                and self._seen % plan.period == 0
            ):
                return plan.kinds[(self._seen // plan.period) % len(plan.kinds)]
            return None

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        with self._lock:
            self._open.add(client)
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
            with self._lock:
                self._open.add(upstream)
            back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
            back.start()
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = client.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = [*lines[0].split(" "), "", ""][:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:])
                }
                length = int(headers.get("content-length", "0") or 0)
                expect = headers.get("expect", "").lower() == "100-continue"
                fault = self._decide(method.upper(), path)
                if fault is not None:
                    if not expect:  # the client sends its body before it reads an answer
                        while len(buffer) < length:
                            data = client.recv(65536)
                            if not data:
                                break
                            buffer += data
                    with self._lock:
                        self.injected[fault] += 1
                    if fault == "slowdown":
                        client.sendall(_response("503 Slow Down", SLOWDOWN_BODY))
                    elif fault == "fail":
                        client.sendall(_response("500 Internal Server Error", INTERNAL_BODY))
                    return  # "drop" and "refuse": close without an answer
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    # Not parsed: relay the rest of this connection as it is, unfaulted.
                    upstream.sendall(head + b"\r\n\r\n" + buffer)
                    self._pump(client, upstream)
                    return
                upstream.sendall(head + b"\r\n\r\n")
                sent = 0
                while sent < length:
                    if not buffer:
                        buffer = client.recv(min(65536, length - sent))
                        if not buffer:
                            return
                    part, buffer = buffer[: length - sent], buffer[length - sent :]
                    upstream.sendall(part)
                    sent += len(part)
        except OSError:
            return
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._open.discard(sock)
                    with contextlib.suppress(OSError):
                        sock.close()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
