"""Settings of `hsx serve`: the model, the engine and capture sections that `hsx extract` uses
(so a server and the runs that use it agree by construction), and the server's own section.

Environment variables share the ``HSX_`` prefix with extraction: ``HSX_ENGINE__DTYPE`` sets both,
``HSX_SERVER__PORT`` only the server. One environment file can therefore serve both.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from settings.models import CaptureSettings, EngineSettings
from settings.strict import StrictSection, refuse_unknown_keys

# vLLM server flags hsx sets itself (hsx.serve.server): an extra argument may not set them again, or
# the server would capture something other than what /hsx/info says (prefix caching on skips
# the forward of repeated tokens; another speculative config captures other layers).
RESERVED_VLLM_FLAGS = frozenset(
    {
        "--model",
        "--tokenizer",
        "--host",
        "--port",
        "--served-model-name",
        "--middleware",
        "--dtype",
        "--max-model-len",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--speculative-config",
        "--kv-transfer-config",
        "--tensor-parallel-size",
        "--load-format",
        "--seed",
        "--api-key",  # server.api_key: passed in the environment, off the command line
        "--config",  # a file of more flags, read when the server starts: not checkable here
    }
)


def reserved_flag(argument: str) -> str | None:
    """The flag hsx sets itself that ``argument`` (one of server.vllm_args) would set as vLLM
    parses it, or None: ``--flag``, ``--flag=value``, ``--flag_name`` and ``--flag.key``
    (vLLM reads them all as ``--flag``), and an abbreviation argparse would complete to it
    (``--hos`` is ``--host``). hsx.serve.server parses them with vLLM's own parser too, before
    the load, for what no spelling rule here knows (short flags such as ``-tp``)."""
    if not argument.startswith("--") or argument == "--":
        return None
    name = argument.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if name in RESERVED_VLLM_FLAGS:
        return name
    # A strict prefix of a reserved flag: argparse completes it (allow_abbrev) when no other
    # flag starts the same way; no vLLM flag is such a prefix (a unit test holds it).
    completions = sorted(flag for flag in RESERVED_VLLM_FLAGS if flag.startswith(name))
    return completions[0] if completions and len(name) > 2 else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any address


class ServerSettings(StrictSection):
    """Where `hsx serve` listens and how it starts."""

    SECTION: ClassVar[str] = "server"

    host: str = Field(
        "127.0.0.1",
        description="Address to listen on. States come back through this node's shared memory, "
        "so clients run on this node: loopback is enough, and nothing else can send it work.",
    )
    port: int = Field(8100, ge=1, le=65535, description="Port to listen on.")
    served_model_name: str | None = Field(
        None, description="The model's name in the OpenAI API. None = the model folder's name."
    )
    state_dir: Path = Field(
        Path("~/.cache/hsx/serve"),
        description="Where the server keeps its /hsx/info document (server-PORT.json) while up.",
    )
    ready_timeout_s: float = Field(
        7200.0,
        gt=0,
        le=86_400,
        description="How long the model may take to load before the start fails (Kimi-K2.5 "
        "took 18 minutes on an 8-GPU node).",
    )
    probe: bool = Field(
        True,
        description="Run preflight's reduced-model probe before the load (seconds to a minute); "
        "the static checks always run.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="More vLLM server flags, verbatim (e.g. ['--gpu-memory-utilization', '0.45'] "
        "for two servers on one GPU). Flags hsx sets itself are refused.",
    )

    api_key: SecretStr | None = Field(
        None,
        exclude=True,  # never in a dump: /hsx/info, logs
        description="Key clients must send (vLLM's own --api-key, given to the server in its "
        "environment, not on its command line): /v1 and /hsx/info answer 401 without it. Set "
        "it as HSX_SERVER__API_KEY; clients set the same value as HSX_ENGINE__API_KEY.",
    )
    allow_remote_without_key: bool = Field(
        False,
        description="Listen on an address beyond loopback without server.api_key. Refused "
        "unless set: anyone who reaches the port could then send the server work.",
    )
    access_log: bool = Field(
        False,
        description="Log every HTTP request (uvicorn's access log: one line per batch of every "
        "chunk). Off by default.",
    )
    channel_groups: list[str] = Field(
        default_factory=list,
        description="Groups (names or ids) whose members' channel folders the server writes "
        "into besides its own user's: for clients that run as other users. Folders writable by "
        "others are refused whatever their owner.",
    )

    @model_validator(mode="after")
    def _a_key_beyond_loopback(self) -> ServerSettings:
        if (
            not is_loopback(self.host)
            and self.api_key is None
            and not self.allow_remote_without_key
        ):
            raise ValueError(
                f"server.host {self.host!r} listens beyond this machine: expected "
                "server.api_key (HSX_SERVER__API_KEY) to be set, found none (or set "
                "server.allow_remote_without_key to serve anyone who reaches the port)"
            )
        return self

    @field_validator("vllm_args")
    @classmethod
    def _not_reserved(cls, value: list[str]) -> list[str]:
        # The flag as written, never its value (``--api-key=...`` must not reach a log).
        reserved = sorted(
            name if name == flag else f"{name} ({flag})"
            for arg in value
            if (flag := reserved_flag(arg)) is not None
            for name in [arg.split("=", 1)[0]]
        )
        if reserved:
            raise ValueError(
                f"server.vllm_args: expected flags hsx does not set itself, found {reserved} "
                "(set them through the engine and capture settings, which /hsx/info reports)"
            )
        return value

    def resolved_state_dir(self) -> Path:
        return self.state_dir.expanduser()


# The sections of HsxSettings that a server does not read: their variables may share its
# environment file.
_EXTRACTION_ONLY = frozenset(
    {"dataset", "store", "data", "layout", "run", "pipeline", "generation", "out"}
)


class ServeSettings(BaseSettings):
    """Everything `hsx serve` needs. The CLI builds it; hsx.serve.server takes it."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    model: Path = Field(..., description="Model folder: config.json, tokenizer, safetensors.")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return refuse_unknown_keys(cls, data, _EXTRACTION_ONLY)

    @model_validator(mode="after")
    def _not_a_client(self) -> ServeSettings:
        if self.engine.url:
            raise ValueError(
                f"engine.url: a server runs its own engine, expected no engine.url, found "
                f"{self.engine.url} (is HSX_ENGINE__URL set for the server too?)"
            )
        return self
