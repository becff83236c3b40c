"""What a flow run shows in the Prefect UI and keeps for audit: its attempt, its parameters merged
over its deployment's, tags, a progress bar, a chunk table and its run record."""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, TypeVar
from uuid import UUID

from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_run_logger
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel

from hsx.store.run_records import RunAttempt
from hsx.store.throughput import Commit, throughput_series, throughput_svg
from settings import HsxSettings, merge_partial
from settings.regenerate import RegenerateSettings

SettingsModel = TypeVar("SettingsModel", bound=BaseModel)


def current_attempt(flow: str) -> RunAttempt:
    """This flow run and attempt (run_count: 2 after a Retry from the UI)."""
    run_id = flow_run.get_id()
    return RunAttempt(
        run_id=str(run_id or f"local-{int(time.time())}"),
        attempt=int(flow_run.get_run_count() or 1),
        started_at=time.time(),
        name=str(flow_run.get_name()) if run_id else None,
        flow=flow,
    )


def settings_from_parameters(
    given: SettingsModel | dict[str, Any],
    model: type[SettingsModel] = HsxSettings,  # type: ignore[assignment]
    key: str = "settings",
) -> SettingsModel:
    """The run's settings (``model``: HsxSettings, RegenerateSettings, FanoutSettings; ``key``:
    the parameter holding them). From a deployment, a run's ``settings`` parameter is partial: it is merged over the deployment's own ``settings``
    (Prefect would replace them wholesale), then validated as strictly as the CLI's (an unknown
    key fails naming the closest known one)."""
    if isinstance(given, model):
        return given
    defaults = _deployment_parameters().get(key) or {}
    merged = merge_partial(defaults if isinstance(defaults, dict) else {}, dict(given))
    return model.model_validate(merged)


def _deployment_parameters() -> dict[str, Any]:
    """The parameters the deployment of this flow run was created with (Prefect's runtime
    ``deployment.parameters`` gives the run's own, already replaced wholesale)."""
    deployment_id = deployment.get_id()
    if not deployment_id:
        return {}
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return dict(client.read_deployment(UUID(deployment_id)).parameters or {})


def tag_run(*tags: str) -> None:
    """Add tags to this flow run (model, dataset, store), for the UI's filters."""
    run_id = flow_run.get_id()
    if not run_id:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(UUID(str(run_id)))
        wanted = sorted({*current.tags, *tags})
        if wanted != sorted(current.tags):
            client.update_flow_run(UUID(str(run_id)), tags=wanted)


def run_tags(settings: HsxSettings) -> list[str]:
    return [
        f"model:{settings.model.name}",
        f"dataset:{str(settings.dataset).rstrip('/').rsplit('/', 1)[-1]}",
        f"store:{settings.store.rstrip('/').rsplit('/', 1)[-1]}",
    ]


