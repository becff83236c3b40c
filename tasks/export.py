"""The export's tasks: its plan, one unit (retried alone), its manifest, its verification."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from hsx.trainers.export import Exporter, ExportPlan, plan_export, verify_export
from tasks.common import logged_failures, retry_unless_fatal


@task(name="export-plan", cache_policy=NO_CACHE, persist_result=False)
def plan_export_task(
    store: str,
    out: str,
    format_name: str,
    model: str | None,
    samples: str | None,
    unit_samples: int,
) -> ExportPlan:
    """Which samples go to which unit and file; refused when an earlier run of the same export
    was asked for something else."""
    with logged_failures("export plan") as logger:
        plan = plan_export(store, out, format_name, model, samples, unit_samples)
        logger.info(
            "export %s -> %s (%s): %d samples in %d units, %d left out",
            store,
            out,
            format_name,
            len(plan.positions),
            len(plan.units),
            len(plan.left_out),
        )
        return plan


@task(
    name="export-unit",
    task_run_name="export-unit-{index:06d}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=[2.0, 4.0],
    retry_condition_fn=retry_unless_fatal,
)
def export_unit_task(exporter: Exporter, index: int) -> dict[str, Any]:
    """One unit's files, then its record: a retry writes only what is not already whole."""
    with logged_failures(f"export unit {index}"):
        result = exporter.export_unit(index)
        return {
            "unit": index,
            "skipped": result.skipped,
            "files_written": result.files_written,
            "files_kept": result.files_kept,
            "bytes_written": result.bytes_written,
        }


@task(name="export-manifest", cache_policy=NO_CACHE, persist_result=False, retries=1)
def finish_export_task(exporter: Exporter) -> dict[str, Any]:
    with logged_failures("export manifest") as logger:
        manifest = exporter.finish()
        logger.info("manifest: %d files, %d samples", len(manifest["files"]), manifest["samples"])
        return {"files": len(manifest["files"]), "samples": manifest["samples"]}


@task(name="export-verify", cache_policy=NO_CACHE, persist_result=False, retries=1)
def verify_export_task(out: str, readers: int | None = None) -> dict[str, Any]:
    with logged_failures("export verification") as logger:
        report = verify_export(out, readers)
        (logger.info if report.ok else logger.error)("verification %s", report.summary())
        return {
            "ok": report.ok,
            "summary": report.summary(),
            "missing": report.missing[:50],
            "mismatched": report.mismatched[:50],
        }
