"""``hsx runs``: past extraction runs from the Prefect API (PREFECT_API_URL), each attempt's
outcome as the flow recorded it (its ``hsx-run-summary`` artifact), and ``hsx runs show ID``: a
run's attempts and its failed chunks with their errors and tracebacks (from the run's logs)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Annotated, Any
from uuid import UUID

import typer
from rich.console import Console
from rich.table import Table

runs_app = typer.Typer(help="Past runs from the Prefect API: hsx runs, hsx runs show ID.")
console = Console()
# The runs a user starts; a fan-out's children (hsx-extract-item) are parts of their parent's.
FLOWS = (
    "hsx-extract",
    "hsx-extract-fanout",
    "hsx-regenerate",
    "hsx-verify",
    "hsx-audit",
    "hsx-preflight",
)


def _client() -> Any:
    if not os.environ.get("PREFECT_API_URL"):
        console.print(
            "[bold red]error:[/] expected PREFECT_API_URL naming a Prefect server's API "
            "(infra/prefect-up.sh prints it, e.g. http://127.0.0.1:4200/api), found none"
        )
        raise typer.Exit(2)
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


# Prefect's API answers at most PREFECT_API_DEFAULT_LIMIT (200) items a call: everything past
# that is read page by page.
PAGE = 200


def read_pages(
    read: Callable[..., list[Any]], limit: int | None = None, **filters: Any
) -> list[Any]:
    """Every item ``read`` (a Prefect client's read_*) finds, up to ``limit`` (None: all),
    page by page."""
    found: list[Any] = []
    while limit is None or len(found) < limit:
        size = PAGE if limit is None else min(PAGE, limit - len(found))
        page = read(**filters, limit=size, offset=len(found))
        found.extend(page)
        if len(page) < size:
            break
    return found


def _summaries(client: Any, flow_run_ids: list[UUID]) -> dict[str, list[dict[str, Any]]]:
    """flow run id -> the rows of its hsx-run-summary artifacts, one per attempt, in order."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter
    from prefect.client.schemas.filters import FlowRunFilterId as RunId

    found: dict[str, list[dict[str, Any]]] = {}
    if not flow_run_ids:
        return found
    artifacts = read_pages(
        client.read_artifacts,
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["hsx-run-summary"])),
        flow_run_filter=FlowRunFilter(id=RunId(any_=flow_run_ids)),
    )
    for artifact in sorted(artifacts, key=lambda a: a.created):
        data = artifact.data
        rows = json.loads(data) if isinstance(data, str) else data
        if rows:
            found.setdefault(str(artifact.flow_run_id), []).append(dict(rows[0]))
    for rows in found.values():
        rows.sort(key=lambda r: int(r.get("attempt", 0)))
    return found


def _total(attempts: list[dict[str, Any]], key: str) -> int | str:
    """The sum of ``key`` over a run's attempts; "-" when no attempt recorded it."""
    values = [int(a[key]) for a in attempts if str(a.get(key, "")).lstrip("-").isdigit()]
    return sum(values) if values else "-"


def _duration(run: Any) -> str:
    seconds = run.total_run_time.total_seconds() if run.total_run_time else 0.0
    return f"{seconds:.0f} s"


