"""A server process started by this one: `hsx serve`'s vLLM server, a run's own `hsx serve`, the
CLI's temporary Prefect server. One way to start, await and stop them all:

- a session of its own: the terminal's Ctrl-C reaches only this process, which stops the child
  cleanly (and reports); a stop signals the child's whole group (vLLM's engine core with it);
- signalled by the kernel when this process dies, whatever kills it (SIGKILL, the OOM killer):
  a server never outlives its owner with a model loaded (the parent-death signal follows the
  thread that started the child, so start it on a thread that lives as long as its use);
- ready when ``GET {url}/health`` answers 200.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import httpx

from hsx.engine.platform import die_with_parent, exit_description
from hsx.errors import EngineError

# How long a stopping server may take to exit after SIGTERM before its group is killed.
STOP_GRACE_S = 60.0


def start_server_process(
    command: Sequence[str],
    env: Mapping[str, str],
    output: IO[bytes] | None = None,
    death_signal: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
    """``command`` in a session of its own, sent ``death_signal`` when this process dies (the
    module says why; SIGTERM for a server that stops its own children on it: vLLM's engine core
    outlived a SIGKILLed `vllm serve`, measured)."""
    return subprocess.Popen(
        list(command),
        env=dict(env),
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent, death_signal),
    )


def wait_until_healthy(
    url: str, timeout_s: float, alive: Callable[[], str | None], poll_s: float = 0.5
) -> float:
    """Seconds until ``GET {url}/health`` answers 200. EngineError when the time runs out or
    ``alive()`` says why the server is gone (it returns None while it runs)."""
    started = time.monotonic()
    last = "no answer yet"
    while time.monotonic() - started < timeout_s:
        gone = alive()
        if gone is not None:
            raise EngineError(f"server {url}: {gone} before it was ready (last: {last})")
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return time.monotonic() - started
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(poll_s)
    raise EngineError(
        f"server {url}: expected /health to answer 200 within {timeout_s:g} s, found {last}"
    )


def process_gone(process: subprocess.Popen[bytes]) -> Callable[[], str | None]:
    """``wait_until_healthy``'s ``alive`` for a process: why it is gone, None while it runs."""

    def gone() -> str | None:
        code = process.poll()
        return None if code is None else f"the process exited ({exit_description(code)})"

    return gone


def signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def stop_server_process(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's group, SIGKILL after ``grace_s``, then SIGKILL to what the server
    left of its group (an engine core whose parent went first)."""
    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait()
    signal_group(process, signal.SIGKILL)
