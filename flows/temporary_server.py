"""The CLI's temporary Prefect server, owned by the CLI.

Prefect's own temporary server runs in the CLI's process group, so the terminal's Ctrl-C killed
it too, and the flow then retried a dead API for more than ten minutes; a CLI killed by the
kernel (out of memory) left it running as an orphan. This one runs in a session of its own
(Ctrl-C reaches only the CLI, which stops cleanly and reports through it) and dies with the CLI
whatever kills the CLI (the kernel's parent-death signal), and on a normal exit it is stopped.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

from hsx.engine.server_process import (
    process_gone,
    start_server_process,
    stop_server_process,
    wait_until_healthy,
)
from hsx.errors import EngineError


def _site_dir_of(package: str) -> str:
    # Found without importing it: Prefect reads its settings (PREFECT_API_URL) once, at import.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"temporary Prefect server: expected {package} installed, found none")
    return str(Path(spec.origin).parent.parent)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporaryServer:
    """A Prefect API server on a free loopback port for the lifetime of this process."""

    def __init__(self, log_dir: Path, timeout_s: float = 60.0) -> None:
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"temporary-server-{self.port}.log"
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        env.pop("PREFECT_API_URL", None)
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            _site_dir_of("prefect"),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        with self.log_path.open("ab") as log:
            self.process = start_server_process(command, env, log)
        try:
            wait_until_healthy(self.api_url, timeout_s, process_gone(self.process), poll_s=0.2)
        except EngineError as exc:
            self.stop()
            raise RuntimeError(
                f"temporary Prefect server: {exc}; its log: {self.log_path}"
            ) from exc

    def stop(self) -> None:
        stop_server_process(self.process, grace_s=5.0)