@runs_app.callback(invoke_without_command=True)
def runs(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="How many runs, newest first; 0 = every run.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Past hsx runs: state, attempts, model, store, chunks committed/failed/retried, tokens/s."""
    if ctx.invoked_subcommand is not None:
        return
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    flows = FlowFilter(name=FlowFilterName(any_=list(FLOWS)))
    with _client() as client:
        found = read_pages(
            client.read_flow_runs,
            limit or None,
            flow_filter=flows,
            sort=FlowRunSort.START_TIME_DESC,
        )
        total = int(client.count_flow_runs(flow_filter=flows))
        summaries = _summaries(client, [run.id for run in found])
    listed = []
    for run in found:
        attempts = summaries.get(str(run.id), [])
        last = attempts[-1] if attempts else {}
        listed.append(
            {
                "id": str(run.id),
                "name": run.name,
                "state": run.state.name if run.state else "?",
                "attempts": run.run_count,
                "model": last.get("model", "-"),
                "store": last.get("store", run.parameters.get("store", "-")),
                # Every attempt's commits (a retried run's first attempt committed most); a
                # fan-out parent counts the store's, whichever child committed them.
                "committed": _total(attempts, "chunks_committed_now")
                if any("chunks_committed_now" in a for a in attempts)
                else last.get("chunks_committed", "-"),
                "failed": last.get("chunks_failed", "-"),
                "retried": last.get("chunks_retried", "-"),
                "duration": _duration(run),
                # Extraction's prompt tokens, regeneration's generated ones.
                "tokens_per_s": last.get(
                    "extract_tokens_per_s", last.get("generated_tokens_per_s", "-")
                ),
                # The end-of-run audit of an extraction (hsx.audit): its outcome in a line.
                "audit": last.get("audit", "-"),
                "tags": run.tags,
            }
        )
    if as_json:
        print(json.dumps(listed, indent=1, default=str))
        return
    table = Table(
        "run", "id", "state", "attempts", "model", "store", "committed", "failed", "retried",
        "duration", "tokens/s", "audit",
    )  # fmt: skip
    for row in listed:
        table.add_row(
            row["name"],
            row["id"][:8],
            row["state"],
            str(row["attempts"]),
            str(row["model"]).rsplit("/", 1)[-1],
            str(row["store"]),
            str(row["committed"]),
            str(row["failed"]),
            str(row["retried"]),
            row["duration"],
            str(row["tokens_per_s"]),
            str(row["audit"]),
        )
    console.print(table)
    console.print(shown_of(len(listed), total))


def shown_of(shown: int, total: int) -> str:
    """The line under ``hsx runs``' table: how many of how many runs it lists."""
    if shown >= total:
        return f"{total} run{'s' if total != 1 else ''}"
    return f"the newest {shown} of {total} runs (--limit N for more, --limit 0 for all)"


@runs_app.command("show")
def show(
    run_id: Annotated[str, typer.Argument(help="A flow run id (or its first characters).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One run: each attempt's outcome, and its failed chunks with error and traceback."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    with _client() as client:
        candidates = read_pages(
            client.read_flow_runs, flow_filter=FlowFilter(name=FlowFilterName(any_=list(FLOWS)))
        )
        matches = [run for run in candidates if str(run.id).startswith(run_id)]
        if len(matches) != 1:
            console.print(
                f"[bold red]error:[/] run {run_id!r}: expected one hsx flow run with that id, "
                f"found {len(matches)}"
            )
            raise typer.Exit(2)
        run = matches[0]
        attempts = _summaries(client, [run.id]).get(str(run.id), [])
        tasks = read_pages(
            client.read_task_runs,
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])),
        )
        logs = read_pages(
            client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
        )
    failures: dict[str, list[str]] = {}
    for log in logs:
        if log.task_run_id is not None and " failed (" in log.message:
            failures.setdefault(str(log.task_run_id), []).append(log.message)
    failed_chunks = [
        {
            "task": task.name,
            "state": task.state.name if task.state else "?",
            "runs": task.run_count,
            "state_message": task.state.message if task.state else "",
            "failures": failures.get(str(task.id), []),
        }
        for task in sorted(tasks, key=lambda t: t.name)
        if failures.get(str(task.id)) or (task.state is not None and task.state.is_failed())
    ]
    shown = {
        "id": str(run.id),
        "name": run.name,
        "state": run.state.name if run.state else "?",
        "attempts": attempts,
        "failed_or_retried_tasks": failed_chunks,
    }
    if as_json:
        print(json.dumps(shown, indent=1, default=str))
        return
    console.print(f"[bold]{run.name}[/] ({run.id}): {shown['state']}, {run.run_count} attempt(s)")
    for attempt in attempts:
        fields = ", ".join(f"{k} {v}" for k, v in attempt.items() if k != "attempt")
        console.print(f"  attempt {attempt.get('attempt')}: {fields}")
    for task in failed_chunks:
        console.print(
            f"[red]{task['task']}[/]: {task['state']} after {task['runs']} run(s): "
            f"{task['state_message']}"
        )
        for message in task["failures"]:
            console.print(message, markup=False, highlight=False)
