"""The export flow: a store into the files a trainer reads (speculators, SpecForge, ModelOpt),
one retryable task per unit of the store's committed work chunks, a manifest of checksums last,
then a verification of every file. A re-run (or the UI's Retry) writes only what is missing."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from hsx.trainers.export import Exporter
from tasks.common import describe
from tasks.export import (
    export_unit_task,
    finish_export_task,
    plan_export_task,
    verify_export_task,
)

MAX_WRITERS = 32


class ExportIncompleteError(RuntimeError):
    """Some units failed or some files do not verify (the flow's logs name them)."""


@flow(
    name="hsx-export",
    persist_result=False,
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_WRITERS + 1),
)
def export_flow(
    store: str,
    out: str,
    format: Literal["speculators", "specforge", "modelopt"] = "speculators",
    model: str | None = None,
    samples: str | None = None,
    writers: int = 4,
    unit_samples: int = 0,
    retries: int = 2,
) -> dict[str, Any]:
    """Export ``store`` to ``out`` in a trainer's format. ``model``: the model folder (for the
    post-norm final state SpecForge wants; default the folder the store names); ``samples``:
    START:END of sample indices; ``writers``: units written at once (1..32); ``unit_samples``:
    samples per unit (0 = one unit per work chunk of the store)."""
    logger = get_run_logger()
    if not 1 <= writers <= MAX_WRITERS:
        raise ValueError(f"writers: expected 1..{MAX_WRITERS}, found {writers}")
    started = time.perf_counter()
    plan = plan_export_task(store, out, format, model, samples, unit_samples)
    exporter = Exporter(plan)  # built once: the store's reader, the format, the final norm
    unit_task = export_unit_task.with_options(retries=retries)
    failed: dict[int, str] = {}
    written = kept = skipped = 0
    nbytes = 0
    queue = deque(range(len(plan.units)))
    in_flight: deque[tuple[int, PrefectFuture[dict[str, Any]]]] = deque()
    done = 0
    while queue or in_flight:
        while queue and len(in_flight) < writers:
            index = queue.popleft()
            in_flight.append((index, unit_task.submit(exporter, index)))
        index, future = in_flight.popleft()
        future.wait()
        done += 1
        if future.state.is_failed() or future.state.is_crashed():
            failed[index] = describe(future.result(raise_on_failure=False))
            continue
        result = future.result()
        written += result["files_written"]
        kept += result["files_kept"]
        skipped += int(result["skipped"])
        nbytes += result["bytes_written"]
        if done % max(1, len(plan.units) // 20) == 0 or done == len(plan.units):
            elapsed = time.perf_counter() - started
            logger.info(
                "progress: %d/%d units, %d files written (%.1f MB, %.1f MB/s)",
                done,
                len(plan.units),
                written,
                nbytes / 1e6,
                nbytes / 1e6 / max(elapsed, 1e-9),
            )
    if failed:
        listed = "".join(f"\n  unit {i}: {error}" for i, error in sorted(failed.items())[:20])
        raise ExportIncompleteError(
            f"export {out}: expected every unit written, found {len(failed)} failed; re-run to "
            f"write only what is missing.{listed}"
        )
    finished = finish_export_task(exporter)
    verification = verify_export_task(out)
    summary = {
        "out": out,
        "format": format,
        "samples": finished["samples"],
        "files": finished["files"],
        "units": len(plan.units),
        "units_already_done": skipped,
        "files_written_now": written,
        "files_kept": kept,
        "bytes_written_now": nbytes,
        "samples_left_out": len(plan.left_out),
        "wall_seconds": round(time.perf_counter() - started, 2),
        "verification": verification["summary"],
    }
    create_markdown_artifact(
        "# hsx export\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in summary.items()),
        key="hsx-export-summary",
        description=verification["summary"],
    )
    if not verification["ok"]:
        problems = "".join(f"\n  {p}" for p in verification["mismatched"] + verification["missing"])
        raise ExportIncompleteError(f"export {out}: {verification['summary']}{problems}")
    return summary
