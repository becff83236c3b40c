"""The CLI's stop on signal (flows/run_guard.py) in a real process with real signals, around
work that never returns (an engine stuck in a step): the first signal asks the run to stop and
says so, a second one exits at once, and without a second one the process exits by itself
after the grace, with the shell's exit code each time."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

# Installs the handlers, says it is ready, then blocks the main thread as a stuck engine would.
_STUCK_RUN = """
import sys, threading
from flows.run_guard import SignalStop
from hsx.interrupt import stop_requested
stop = SignalStop(grace_s={grace})
stop.install()
print("ready", flush=True)
while True:
    threading.Event().wait(0.05)
    if stop_requested() and not getattr(stop, "_said", False):
        stop._said = True
        print("stop requested", flush=True)
"""


def _start(grace_s: float) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _STUCK_RUN.format(grace=grace_s)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    return child


def _wait_line(child: subprocess.Popen[str], expected: str, timeout_s: float = 10) -> None:
    assert child.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], 0.1)
        if ready and child.stdout.readline().strip() == expected:
            return
    raise AssertionError(f"expected {expected!r} from the child within {timeout_s} s")


def test_a_second_ctrl_c_exits_at_once() -> None:
    child = _start(grace_s=60)
    child.send_signal(signal.SIGINT)
    _wait_line(child, "stop requested")
    assert child.poll() is None  # the first Ctrl-C waits for chunks in flight
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=10) == 130  # 128 + SIGINT
    assert time.monotonic() - sent < 5
    stderr = child.stderr.read() if child.stderr else ""
    assert "SIGINT received: no new chunks start" in stderr
    assert "send it again to exit now" in stderr
    assert "SIGINT again: exiting now" in stderr


def test_a_run_that_does_not_stop_is_ended_after_the_grace() -> None:
    child = _start(grace_s=1.5)
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 143  # 128 + SIGTERM
    waited = time.monotonic() - sent
    assert 1.5 <= waited < 10, waited
    stderr = child.stderr.read() if child.stderr else ""
    assert "SIGTERM received" in stderr
    assert "still running 2 s after SIGTERM: exiting now" in stderr
