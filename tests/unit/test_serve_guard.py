"""`hsx serve`'s guard (hsx.serve.guard.ServeGuard), the ASGI middleware vLLM runs in front of
every route: the key on every route but /health, the body's kv_transfer_params and channels
checked before the app sees them, the body handed on unchanged. Driven through httpx's ASGI
transport (the real middleware, real channel folders); the served replay of every attack is
tests/integration/test_serve_hostile.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.engine.channel_files import SECRET_FILE, write_secret
from hsx.engine.result_ring import RING_FILE, ring_granules
from hsx.engine.results import ResultRendezvous
from hsx.engine.server_protocol import API_KEY_ENV, CHANNEL_PREFIX, SERVER_INFO_ENV
from hsx.engine.shm_folders import make_owned_folder
from hsx.serve.guard import MAX_BODY_BYTES, Message, Receive, Scope, Send, ServeGuard

pytestmark = pytest.mark.timeout(60)

KEY = "guard-test-key-1"
RING_BYTES = 4 << 16
# Routes the issue found open with a key set, and some that do not exist: all need the key.
GUARDED = [
    ("POST", "/invocations"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("GET", "/metrics"),
    ("GET", "/load"),
    ("GET", "/version"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/hsx/info"),
    ("GET", "/health/"),
    ("GET", "//health"),
    ("OPTIONS", "/v1/completions"),
    ("GET", "/no/such/route"),
]


class Recorder:
    """The app behind the guard: records each request that reached it and its body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[ServeGuard, Recorder]:
    info = tmp_path / "info.json"
    info.write_text(json.dumps({"served_by": "hsx serve", "instance": "i1"}))
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setenv(SERVER_INFO_ENV, str(info))
    recorder = Recorder()
    return ServeGuard(recorder), recorder


@pytest.fixture
def channel() -> Iterator[tuple[str, str]]:
    """A channel made as hsx's client makes one: folder, secret, ring and FIFO."""
    folder = make_owned_folder(CHANNEL_PREFIX)
    secret = write_secret(folder)
    reader = ResultRendezvous(lambda k, n, r: r, spool_dir=folder, ring_bytes=RING_BYTES)
    yield folder, secret
    reader.close()
    shutil.rmtree(folder, ignore_errors=True)


def call(
    guard: ServeGuard, method: str, path: str, key: str | None = KEY, **kwargs: Any
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=guard)  # type: ignore[arg-type]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kwargs.pop("headers", {}))
        if "json" in kwargs:  # as vLLM's clients may send it: Infinity and NaN included
            kwargs["content"] = json.dumps(kwargs.pop("json")).encode()
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def completion(made: tuple[str, str], **hsx: Any) -> dict[str, Any]:
    """A completion naming the channel ``made`` (folder, secret), its fields changed by ``hsx``."""
    folder, secret = made
    params = {
        "channel": folder,
        "granules": ring_granules(RING_BYTES),
        "key": "b1",
        "secret": secret,
    }
    return {"model": "m", "prompt": [[1, 2, 3]], "kv_transfer_params": {"hsx": {**params, **hsx}}}


def test_every_route_but_health_needs_the_key(app: tuple[ServeGuard, Recorder]) -> None:
    guard, recorder = app
    assert call(guard, "GET", "/health", key=None).status_code == 200
    for method, path in GUARDED:
        for key in (None, "wrong", KEY + "x", ""):
            answer = call(guard, method, path, key=key)
            assert answer.status_code == 401, (method, path, key, answer.text)
            assert "expected the header 'Authorization: Bearer" in answer.json()["error"]["message"]
    assert recorder.seen == [("/health", b"")]  # nothing else reached the app
    assert call(guard, "GET", "/metrics").status_code == 200
    assert call(guard, "GET", "/hsx/info").json()["instance"] == "i1"  # answered by the guard
    assert call(guard, "POST", "/invocations", key=None, json={}).status_code == 401
    lower = call(guard, "GET", "/version", headers={"Authorization": f"bearer {KEY}"})
    assert lower.status_code == 200  # the scheme, as in vLLM's check, in any case


def test_without_a_key_every_route_answers(
    app: tuple[ServeGuard, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV)
    guard = ServeGuard(Recorder())
    assert call(guard, "GET", "/metrics", key=None).status_code == 200


def test_a_websocket_without_the_key_is_closed(app: tuple[ServeGuard, Recorder]) -> None:
    guard, recorder = app
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}]
    assert recorder.seen == []


