"""A real Prefect stack for tests, as a team runs it: infra/prefect-up.sh on a free 127.0.0.1
port with a fresh database (SQLite, or Debian's PostgreSQL), the deployments of
infra/prefect.yaml, a real process worker (infra/start-worker.sh), and the REST calls the UI
makes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import REPO_ROOT, missing_component
from tests.servers import free_port

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class Stack:
    """The server, its worker, and the REST calls the UI makes."""

    def __init__(
        self,
        home: Path,
        port: int,
        env: dict[str, str],
        workers: list[subprocess.Popen[bytes]] | None = None,
        up_options: Sequence[str] = (),
    ) -> None:
        self.home, self.port, self.env = home, port, env
        self.workers = workers or []  # infra/start-worker.sh processes, each its own group
        self.up_options = list(up_options)  # infra/prefect-up.sh's, for a restart
        self.api = f"http://127.0.0.1:{port}/api"
        self.http = httpx.Client(base_url=self.api, timeout=30)

    @property
    def server_log(self) -> Path:
        """infra/prefect-up.sh's log of the server (its last start)."""
        (log,) = self.home.glob(f"server-{self.port}.log")
        return log

    def server_errors(self) -> list[str]:
        """The ERROR (and CRITICAL) records of the server's log, each with its traceback."""
        from flows.stack_check import server_log_errors

        return server_log_errors(self.server_log.read_text(errors="replace"))

    def start_worker(self, extra: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """One more infra/start-worker.sh (its own session, output to ``log``), stopped with the
        stack."""
        with log.open("ab") as output:
            worker = subprocess.Popen(
                ["bash", str(REPO_ROOT / "infra" / "start-worker.sh")],
                env={**self.env, **extra},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.workers.append(worker)
        return worker

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def restart_server(self, outage_s: float = 5.0) -> None:
        """Stop the Prefect server (SIGTERM to its group, as systemd stops it), wait
        ``outage_s``, and start it again with the same options (same port and database)."""
        (pidfile,) = self.home.glob("server-*.pid")
        os.killpg(int(pidfile.read_text()), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while self.answers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not self.answers(), "the Prefect server did not stop"
        time.sleep(outage_s)
        up = subprocess.run(
            ["bash", str(REPO_ROOT / "infra" / "prefect-up.sh"), *self.up_options],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=600,
        )
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One REST call, retried on 503 as Prefect's own client (and so the worker) does: a
        SQLite server answers 503 when a write meets another's lock (PostgreSQL for teams)."""
        for _ in range(20):
            response = self.http.request(method, path, **kwargs)
            if response.status_code != 503:
                break
            time.sleep(0.5)
        response.raise_for_status()
        return response

    def deployment_id(self, flow: str, name: str) -> str:
        response = self.call("GET", f"/deployments/name/{flow}/{name}")
        response.raise_for_status()
        return str(response.json()["id"])

    def run(self, flow: str, name: str, parameters: dict[str, Any]) -> str:
        deployment = self.deployment_id(flow, name)
        response = self.call(
            "POST", f"/deployments/{deployment}/create_flow_run", json={"parameters": parameters}
        )
        return str(response.json()["id"])

    def flow_run(self, run_id: str) -> dict[str, Any]:
        response = self.call("GET", f"/flow_runs/{run_id}")
        return dict(response.json())

    def wait(self, run_id: str, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            if run["state_type"] in TERMINAL:
                return run
            time.sleep(1)
        raise AssertionError(f"flow run {run_id} not finished after {timeout} s: {run['state']}")

    def retry_like_the_ui(self, run_id: str) -> None:
        """What the UI's Retry button sends, at once: the moment the run is seen Failed, while
        its process may still be exiting. (Prefect's late "Crashed" reports of a non-zero exit
        used to overwrite such a Retry; hsx's flow process exits 0 once its end is reported:
        flows/flow_process.py.)"""
        response = self.call(
            "POST",
            f"/flow_runs/{run_id}/set_state",
            json={
                "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry"},
                "force": True,
            },
        )
        assert response.json()["status"] == "ACCEPT", response.json()

    def task_runs(self, run_id: str) -> list[dict[str, Any]]:
        response = self.call(
            "POST",
            "/task_runs/filter",
            json={"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200},
        )
        return list(response.json())


RESTART_LINE = "start-worker: the worker exited"


def worker_restarts(log: Path, context: int = 0) -> list[str]:
    """Lines of infra/start-worker.sh's log saying its worker exited and was started again,
    each after the ``context`` lines before it (what the worker said as it went)."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [
        "\n".join(lines[max(0, i - context) : i + 1])
        for i, line in enumerate(lines)
        if RESTART_LINE in line
    ]


@contextmanager
def running_stack(database: str, workers: Sequence[dict[str, str]] = ({},)) -> Iterator[Stack]:
    """The stack on a free port with a fresh database; stopped and removed after. ``workers``:
    one infra/start-worker.sh each, with these environment variables over the stack's (its pool,
    a node's servers, its own PREFECT_HOME); the first logs to worker.log, the others to
    worker-N.log."""
    if database == "postgres" and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        missing_component(
            "Debian's postgresql package is not installed (apt-get install postgresql)"
        )
    # Not under pytest's tmp_path: PostgreSQL runs as its own user, which must reach its folder.
    home = Path(tempfile.mkdtemp(prefix=f"hsx-prefect-{database}-"))
    home.chmod(0o755)
    port = free_port()
    env = {
        **os.environ,
        "HSX_PREFECT_HOME": str(home),
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # the worker polls every 2 s, not 10
        "COLUMNS": "200",
    }
    options = ["--port", str(port)]
    if database == "postgres":
        options += ["--postgres", "--pg-port", str(free_port())]
    up = subprocess.run(
        ["bash", str(REPO_ROOT / "infra" / "prefect-up.sh"), *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    stack = Stack(home, port, env, [], options)
    started = stack.workers  # with those a test starts (Stack.start_worker): all stopped below
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"http://127.0.0.1:{port}" in up.stdout
        logs = [home / ("worker.log" if n == 0 else f"worker-{n}.log") for n in range(len(workers))]
        for extra, log in zip(workers, logs, strict=True):
            stack.start_worker(extra, log)
        yield stack
        # infra/start-worker.sh restarts a worker that exits, as systemd would; a restart during
        # a test is a worker crash that the test's own checks would not see.
        restarts = [line for log in logs for line in worker_restarts(log, context=30)]
        assert not restarts, "the worker exited and was restarted:\n" + "\n".join(restarts)
    except BaseException:
        # The flow runs' own output (a crashed run's traceback) is in the workers' logs only.
        for worker_log in sorted(home.glob("worker*.log")):
            text = worker_log.read_text(errors="replace")[-8000:]
            print(f"{worker_log.name} (tail):\n{text}")
        raise
    finally:
        for worker in started:
            with contextlib.suppress(ProcessLookupError):  # a test may have killed it
                os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        subprocess.run(["bash", str(REPO_ROOT / "infra" / "prefect-down.sh")], env=env, timeout=120)
        shutil.rmtree(home, ignore_errors=True)
