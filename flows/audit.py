"""The audit flow: what a store's states mean. Every check that can refuse runs first (its plan
task); then one task per committed work chunk (retried alone), a few at once, the data's shape
beside them; then the report: a table of chunks and the report with its plots as artifacts,
the files in ``out``. The run ends Failed when the audit finds an error (the artifact and the
error name each chunk and sample)."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from hsx.audit import AuditReport, ChunkAudit, StoreAudit, brief, finding_lines, markdown
from hsx.store.storage_io import write_atomic
from hsx.store.zarr_store import fs_and_root
from tasks.audit import audit_chunk_task, data_shape_task, plan_audit_task
from tasks.common import describe

MAX_WORKERS = 16


class AuditIncompleteError(RuntimeError):
    """Some chunks could not be audited (their errors are listed)."""


class StoreAuditFailedError(RuntimeError):
    """The audit found errors; ``report`` is the whole report (the CLI prints it)."""

    def __init__(self, message: str, report: AuditReport | None = None) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[type[StoreAuditFailedError], tuple[str]]:
        return (type(self), (str(self),))  # the report stays in the process


@flow(
    name="hsx-audit",
    persist_result=False,
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_WORKERS + 1),
)
def audit_flow(
    store: str,
    model: str | None = None,
    positions: int = 65_536,  # as `hsx audit`'s (flows/audit_cli.py)
    samples: str | None = None,
    out: str | None = None,
    device: str = "auto",
    draft_vocab_size: int = 32_000,
    workers: int = 2,
    plots: bool = True,
) -> AuditReport:
    """Audit ``store`` (any fsspec URL). ``model``: the model folder (default: the one the
    store names; its config must be the store's); ``positions``: rows read, spread over the
    chunks (0: every row); ``samples``: START:END; ``out``: a folder for report.json,
    report.md and the plots; ``device``: auto, cpu or cuda; ``workers``: chunks at once."""
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers: expected 1..{MAX_WORKERS}, found {workers}")
    started = time.perf_counter()
    audit = plan_audit_task(store, model, positions, samples, device, draft_vocab_size)
    shape = data_shape_task.submit(audit)
    results = _audit_chunks(audit, workers)
    report = audit.report(results, shape.result(), time.perf_counter() - started)
    images = _plots(report) if plots else {}
    _publish(report, images, out)
    if not report.ok:
        listed = "".join(f"\n  {line}" for line in finding_lines(report)[:20])
        raise StoreAuditFailedError(f"audit of {store}: {brief(report)}{listed}", report)
    return report


def _audit_chunks(audit: StoreAudit, workers: int) -> list[ChunkAudit]:
    """One task per chunk read, ``workers`` at once; AuditIncompleteError naming the failed."""
    logger = get_run_logger()
    queue = deque(audit.audited_chunks)
    in_flight: deque[tuple[int, PrefectFuture[ChunkAudit]]] = deque()
    results: list[ChunkAudit] = []
    failed: dict[int, str] = {}
    total = len(queue)
    while queue or in_flight:
        while queue and len(in_flight) < workers:
            chunk = queue.popleft()
            in_flight.append((chunk, audit_chunk_task.submit(audit, chunk)))
        chunk, future = in_flight.popleft()
        future.wait()
        if future.state.is_failed() or future.state.is_crashed():
            failed[chunk] = describe(future.result(raise_on_failure=False))
            continue
        results.append(future.result())
        done = len(results) + len(failed)
        if done % max(1, total // 10) == 0 or done == total:
            logger.info("audited %d/%d chunks", done, total)
    if failed:
        listed = "".join(f"\n  chunk {c}: {e}" for c, e in sorted(failed.items())[:20])
        raise AuditIncompleteError(
            f"audit of {audit.store_url}: expected every chunk audited, found {len(failed)} "
            f"failed:{listed}"
        )
    return results


def _plots(report: AuditReport) -> dict[str, bytes]:
    from hsx.audit.plots import draw

    return draw(report)


def _publish(report: AuditReport, images: dict[str, bytes], out: str | None) -> None:
    """The artifacts (a table of chunks, the report with its plots) and the files in ``out``."""
    logger = get_run_logger()
    (logger.info if report.ok else logger.error)("audit: %s", brief(report))
    for line in finding_lines(report):
        logger.info("%s", line)
    rows: list[dict[str, Any]] = report.chunks[:1000]
    if rows:
        create_table_artifact(rows, key="hsx-audit-chunks", description=brief(report))
    create_markdown_artifact(markdown(report, images), key="hsx-audit", description=brief(report))
    summary = {
        "attempt": int(flow_run.get_run_count() or 1),
        "status": "completed" if report.ok else "failed",
        "model": report.model,
        "store": report.store,
        "seconds": report.seconds,
        "audit": brief(report),
    }
    create_table_artifact([summary], key="hsx-run-summary", description=summary["status"])
    if out is None:
        return
    fs, root = fs_and_root(out)
    files = {
        "report.json": json.dumps(report.to_json(), indent=1, default=str).encode(),
        "report.md": markdown(report).encode(),
        **{f"{name}.png": png for name, png in images.items()},
    }
    for name, payload in files.items():
        write_atomic(fs, f"{root}/{name}", payload, store=out)
    logger.info("wrote %s to %s", ", ".join(files), out)
