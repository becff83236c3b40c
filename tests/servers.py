"""`hsx serve` as a user runs it, for tests: the real CLI in its own process on a free loopback
port, its output in a log file, killed or stopped as a test needs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.cli import HSX
from tests.conftest import REPO_ROOT

READY = "hsx serve: ready at"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# The engine settings of tests.conftest.make_settings: a server started with these serves what
# those runs expect (fp32 for comparisons with HF, a small KV cache).
TEST_ENGINE = ("--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25")


class ServeProcess:
    """One `hsx serve MODEL` on a fixed port; restartable on that port (a new instance)."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *options: str,
        name: str = "server",
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self.api_key = api_key  # server.api_key: clients must send it
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.options = options
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.state_dir = log_dir / f"{name}-state"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0  # how many times this test started it (each start loads the model)

    def start(self, timeout: float = 300) -> ServeProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServeProcess:
        """Start `hsx serve` and return at once (``wait_ready`` waits for its model load): several
        servers then load at the same time."""
        env = {**os.environ, "COLUMNS": "200", "HSX_SERVER__STATE_DIR": str(self.state_dir)}
        if self.api_key is not None:
            env["HSX_SERVER__API_KEY"] = self.api_key
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*HSX, "serve", str(self.model), "--port", str(self.port), *self.options],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
            )
        self.starts += 1
        return self

    def wait_ready(self, timeout: float = 300) -> ServeProcess:
        assert self.process is not None, "wait_ready before launch"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log().count(READY) >= self.starts:
                return self
            if self.process.poll() is not None:
                raise AssertionError(
                    f"hsx serve exited ({self.process.returncode}) before it was ready:\n"
                    + self.log()[-4000:]
                )
            time.sleep(0.5)
        raise AssertionError(f"hsx serve not ready after {timeout} s:\n" + self.log()[-4000:])

    def ensure_up(self) -> ServeProcess:
        if self.process is None or self.process.poll() is not None:
            return self.start()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def info(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return dict(httpx.get(f"{self.url}/hsx/info", timeout=10, headers=headers).json())

    def metric(self, name: str) -> float:
        """A counter of vLLM's /metrics (summed over its labels)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(f"{self.url}/metrics", timeout=10, headers=headers).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def kill_server(self, pid: int | None = None) -> int:
        """SIGKILL vLLM's server and its engine (its process group: ``pid``, by default the one
        /hsx/info names), as the kernel's OOM killer would; `hsx serve` then exits, as under
        systemd, which restarts it. The killed pid."""
        pid = int(self.info()["server_pid"]) if pid is None else pid
        os.killpg(pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=60)
        return pid

    def stop(self) -> int | None:
        """SIGTERM, as systemd's stop: the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextmanager
def moto_s3(log_path: Path) -> Iterator[int]:
    """moto's S3 server on a free 127.0.0.1 port, in its own process (as a real endpoint is:
    Flask in a test process would be walked by vLLM's module scans); yields its port."""
    port = free_port()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("moto_server")),
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"moto_server did not start on port {port}") from None
                    time.sleep(0.1)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=30)


def s3_config(endpoint: str) -> dict[str, Any]:
    """fsspec's s3 options for a test endpoint (FSSPEC_S3 for a CLI). Standard retry mode, 3
    attempts, short timeouts: a dead endpoint fails in seconds, not the 8-27 s of botocore's
    defaults (README "Stores on S3")."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {
            "retries": {"max_attempts": 3, "mode": "standard"},
            "connect_timeout": 2,
            "read_timeout": 10,
        },
    }