class Progress:
    """A progress artifact of the chunks done, updated as they finish (at most every 2 s)."""

    def __init__(self, total: int, description: str) -> None:
        self.total = max(total, 1)
        self._updated = 0.0
        self._id: UUID | None = None
        try:
            made = create_progress_artifact(
                0.0, key="hsx-extract-progress", description=description
            )
            self._id = made if isinstance(made, UUID) else None
        except Exception as exc:  # the UI's progress is not worth a failed run
            get_run_logger().warning("progress artifact not created: %r", exc)

    def update(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if self._id is None or (not force and now - self._updated < 2.0):
            return
        self._updated = now
        try:
            update_progress_artifact(self._id, round(100.0 * done / self.total, 1))
        except Exception as exc:
            get_run_logger().warning("progress artifact not updated: %r", exc)


class ThroughputPlot:
    """The run's tokens/s over time as a plot on its page: a "rich" artifact (an SVG, which
    Prefect's UI shows in a sandboxed frame in the run's Artifacts), drawn as chunks commit (at
    most every ``period_s``) and at the attempt's end; hsx.store.throughput draws it, as for
    ``hsx info --plot``."""

    KEY = "hsx-extract-throughput"

    def __init__(self, title: str, period_s: float = 30.0) -> None:
        self.title = title
        self.period_s = period_s
        self.started = time.time()
        self.commits: list[Commit] = []
        self._drawn = 0.0
        self._id: UUID | None = None
        self._failed = False

    def add(self, tokens: int) -> None:
        """A chunk committed now with ``tokens`` tokens."""
        self.commits.append(Commit(time.time(), tokens))
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._failed or not self.commits or (not force and now - self._drawn < self.period_s):
            return
        self._drawn = now
        series = throughput_series(self.commits, start=self.started)
        data = {"html": throughput_svg(series, self.title), "sandbox": []}
        description = (
            f"{sum(c.tokens for c in self.commits):,} tokens in {len(self.commits)} chunks"
        )
        try:
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

            with get_client(sync_client=True) as client:
                if self._id is None:
                    run_id = flow_run.get_id()
                    made = client.create_artifact(
                        ArtifactCreate(
                            key=self.KEY,
                            type="rich",
                            data=data,
                            description=description,
                            flow_run_id=UUID(str(run_id)) if run_id else None,
                        )
                    )
                    self._id = made.id
                else:
                    client.update_artifact(
                        self._id, ArtifactUpdate(data=data, description=description)
                    )
        except Exception as exc:  # the plot is not worth a failed run
            self._failed = True
            get_run_logger().warning("throughput plot not drawn: %r", exc)


def run_summary(
    attempt: RunAttempt,
    settings: HsxSettings | RegenerateSettings,
    status: str,
    fields: dict[str, Any],
) -> None:
    """One row that ``hsx runs`` reads back from the API: this attempt's outcome ("store" is
    where it writes: an extraction's store, a regeneration's output folder)."""
    retried = fields.pop("chunks_retried", None)
    row = {
        "attempt": attempt.attempt,
        "status": status,
        "model": str(settings.model),
        "dataset": str(settings.dataset),
        "store": settings.store if isinstance(settings, HsxSettings) else settings.out,
        "seconds": round(time.time() - attempt.started_at, 1),
        **({"chunks_retried": retried} if retried is not None else {}),
        **{k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in fields.items()},
    }
    try:
        create_table_artifact([row], key="hsx-run-summary", description=f"{status}")
    except Exception as exc:
        get_run_logger().warning("run summary artifact not created: %r", exc)


def chunk_table(rows: list[dict[str, Any]], description: str) -> None:
    """The per-chunk table of this attempt: state, rows, checksum, attempts, seconds."""
    if rows:
        create_table_artifact(rows, key="hsx-extract-chunks", description=description)


def _task_attempts(run_id: str) -> dict[int, int]:
    """Runs of each chunk task of this flow run (1 + its retries), from the API."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)]))
            )
    except Exception:  # outside Prefect's API (a local run id): no counts to show
        return {}
    return {
        int(run.name.removeprefix("extract-chunk-").split("-")[0]): run.run_count
        for run in runs
        if run.name.startswith("extract-chunk-")
    }


def chunk_rows(
    run_id: str,
    pending: list[int],
    results: dict[int, dict[str, Any]],
    errors: dict[int, str],
    not_started: list[int],
) -> list[dict[str, Any]]:
    """One row per chunk this attempt was to extract (at most 1,000: the table is for eyes)."""
    attempts = _task_attempts(run_id)
    rows = []
    for index in pending[:1000]:
        result = results.get(index)
        if result is not None:
            state = "already committed" if result.get("skipped") else "committed"
        elif index in errors:
            state = "failed"
        else:
            state = "not started" if index in not_started else "abandoned"
        rows.append(
            {
                "chunk": index,
                "state": state,
                "rows": (result or {}).get("rows", "-"),
                "tokens": (result or {}).get("tokens", "-"),
                "checksum": str((result or {}).get("checksum", "-"))[:16],
                "attempts": attempts.get(index, (result or {}).get("attempt", "-")),
                "seconds": round(float((result or {}).get("seconds", 0.0)), 2),
                # engine.url runs: which `hsx serve` computed the chunk.
                "server": (result or {}).get("server", "-"),
                "error": errors.get(index, "")[:300],
            }
        )
    return rows


def run_is_cancelling() -> bool:
    """Whether Prefect is cancelling this flow run (its SIGTERM is then a Cancel, not a stop of
    the worker)."""
    run_id = flow_run.get_id()
    if not run_id:
        return False
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state
        return state is not None and (state.is_cancelling() or state.is_cancelled())
    except Exception as exc:  # the API unreachable: a stop all the same
        get_run_logger().warning("could not read this run's state: %r", exc)
        return False


def hold_further_sigterms() -> None:
    """After the SIGTERM that stops this run, later ones are written to stderr instead of
    raised (a worker forwards its stop to its runs while systemd's default KillMode sends one
    to every process): the stop records what it did and ends Cancelled within seconds, and the
    worker kills the process if it does not within its grace (flows/worker_launch.py)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def held(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write("hsx: SIGTERM again: already stopping (recording what is committed)\n")

    signal.signal(signal.SIGTERM, held)