def test_the_clients_request_reaches_the_app_unchanged(
    app: tuple[ServeGuard, Recorder], channel: tuple[str, str]
) -> None:
    guard, recorder = app
    body = json.dumps(completion(channel)).encode()
    answer = call(guard, "POST", "/v1/completions", content=body)
    assert answer.status_code == 200 and answer.text == "served"
    assert recorder.seen == [("/v1/completions", body)]
    # After the handshake the client removes the ring's name (the server holds it open).
    os.unlink(Path(channel[0]) / RING_FILE)
    assert call(guard, "POST", "/v1/completions", content=body).status_code == 200
    plain = {"model": "m", "prompt": "hello", "vllm_xargs": {"a": 1}}
    assert call(guard, "POST", "/v1/completions", json=plain).status_code == 200


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"granules": 1e999}, 400, r"hsx\.granules: expected a valid integer, found inf"),
        ({"granules": 2}, 400, r"expected a ring of 135168 bytes for granules=2, found 266240"),
        ({"secret": "0" * 64}, 403, r"belongs to another client: expected the secret"),
        ({"key": "../../etc/x"}, 400, r"hsx\.key: expected letters"),
        ({"channel": "/dev/shm/hsx-channel-x\x00"}, 400, r"found '/dev/shm/hsx-channel-x\\x00'"),
        ({"channel": "/dev/shm/hsx-channel-gone"}, 403, r"expected a directory \(not a link\)"),
    ],
)
def test_a_hostile_request_is_refused_before_the_app(
    app: tuple[ServeGuard, Recorder],
    channel: tuple[str, str],
    change: dict[str, Any],
    status: int,
    message: str,
) -> None:
    guard, recorder = app
    answer = call(guard, "POST", "/v1/completions", json=completion(channel, **change))
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == status
    import re

    assert re.search(message, error["message"]), error["message"]
    assert recorder.seen == []


def test_kv_transfer_params_anywhere_in_the_body_are_checked(
    app: tuple[ServeGuard, Recorder], channel: tuple[str, str]
) -> None:
    """vLLM also takes kv_transfer_params from vllm_xargs (and its scheduler calls .get on
    whatever it finds): every occurrence is checked, duplicates too."""
    guard, recorder = app
    hidden = {"model": "m", "prompt": [[1]], "vllm_xargs": {"kv_transfer_params": "boom"}}
    answer = call(guard, "POST", "/v1/completions", json=hidden)
    assert answer.status_code == 400
    assert "kv_transfer_params: expected an object, found 'boom'" in answer.text
    good = json.dumps(completion(channel)["kv_transfer_params"])
    duplicated = (
        f'{{"model": "m", "kv_transfer_params": {{"hsx": 1}}, "kv_transfer_params": {good}}}'
    )
    assert call(guard, "POST", "/v1/completions", content=duplicated).status_code == 400
    escaped = '{"kv_transfer_param\\u0073": {"hsx": 3}}'  # the key written with an escape
    assert call(guard, "POST", "/v1/completions", content=escaped).status_code == 400
    utf16 = json.dumps({"kv_transfer_params": 5}).encode("utf-16")
    assert call(guard, "POST", "/v1/completions", content=utf16).status_code == 400
    assert recorder.seen == []


def test_bodies_that_are_not_json_or_too_large_are_refused(
    app: tuple[ServeGuard, Recorder],
) -> None:
    guard, recorder = app
    for body in (b"{", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000):
        answer = call(guard, "POST", "/v1/completions", content=body)
        assert answer.status_code == 400 and "expected a JSON body" in answer.text
    huge = call(
        guard,
        "POST",
        "/v1/completions",
        content=b"x",
        headers={"Authorization": f"Bearer {KEY}", "Content-Length": str(MAX_BODY_BYTES + 1)},
    )
    assert huge.status_code == 413
    assert recorder.seen == []


def test_a_refusal_is_logged_escaped_and_cut(
    app: tuple[ServeGuard, Recorder], channel: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    guard, _ = app
    forged = "/dev/shm/hsx-channel-x\n2026-12-07 INFO forged line"
    guard_logger = logging.getLogger("hsx.serve.guard")  # writes to stderr, not to the root's
    guard_logger.addHandler(caplog.handler)
    try:
        call(guard, "POST", "/v1/completions", json=completion(channel, channel=forged))
        call(guard, "POST", "/v1/completions", json=completion(channel, key="k" * (1 << 20)))
    finally:
        guard_logger.removeHandler(caplog.handler)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert all("\n" not in line and len(line) < 1000 for line in lines), lines
    assert "(1048576 characters)" in lines[1]


def test_a_channel_whose_secret_file_others_can_read_is_refused(
    app: tuple[ServeGuard, Recorder], channel: tuple[str, str]
) -> None:
    guard, _ = app
    secret_file = Path(channel[0]) / SECRET_FILE
    secret_file.chmod(0o644)
    answer = call(guard, "POST", "/v1/completions", json=completion(channel))
    assert answer.status_code == 403 and "readable by others" in answer.text
    secret_file.unlink()
    secret_file.symlink_to("/etc/hostname")
    answer = call(guard, "POST", "/v1/completions", json=completion(channel))
    assert answer.status_code == 403 and "channel file secret: expected a file" in answer.text


def test_a_channel_whose_fifo_is_a_link_is_refused(
    app: tuple[ServeGuard, Recorder], channel: tuple[str, str], tmp_path: Path
) -> None:
    """The attack of issue 30 (a ready.fifo linking to a file the server may write), now
    refused before the engine sees it; the file is untouched."""
    guard, recorder = app
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    fifo = Path(channel[0]) / "ready.fifo"
    fifo.unlink()
    fifo.symlink_to(victim)
    answer = call(guard, "POST", "/v1/completions", json=completion(channel))
    assert answer.status_code == 400 and "channel file ready.fifo: not a fifo" in answer.text
    assert victim.read_text() == "precious\n" and recorder.seen == []
