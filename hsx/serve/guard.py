"""`hsx serve`'s guard: one ASGI middleware in front of every route of vLLM's API server.

vLLM's own ``--api-key`` covers the routes under /v1, /v2, /inference and /cohere only: with a
key set, ``POST /invocations`` (SageMaker's route) still extracted for anyone, and /tokenize,
/metrics, /load, /version, /docs and /openapi.json answered anyone. vLLM loads this class with
``--middleware`` (outside its own middlewares) and it, for every request:

- lets ``/health`` through (systemd, compose and load balancers probe it without a key);
- answers 401 to anything else without the server's key (``server.api_key``, when set);
- answers ``GET /hsx/info`` (what the server serves, for clients' checks);
- reads the body (at most MAX_BODY_BYTES: 413 beyond), refuses one that is not JSON, and
  validates every ``kv_transfer_params`` in it (at any depth: vLLM also takes it from
  ``vllm_xargs``) with hsx's schema (400, naming the field, what was expected and found), then
  checks each channel a request names: the client's folder holding the secret the request
  sends, its ring of the size the request says (403 for a channel that is not the request's,
  400 for the rest). Only then does vLLM see the request, body unchanged.

What reaches the engine has passed the schema; the connector checks it again all the same
(hsx.engine.connector), and nothing a request sends can stop the engine there either.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from hsx.engine.channel_files import ChannelOwnershipError, ChannelRefusedError, OwnerRule
from hsx.engine.log_safety import shown
from hsx.engine.result_ring import check_channel
from hsx.engine.server_protocol import (
    API_KEY_ENV,
    CHANNEL_GIDS_ENV,
    HEALTH_PATH,
    INFO_PATH,
    TRANSFER_FIELD,
    RequestParamsError,
    TransferParams,
    key_accepted,
    served_info,
)

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The largest request body the server reads (vLLM reads any size whole): a batch of prompts as
# token ids takes about 7 bytes a token, so this is some 35 million tokens.
MAX_BODY_BYTES = 256 << 20
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    413: "RequestTooLargeError",
}


class GuardRefusalError(Exception):
    """A request the guard answers itself: its status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def owners_from_environment() -> OwnerRule:
    """Whose channels this server writes into: its user's, and server.channel_groups'."""
    gids = [int(g) for g in os.environ.get(CHANNEL_GIDS_ENV, "").split(",") if g.strip()]
    return OwnerRule.of_this_process(gids)


def body_problem(body: bytes, owners: OwnerRule) -> GuardRefusalError | None:
    """Why the guard refuses a request's body, or None: not JSON, a ``kv_transfer_params``
    anywhere in it that the schema refuses, or a channel that is not the request's."""
    if not body:
        return None
    found: list[Any] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        # Every object of the body, duplicate keys included (the last one wins in vLLM's
        # parse, which is this same json.loads): each value of the field is checked.
        found.extend(value for name, value in items if name == TRANSFER_FIELD)
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        return GuardRefusalError(
            400,
            f"expected a JSON body, found {len(body)} bytes that do not parse: {shown(str(exc))}",
        )
    for value in found:
        try:
            params = TransferParams.of(value)
        except RequestParamsError as exc:
            return GuardRefusalError(400, str(exc))
        channel = params.hsx
        if channel is None:
            continue
        try:
            check_channel(channel.channel, channel.granules, channel.secret, owners)
        except ChannelOwnershipError as exc:
            return GuardRefusalError(403, f"{TRANSFER_FIELD}.hsx.channel refused: {exc}")
        except ChannelRefusedError as exc:
            return GuardRefusalError(400, f"{TRANSFER_FIELD}.hsx.channel refused: {exc}")
        except OSError as exc:
            return GuardRefusalError(
                400, f"{TRANSFER_FIELD}.hsx.channel {channel.channel}: cannot be checked: {exc!r}"
            )
    return None


def _log_to_stderr() -> None:
    """The refusals reach the server's log: vLLM's API server process imports SageMaker's
    package, which sets the root logger (and its handlers) to ERROR, so this logger writes to
    stderr itself."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class ServeGuard:
    """The ASGI middleware (``--middleware hsx.serve.guard.ServeGuard``)."""

    def __init__(self, app: ASGIApp) -> None:
        _log_to_stderr()
        self.app = app
        self._key = os.environ.get(API_KEY_ENV, "")
        self._owners = owners_from_environment()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = str(scope["path"]).removeprefix(str(scope.get("root_path", "")))
        if path == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        if not key_accepted(_header(scope, b"authorization"), self._key):
            found = "none" if _header(scope, b"authorization") is None else "another key"
            await _refuse(
                scope,
                send,
                GuardRefusalError(
                    401,
                    "expected the header 'Authorization: Bearer <the server's key>' "
                    f"(server.api_key; a client's engine.api_key), found {found}",
                ),
            )
            return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        if path == INFO_PATH:
            await _send_json(send, 200, served_info())
            return
        try:
            body = await _read_body(scope, receive)
        except GuardRefusalError as refusal:
            await _refuse(scope, send, refusal)
            return
        if body is None:
            return  # the client went away while sending
        problem = body_problem(body, self._owners)
        if problem is not None:
            await _refuse(scope, send, problem)
            return
        await self.app(scope, _replay(body, receive), send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _read_body(scope: Scope, receive: Receive) -> bytes | None:
    """The whole body (None if the client disconnected first); GuardRefusalError(413) beyond
    MAX_BODY_BYTES, said or sent."""
    declared = _header(scope, b"content-length")
    too_big = GuardRefusalError(
        413, f"expected a request body of at most {MAX_BODY_BYTES} bytes, found more"
    )
    if declared is not None and declared.strip().isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read, then what the client sends (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


async def _refuse(scope: Scope, send: Send, refusal: GuardRefusalError) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
        return
    if refusal.status != 401:  # a 401 is a probe without the key: not worth a line each
        logger.warning(
            "hsx serve refused %s %s with HTTP %d: %s",
            scope.get("method", "?"),
            shown(str(scope.get("path", ""))),
            refusal.status,
            refusal,
        )
    document = {
        "error": {
            "message": str(refusal),
            "type": _ERROR_TYPES.get(refusal.status, "Error"),
            "param": None,
            "code": refusal.status,
        }
    }
    headers = [(b"www-authenticate", b"Bearer")] if refusal.status == 401 else []
    await _send_json(send, refusal.status, json.dumps(document).encode(), headers)


async def _send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
