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
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.errors import EngineError
from settings import HsxSettings, ServeSettings

# How often the parent asks the starting server whether it is ready.
READY_POLL_S = 1.0
# How long a stopping server may take to exit after SIGTERM before it is killed.
STOP_GRACE_S = 60.0


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
    ``say`` takes progress lines (a run logger's info)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handle, settings_path = tempfile.mkstemp(prefix="hsx-serve-", suffix=".json", dir=log_dir)
    with os.fdopen(handle, "w") as file:  # mkstemp: readable by this user only
        json.dump(settings.model_dump(mode="json"), file)
    log_path = log_dir / f"hsx-serve-{settings.server.port}.log"
    url = f"http://{settings.server.host}:{settings.server.port}"
    say(f"starting hsx serve for this run at {url} (log {log_path})")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.own_server", settings_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_environment(),
            start_new_session=True,  # its vLLM processes stop with it, not with a Ctrl-C here
        )
    try:
        started = time.monotonic()
        _wait_ready(process, url, log_path, settings.server.ready_timeout_s)
        say(f"hsx serve ready at {url} after {time.monotonic() - started:.1f} s (model loaded)")
        yield url
    finally:
        _stop(process)
        Path(settings_path).unlink(missing_ok=True)


def _child_environment() -> dict[str, str]:
    """This environment without the sections the settings file carries (HSX_ENGINE__*, ...):
    the child reads none of them, and a stale HSX_ENGINE__URL would make it a client."""
    sections = ("HSX_ENGINE", "HSX_CAPTURE", "HSX_SERVER", "HSX_MODEL")
    return {k: v for k, v in os.environ.items() if not k.startswith(sections)}


def _wait_ready(process: subprocess.Popen[bytes], url: str, log_path: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            raise EngineError(
                f"hsx serve for this run: expected it to start, found it exited with {code} "
                f"before it was ready; its log ({log_path}) ends:\n{_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet: still loading
        time.sleep(READY_POLL_S)
    _stop(process)
    raise EngineError(
        f"hsx serve for this run: expected it ready within server.ready_timeout_s={limit_s:.0f} "
        f"s, found it still loading; its log ({log_path}) ends:\n{_tail(log_path)}"
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _tail(path: Path, size: int = 4000) -> str:
    return path.read_bytes()[-size:].decode(errors="replace")


def main(settings_path: str) -> int:
    """The child: the server until it is stopped (flows.serve_cli's run_server)."""
    from flows.serve_cli import run_server

    settings = ServeSettings.model_validate_json(Path(settings_path).read_text())
    return run_server(settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
