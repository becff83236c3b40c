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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hsx.engine.platform import die_with_parent


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
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
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
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C goes to the CLI alone
                preexec_fn=die_with_parent,
            )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"temporary Prefect server: expected it to serve {self.api_url}, found it "
                    f"exited with {self.process.returncode}; its log: {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"temporary Prefect server: expected {self.api_url}/health within {timeout_s:.0f} s, "
            f"found no answer; its log: {self.log_path}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
