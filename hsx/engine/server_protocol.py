"""What an hsx client and an `hsx serve` server (vLLM's own API server) agree on.

A client sends each prompt as an OpenAI completion of token ids with ``kv_transfer_params``
``{"hsx": {"channel": <its ring folder>, "granules": <ring size>, "key": <its key>, "secret":
<its channel's secret>}}``; hsx's connector in the server's engine puts the rows in that ring
under that key, and answers in the response's ``kv_transfer_params`` with the server's instance
and a digest of the prompt it computed. ``GET /hsx/info`` (hsx.serve.guard, an ASGI middleware
vLLM loads with ``--middleware``) describes what the server serves: the model's config hash and
weights, the layer ids, the dtype, the host.

Every value of ``kv_transfer_params`` passes one strict schema (TransferParams) before anything
uses it: in the API server (the guard answers HTTP 400 naming the field) and again in the engine
(a request that got past the guard is computed and not extracted, never fatal).
Imports neither vLLM nor starlette: the connector imports it in the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import tempfile
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from hsx.engine.channel_files import SECRET_PATTERN, key_problem
from hsx.engine.log_safety import shown

PARAMS_KEY = "hsx"
# kv_transfer_params key of a request whose rows the connector quantizes on the GPU and delivers
# packed (value: hsx.store.fp8_states.ENCODING; rows [tokens, K, H + 4] uint8).
ENCODING_PARAM = "hsx_state_encoding"
FP8_ENCODING = "fp8_e4m3"  # hsx.store.fp8_states.ENCODING (a unit test holds them equal)
# The request field the schema below guards: wherever it appears in a request's body (vLLM
# also reads it from ``vllm_xargs``; its scheduler calls ``.get`` on whatever it finds).
TRANSFER_FIELD = "kv_transfer_params"
INFO_PATH = "/hsx/info"
HEALTH_PATH = "/health"
# Set by `hsx serve` for the vLLM server it starts (its engine process inherits them).
SERVER_INSTANCE_ENV = "HSX_SERVER_INSTANCE"
SERVER_INFO_ENV = "HSX_SERVER_INFO"
# server.channel_groups as group ids (comma-separated), for the guard in the API server.
CHANNEL_GIDS_ENV = "HSX_SERVER_CHANNEL_GIDS"
# The ASGI middleware vLLM loads with --middleware: the key on every route, requests' transfer
# parameters and channels checked before vLLM sees them, /hsx/info.
MIDDLEWARE = "hsx.serve.guard.ServeGuard"
# The server's key (server.api_key) in vLLM's environment form, read by vLLM's own check of /v1
# (0.26 and 0.3x alike) and by hsx's guard, which holds every route to it.
API_KEY_ENV = "VLLM_API_KEY"
# A client's channel folder: created by the client under one of these, with this prefix. The
# server opens nothing else (a request names the folder it writes into).
CHANNEL_PREFIX = "hsx-channel-"
# The folder's name: what tempfile.mkdtemp makes after the prefix (no control characters, no
# separators, nothing a log line could be forged with).
CHANNEL_NAME = re.compile(re.escape(CHANNEL_PREFIX) + r"[A-Za-z0-9_.-]{1,200}")
MAX_CHANNEL_CHARACTERS = 1024
# A ring of at most 1 TiB (64 KiB granules): a request cannot make the server map more.
MAX_GRANULES = 1 << 24


def shm_folder() -> str:
    """Where channels (and the servers' markers) live: /dev/shm, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def channel_parents() -> tuple[str, ...]:
    """Where channel folders may live: /dev/shm (memory) and the temporary folder (no shm)."""
    temporary = tempfile.gettempdir()
    return tuple(sorted({"/dev/shm", temporary, os.path.realpath(temporary)}))


# What a client compares with its own plan before any work, and what each value is called.
IDENTITY_FIELDS = {
    "model_config_hash": "model config hash",
    "weights_fingerprint": "weights",
    "layer_ids": "layer ids (vLLM numbering)",
    "engine_dtype": "engine dtype",
}


class RequestParamsError(ValueError):
    """A request's kv_transfer_params that the schema refuses: the request fails (HTTP 400 with
    this message), never the engine."""


class _Strict(BaseModel):
    # Strict: no coercion (a float, a bool or a string is not a ring size), unknown keys refused.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    FIELD: ClassVar[str] = TRANSFER_FIELD

    @classmethod
    def parse(cls, value: Any) -> Any:
        """The validated parameters, or RequestParamsError naming the first problem's field,
        what was expected and what was found (escaped and cut: it reaches logs)."""
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            raise RequestParamsError(_problem(cls, exc)) from None


class ChannelRequest(_Strict):
    """Where one request's rows go: a client's ring folder, its size, the request's key, and
    the secret its client wrote into the folder (the channel is that client's alone)."""

    FIELD: ClassVar[str] = f"{TRANSFER_FIELD}.{PARAMS_KEY}"

    channel: str
    granules: int
    key: str
    secret: str

    @field_validator("channel")
    @classmethod
    def _a_channel_folder(cls, channel: str) -> str:
        parents = channel_parents()
        parent, name = os.path.split(channel)
        if (
            len(channel) > MAX_CHANNEL_CHARACTERS
            or not CHANNEL_NAME.fullmatch(name)
            or parent not in parents
            or os.path.normpath(channel) != channel
        ):
            raise ValueError(
                f"expected a folder {CHANNEL_PREFIX}* (letters, digits, _.-) in one of "
                f"{list(parents)}, found {shown(channel)}"
            )
        return channel

    @field_validator("granules")
    @classmethod
    def _a_ring_size(cls, granules: int) -> int:
        if not 0 < granules <= MAX_GRANULES:
            raise ValueError(f"expected 1..{MAX_GRANULES}, found {granules}")
        return granules

    @field_validator("key")
    @classmethod
    def _a_plain_key(cls, key: str) -> str:
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(problem)
        return key

    @field_validator("secret")
    @classmethod
    def _a_secret(cls, secret: str) -> str:
        if not SECRET_PATTERN.fullmatch(secret):
            raise ValueError(
                f"expected the 64 hex digits its client wrote in the channel, found "
                f"{len(secret)} characters"  # never the value: it may be near a real secret
            )
        return secret

    @classmethod
    def from_params(cls, params: Any) -> ChannelRequest:
        """kv_transfer_params.hsx, validated (RequestParamsError, a ValueError, otherwise)."""
        return cls.parse(params)  # type: ignore[no-any-return]

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: self.model_dump()}


