"""What an hsx client and an `hsx serve` server (vLLM's own API server) agree on.

A client sends each prompt as an OpenAI completion of token ids with ``kv_transfer_params``
``{"hsx": {"channel": <its ring folder>, "granules": <ring size>, "key": <its key>}}``; hsx's
connector in the server's engine puts the rows in that ring under that key, and answers in the
response's ``kv_transfer_params`` with the server's instance and a digest of the prompt it
computed. ``GET /hsx/info`` (an ASGI middleware vLLM loads with ``--middleware``) describes what
the server serves: the model's config hash and weights, the layer ids, the dtype, the host.
Imports neither vLLM nor starlette at module level: the connector imports it in the engine.
"""

from __future__ import annotations

import hmac
import os
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hsx.engine.channel_files import check_key

PARAMS_KEY = "hsx"
# kv_transfer_params key of a request whose rows the connector quantizes on the GPU and delivers
# packed (value: hsx.store.fp8_states.ENCODING; rows [tokens, K, H + 4] uint8).
ENCODING_PARAM = "hsx_state_encoding"
INFO_PATH = "/hsx/info"
# Set by `hsx serve` for the vLLM server it starts (its engine process inherits them).
SERVER_INSTANCE_ENV = "HSX_SERVER_INSTANCE"
SERVER_INFO_ENV = "HSX_SERVER_INFO"
MIDDLEWARE = "hsx.engine.server_protocol.info_middleware"
# vLLM's --api-key in its environment form (read by its server in 0.26 and 0.3x alike): /v1
# answers 401 without it; /hsx/info checks it here.
API_KEY_ENV = "VLLM_API_KEY"
# A client's channel folder: created by the client under one of these, with this prefix. The
# server opens nothing else (a request names the folder it writes into).
CHANNEL_PREFIX = "hsx-channel-"
# A ring of at most 1 TiB (64 KiB granules): a request cannot make the server map more.
MAX_GRANULES = 1 << 24


def shm_folder() -> str:
    """Where channels (and the servers' markers) live: /dev/shm, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def channel_parents() -> tuple[str, ...]:
    """Where channel folders may live: /dev/shm (memory) and the temporary folder (no shm)."""
    return tuple({"/dev/shm", os.path.realpath(tempfile.gettempdir())})


# What a client compares with its own plan before any work, and what each value is called.
IDENTITY_FIELDS = {
    "model_config_hash": "model config hash",
    "weights_fingerprint": "weights",
    "layer_ids": "layer ids (vLLM numbering)",
    "engine_dtype": "engine dtype",
}


@dataclass(frozen=True)
class ChannelRequest:
    """Where one request's rows go: a client's ring folder, its size, and the client's key."""

    channel: str
    granules: int
    key: str

    @classmethod
    def from_params(cls, params: Any) -> ChannelRequest:
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params.hsx: expected an object, found {params!r}")
        try:
            request = cls(str(params["channel"]), int(params["granules"]), str(params["key"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                "kv_transfer_params.hsx: expected channel, granules and key, found "
                f"{sorted(params)}: {exc!r}"
            ) from exc
        check_key(request.key)
        if not 0 < request.granules <= MAX_GRANULES:
            raise ValueError(
                f"kv_transfer_params.hsx.granules: expected 1..{MAX_GRANULES}, found "
                f"{request.granules}"
            )
        folder = Path(request.channel)
        if (
            not folder.is_absolute()
            or os.path.normpath(request.channel) != request.channel
            or not folder.name.startswith(CHANNEL_PREFIX)
            or os.path.realpath(folder.parent) not in channel_parents()
        ):
            raise ValueError(
                f"kv_transfer_params.hsx.channel: expected a folder {CHANNEL_PREFIX}* in one of "
                f"{list(channel_parents())}, found {request.channel!r}"
            )
        return request

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"channel": self.channel, "granules": self.granules, "key": self.key}}


def prompt_digest(token_ids: Sequence[int] | np.ndarray) -> str:
    """xxh3-64 of the prompt as little-endian int32: the engine's and the plan's must agree."""
    return str(xxhash.xxh3_64_hexdigest(np.asarray(token_ids, dtype="<i4").tobytes()))


def this_host() -> str:
    return socket.gethostname()


def identity_problems(served: dict[str, Any], expected: dict[str, Any], url: str) -> list[str]:
    """Each difference between what a server serves and what the run needs, naming both."""
    problems = []
    for field, label in IDENTITY_FIELDS.items():
        if served.get(field) != expected.get(field):
            problems.append(
                f"{label}: the run expects {expected.get(field)!r}, server {url} serves "
                f"{served.get(field)!r}"
            )
    needed = int(expected.get("max_model_len") or 0)
    if int(served.get("max_model_len") or 0) < needed:
        problems.append(
            f"max_model_len: the run needs {needed} (its longest sample + 1), server {url} "
            f"takes {served.get('max_model_len')}"
        )
    marker = str(served.get("shm_marker") or "")
    if not marker or not os.path.exists(marker):
        problems.append(
            f"shared memory: states come back through this node's {shm_folder()}, expected "
            f"server {url}'s marker {marker or '(none given)'} there, found none (the server "
            f"runs on {served.get('host')!r}, this is {this_host()!r}: run hsx beside its "
            "servers, on the same node and in the same IPC namespace)"
        )
    return problems


def _served_info() -> bytes:
    """The document `hsx serve` keeps beside the server (read per request: it is rewritten once
    the server is ready, with the load time)."""
    path = os.environ.get(SERVER_INFO_ENV)
    if not path:
        return (
            b'{"error": "' + SERVER_INFO_ENV.encode() + b' is not set: not started by hsx serve"}'
        )
    with open(path, "rb") as handle:
        return handle.read()


def authorization_header(api_key: str | None) -> dict[str, str]:
    """The header a client sends with a server's key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def key_accepted(header: str | None) -> bool:
    """Whether a request's Authorization header carries this server's key (or it has none)."""
    key = os.environ.get(API_KEY_ENV, "")
    if not key:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {key}".encode())


async def info_middleware(request: Any, call_next: Any) -> Any:
    """vLLM ``--middleware``: answers ``GET /hsx/info`` (401 without the server's key, as vLLM
    answers /v1), passes everything else on."""
    if request.url.path == INFO_PATH:
        from starlette.responses import JSONResponse, Response

        if not key_accepted(request.headers.get("Authorization")):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return Response(_served_info(), media_type="application/json")
    return await call_next(request)
