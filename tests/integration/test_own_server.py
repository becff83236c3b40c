"""A run's own `hsx serve` (flows/own_server.py, the one-load regenerate-then-extract flow's
server) with the real tiny model: it dies with the process that started it, whatever kills that
process (a worker's SIGKILL after a Cancel, the OOM killer), and a start that outlasts
``server.ready_timeout_s`` is stopped and named."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.errors import EngineError
from settings import ServeSettings
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_gib": 0.25}

# The owner: starts the server as the flow does, says its URL and its own pid, then waits.
_OWNER = """
import json, sys, time
from pathlib import Path
from flows.own_server import own_server
from settings import ServeSettings
settings = ServeSettings.model_validate_json(Path(sys.argv[1]).read_text())
with own_server(settings, Path(sys.argv[2]), lambda line: None) as url:
    print(json.dumps({"url": url}), flush=True)
    time.sleep(3600)
"""


def _serve_settings(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path, **server: Any
) -> ServeSettings:
    """The server of an extraction of the tiny Llama; its state files under the test's log
    folder, so that every process of it names that folder (``_server_pids``)."""
    from flows.own_server import serve_settings_for

    extraction = make_settings(tiny_llama, sample_dataset, str(tmp_path / "s.zarr"), engine=ENGINE)
    settings = serve_settings_for(extraction, probe=False)
    server = {"state_dir": tmp_path / "hsx-servers" / "state", **server}
    return settings.model_copy(update={"server": settings.server.model_copy(update=server)})


def _server_pids(log_dir: Path) -> set[int]:
    """The pids of every process whose command line or environment names ``log_dir``: the owner,
    `hsx serve` (its settings file) and what it started (their info file: vLLM, engine core)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(log_dir).encode() in text:
            found.add(int(entry.name))
    return found - {os.getpid()}


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def _hsx_serve_pid(log_dir: Path) -> int:
    (pid,) = (
        pid
        for pid in _server_pids(log_dir)
        if b"-m\0flows.own_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    return pid


@pytest.mark.parametrize("killed", ["the owner", "hsx serve"])
def test_the_runs_server_dies_with_the_process_that_started_it(
    killed: str, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """SIGKILL of the flow's process (the kernel's parent-death signal reaches `hsx serve`, which
    stops its vLLM server's group), or of `hsx serve` itself (vLLM's server gets the signal and
    stops its engine core, which a SIGKILL of vLLM's server left running: measured)."""
    settings = _serve_settings(tiny_llama, sample_dataset, tmp_path)
    settings_path, log_dir = tmp_path / "serve.json", tmp_path / "hsx-servers"
    settings_path.write_text(settings.model_dump_json())
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(settings_path), str(log_dir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, f"the owner ended before its server was ready (exit {owner.poll()})"
        url = json.loads(line)["url"]
        port = int(url.rsplit(":", 1)[1])
        assert not _refused(port)
        running = _server_pids(log_dir)
        assert len(running) >= 3, running  # the owner, hsx serve, the vLLM server it supervises
        # No finally, no atexit, no signal handler: only the kernel can help.
        if killed == "the owner":
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=30)
        else:
            os.kill(_hsx_serve_pid(log_dir), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while _server_pids(log_dir) - {owner.pid} and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _server_pids(log_dir) - {owner.pid}
        assert not left, f"expected the server gone with its owner, found pids {left} alive"
        assert _refused(port)
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in _server_pids(log_dir):
            os.kill(pid, signal.SIGKILL)


def test_a_start_past_the_ready_timeout_is_stopped_and_named(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from flows.own_server import own_server

    settings = _serve_settings(tiny_llama, sample_dataset, tmp_path, ready_timeout_s=3.0)
    log_dir = tmp_path / "hsx-servers"
    started = time.monotonic()
    with pytest.raises(EngineError) as raised, own_server(settings, log_dir, lambda _: None):
        pytest.fail("expected no URL from a server that cannot load in 3 s")
    message = str(raised.value)
    assert "within 3 s" in message and "server.ready_timeout_s=3" in message, message
    assert str(log_dir / f"hsx-serve-{settings.server.port}.log") in message, message
    assert time.monotonic() - started < 90  # stopped, not waited out
    deadline = time.monotonic() + 30
    while _server_pids(log_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _server_pids(log_dir), "expected the stopped server gone"
    assert _refused(settings.server.port)


def test_hsx_serve_names_its_ready_timeout_when_the_model_does_not_load_in_time(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """`hsx serve` itself (the process the run's own server is), with nobody stopping it first:
    it stops its vLLM server, exits non-zero and names the setting to raise."""
    settings = _serve_settings(tiny_llama, sample_dataset, tmp_path, ready_timeout_s=3.0)
    settings_path = tmp_path / "serve.json"
    settings_path.write_text(settings.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-m", "flows.own_server", str(settings_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "within 3 s" in output and "(server.ready_timeout_s=3)" in output, output[-2000:]
    assert not _server_pids(tmp_path / "hsx-servers"), "expected the stopped server gone"
    assert _refused(settings.server.port)
