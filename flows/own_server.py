"""A `hsx serve` of one run's own: started in a child process, used through its URL, stopped at
the run's end. A flow that needs one model for two jobs (regenerate, then extract) loads it once
this way: vLLM's server generates for the first and captures states for the second.

The child runs ``python -m flows.own_server SETTINGS.json``: the parent's resolved ServeSettings,
read without the environment (the parent already applied it), so the server serves exactly what
the run's extraction settings expect.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.engine.server_process import (
    process_gone,
    start_server_process,
    stop_server_process,
    wait_until_healthy,
)
from hsx.errors import EngineError
from settings import HsxSettings, ServeSettings

# How often the parent asks the starting server whether it is ready.
READY_POLL_S = 1.0


def serve_settings_for(extraction: HsxSettings, probe: bool) -> ServeSettings:
    """The server's settings: the extraction's model, engine and capture sections (so the server
    and the run agree by construction), on a free loopback port."""
    engine = extraction.engine.model_dump(mode="json")
    engine.pop("url", None)
    engine.pop("api_key", None)
    return ServeSettings.model_validate(
        {
            "model": str(extraction.model),
            "engine": engine,
            "capture": extraction.capture.model_dump(mode="json"),
            "server": {"host": "127.0.0.1", "port": _free_port(), "probe": probe},
        }
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def own_server(settings: ServeSettings, log_dir: Path, say: Any) -> Iterator[str]:
    """Start `hsx serve` with ``settings``, yield its URL once it answers, stop it at the end.
    ``say`` takes progress lines (a run logger's info). The server dies with this process
    (hsx.engine.server_process): a flow process killed by its worker leaves no model loaded."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handle, settings_path = tempfile.mkstemp(prefix="hsx-serve-", suffix=".json", dir=log_dir)
    with os.fdopen(handle, "w") as file:  # mkstemp: readable by this user only
        json.dump(settings.model_dump(mode="json"), file)
    log_path = log_dir / f"hsx-serve-{settings.server.port}.log"
    url = f"http://{settings.server.host}:{settings.server.port}"
    say(f"starting hsx serve for this run at {url} (log {log_path})")
    with log_path.open("wb") as log:
        command = [sys.executable, "-m", "flows.own_server", settings_path]
        # SIGTERM if this process dies: `hsx serve` stops its vLLM server's whole group on it.
        process = start_server_process(
            command, _child_environment(), log, death_signal=signal.SIGTERM
        )
    try:
        try:
            seconds = wait_until_healthy(
                url, settings.server.ready_timeout_s, process_gone(process), READY_POLL_S
            )
        except EngineError as exc:
            raise EngineError(
                f"hsx serve for this run: {exc} (server.ready_timeout_s="
                f"{settings.server.ready_timeout_s:g}); its log ({log_path}) ends:\n"
                f"{_tail(log_path)}"
            ) from exc
        say(f"hsx serve ready at {url} after {seconds:.1f} s (model loaded)")
        yield url
    finally:
        stop_server_process(process)
        Path(settings_path).unlink(missing_ok=True)


def _child_environment() -> dict[str, str]:
    """This environment without the sections the settings file carries (HSX_ENGINE__*, ...):
    the child reads none of them, and a stale HSX_ENGINE__URL would make it a client."""
    sections = ("HSX_ENGINE", "HSX_CAPTURE", "HSX_SERVER", "HSX_MODEL")
    return {k: v for k, v in os.environ.items() if not k.startswith(sections)}


def _tail(path: Path, size: int = 4000) -> str:
    return path.read_bytes()[-size:].decode(errors="replace")


def main(settings_path: str) -> int:
    """The child: the server until it is stopped (flows.serve_cli's run_server)."""
    from flows.serve_cli import run_server

    settings = ServeSettings.model_validate_json(Path(settings_path).read_text())
    return run_server(settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