class TransferParams(_Strict):
    """A request's whole kv_transfer_params: hsx's channel and the encoding of its rows."""

    hsx: ChannelRequest | None = None
    hsx_state_encoding: str | None = None

    @field_validator("hsx_state_encoding")
    @classmethod
    def _a_known_encoding(cls, encoding: str | None) -> str | None:
        if encoding is not None and encoding != FP8_ENCODING:
            raise ValueError(f"expected {FP8_ENCODING!r} or none, found {shown(encoding)}")
        return encoding

    @classmethod
    def of(cls, value: Any) -> TransferParams:
        """A request's kv_transfer_params (None: none) validated, or RequestParamsError."""
        return cls.parse({} if value is None else value)  # type: ignore[no-any-return]


def _problem(model: type[_Strict], exc: ValidationError) -> str:
    """The first of a ValidationError's problems as 'FIELD: expected X, found Y'."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    path = [model.FIELD, *(str(part) for part in error["loc"])]
    kind = error["type"]
    found = error.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(model, path[1:-1])
        what = f"{'.'.join(path[:-1])}: expected only {sorted(owner.model_fields)}, found {shown(path[-1])}"
    elif kind == "missing":
        owner = _model_at(model, path[1:-1])
        given = sorted(map(str, found)) if isinstance(found, dict) else found
        what = (
            f"{'.'.join(path[:-1])}: expected {sorted(owner.model_fields)}, found "
            f"{shown(given)} (no {path[-1]})"
        )
    elif kind == "value_error":
        what = f"{'.'.join(path)}: {error['ctx']['error']}"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        what = f"{'.'.join(path)}: expected an object, found {shown(found)}"
    else:
        expected = str(error["msg"]).removeprefix("Input should be ")
        what = f"{'.'.join(path)}: expected {expected}, found {shown(found)}"
    return what + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")


def _model_at(model: type[_Strict], path: list[str]) -> type[_Strict]:
    """The model of a nested field (TransferParams.hsx: ChannelRequest)."""
    for name in path:
        annotation = model.model_fields[name].annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next(a for a in nested if issubclass(a, _Strict))
    return model


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


def served_info() -> bytes:
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


def key_accepted(header: str | None, key: str | None = None) -> bool:
    """Whether a request's Authorization header carries the server's key (``key``, by default
    this process's API_KEY_ENV), or the server has none. Digests are compared, in constant
    time: neither the key's length nor its first differing byte shows in the time taken."""
    key = os.environ.get(API_KEY_ENV, "") if key is None else key
    if not key:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(
        hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(key.encode()).digest(),
    )
