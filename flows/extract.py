"""The extraction flow: resume check -> [preflight] -> plan -> one task per pending work chunk ->
verify -> audit (a sample of positions through the model's own head: hsx.audit).

A chunk that fails is retried alone (transient errors) or not at all (fatal ones), with its full
traceback in the logs; the other chunks go on. The flow raises when any chunk failed or
verification did not pass, so the UI shows Failed and its Retry re-runs only what is missing (the
store's commit records say what is done).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.runtime import deployment
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner

from flows.chunk_loop import ChunkLoop, ChunkTally, summarize
from flows.reporting import (
    Progress,
    ThroughputPlot,
    chunk_rows,
    chunk_table,
    current_attempt,
    hold_further_sigterms,
    run_is_cancelling,
    run_summary,
    run_tags,
    settings_from_parameters,
    tag_run,
)
from hsx.errors import HsxError
from hsx.extraction.host_pipeline import MAX_CHUNKS_IN_FLIGHT
from hsx.extraction.run import ExtractionRun
from hsx.extraction.steps import resolve_settings
from hsx.interrupt import request_stop, stop_reason, stop_requested
from hsx.store.run_records import RunAttempt, record_attempt, run_parity
from hsx.store.zarr_store import ExtractionStore
from settings import HsxSettings
from tasks.audit import run_audit_task
from tasks.common import backoff, describe
from tasks.extract import extract_chunk_task
from tasks.plan import plan_task, resume_check_task
from tasks.preflight import preflight_tasks
from tasks.verify import verify_task


class ExtractionIncompleteError(RuntimeError):
    """Raised at the end of a flow run whose chunks did not all commit and verify."""


@flow(
    name="hsx-extract",
    # Parameters are validated by settings_from_parameters: a deployment run's partial settings
    # are merged over the deployment's first (Prefect would replace them wholesale).
    validate_parameters=False,
    persist_result=False,  # the store is the result (Prefect keeps only failed states)
    # Threads start as tasks need them: the chunks in flight (sized from the plan) and the rest.
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_CHUNKS_IN_FLIGHT + 2),
)
def extract_flow(settings: HsxSettings) -> dict[str, Any] | State:
    """Extract the hidden states of ``settings.dataset`` through ``settings.model`` into
    ``settings.store``. From a deployment, ``settings`` may name only what it changes."""
    attempt = current_attempt("hsx-extract")
    stage = _Stage()
    resolved: HsxSettings | None = None
    try:
        # Model-derived defaults (max_model_len, max_length) filled in once, for every task.
        resolved = resolve_settings(settings_from_parameters(settings))
        tag_run(*run_tags(resolved))
        return _extract(resolved, attempt, stage)
    except TerminationSignal:
        # A Cancel or a worker's stop before or after the chunks (preflight, planning, verify).
        if resolved is None or stage.recorded:
            raise
        hold_further_sigterms()
        cancelled = run_is_cancelling()
        reason = "cancelled from Prefect" if cancelled else "SIGTERM received"
        request_stop(reason)
        record_attempt(
            resolved,
            attempt,
            "cancelled" if cancelled else "interrupted",
            {"reason": reason, "stopped_in": stage.name},
        )
        return Cancelled(message=f"stopped in {stage.name} ({reason}); a re-run finishes it")
    except BaseException as exc:
        if resolved is not None and not stage.recorded:
            record_failure(resolved, attempt, stage.name, exc)
        raise


class _Stage:
    """Where the run is, for the record of a run that fails before its end."""

    def __init__(self) -> None:
        self.name = "settings"
        self.recorded = False  # a final record (completed, failed, interrupted) is written


def record_failure(
    settings: HsxSettings, attempt: RunAttempt, stage: str, exc: BaseException
) -> None:
    """The record of an attempt that failed before its end (resume check, preflight, planning,
    an error of the flow itself): in the store, or beside it when there is no store yet."""
    logger = get_run_logger()
    fields = {"failed_in": stage, "error": describe(exc)}
    try:
        where = record_attempt(settings, attempt, "failed", fields)
    except Exception as record_exc:  # e.g. the store's disk: Prefect keeps the run all the same
        logger.error("the run record could not be written: %r", record_exc, exc_info=True)
        where = f"not written ({record_exc!r})"
    run_summary(attempt, settings, "failed", {"failed_in": stage, "error": describe(exc)[:2000]})
    create_markdown_artifact(
        f"# hsx extraction failed in {stage}\n\n- **error**: {describe(exc)}\n"
        f"- **attempt**: {attempt.attempt}\n- **run record**: {where}",
        key="hsx-run-record",
        description=f"failed in {stage}",
    )


def _extract(settings: HsxSettings, attempt: RunAttempt, stage: _Stage) -> dict[str, Any] | State:
    started = time.perf_counter()
    stage.name = "resume-check"
    resume_check_task(settings)  # seconds, before the probe builds a model
    if settings.run.preflight:
        stage.name = "preflight"
        preflight_tasks(settings)
    else:
        parity = run_parity(settings)
        if parity is not None and parity.get("warning"):
            # Said in the log as in the run record and `hsx info`: nothing checks these states.
            get_run_logger().warning("preflight off: %s", parity["warning"])
    stage.name = "plan"
    plan = plan_task(settings)
    # The run's spec, engine home and host pipeline: built once here, shared by every chunk.
    with ExtractionRun.open(settings) as run:
        return _extract_planned(run, plan, attempt, stage, started)


def _extract_planned(
    run: ExtractionRun,
    plan: dict[str, Any],
    attempt: RunAttempt,
    stage: _Stage,
    started: float,
) -> dict[str, Any] | State:
    settings = run.settings
    stage.name = "extract"
    record_attempt(settings, attempt, "running", {"pending_chunks": plan["pending"]})
    pending: list[int] = plan["pending"]
    progress = Progress(len(pending), f"{len(pending)} work chunks to extract")
    chunk_task = extract_chunk_task.with_options(
        retries=settings.run.retries,
        retry_delay_seconds=backoff(settings.run.retry_delay_seconds, settings.run.retries),
    )
    # Enough chunk tasks at once that their batches fill the engine's queue while others write
    # and commit (hsx.extraction.host_pipeline.chunks_in_flight): the engine never waits.
    concurrency = run.concurrency(int(plan["tokens"]), int(plan["chunks"]))
    get_run_logger().info("%d work chunks in flight at once", concurrency)
    plot = ThroughputPlot(f"{settings.store}: attempt {attempt.attempt}")
    loop = ChunkLoop(run, chunk_task, pending, concurrency, progress, plot)
    try:
        loop.run_all()
    except TerminationSignal:
        # Prefect's SIGTERM bridge (the UI's or API's Cancel, a worker's stop) raised here: the
        # chunks in flight must abandon too, and the store must say the run was stopped.
        hold_further_sigterms()
        cancelled = run_is_cancelling()
        request_stop("cancelled from Prefect" if cancelled else "SIGTERM received")
        # (timeouts.stop_wait_s; the CLI's watchdog exits at 10 s in any case)
        loop.abandon_in_flight(settings.timeouts.stop_wait_s)
        tally = loop.tally
        return stopped(
            settings, attempt, stage, tally.failed, tally.abandoned, tally.not_started, cancelled
        )
    tally = loop.tally
    if stop_requested():
        # No verification: the user asked to stop within seconds; a re-run verifies everything.
        return stopped(
            settings, attempt, stage, tally.failed, tally.abandoned, tally.not_started, False
        )
    stage.name = "verify"
    readers = settings.timeouts.verify_readers
    verification = verify_task(settings.store, repair=settings.run.repair, readers=readers)
    if verification["repaired"]:
        # Corrupt chunks lost their commits: extract them again, then verify everything again.
        loop.redo(verification["repaired"])
        verification = verify_task(settings.store, readers=readers)
    summary = summarize(settings.store, plan, tally, verification, time.perf_counter() - started)
    if (
        settings.run.audit_positions
        and verification["ok"]
        and not (tally.failed or tally.not_started)
    ):
        # A sample of what was just written, through the model's own head: states that do
        # not line up with their tokens fail the run here (AuditFailedError, recorded).
        stage.name = "audit"
        audit_started = time.perf_counter()
        summary.update(run_audit_task(settings))
        summary["audit_seconds"] = round(time.perf_counter() - audit_started, 3)  # task's too
        summary["wall_seconds"] = round(time.perf_counter() - started, 2)
    return _report_end(settings, attempt, stage, plan, tally, summary, verification)


def _report_end(
    settings: HsxSettings,
    attempt: RunAttempt,
    stage: _Stage,
    plan: dict[str, Any],
    tally: ChunkTally,
    summary: dict[str, Any],
    verification: dict[str, Any],
) -> dict[str, Any]:
    """The run's record in the store, its chunk table, summary row and artifact; raises when a
    chunk failed, was not started or does not verify (Failed in the UI; a Retry redoes it)."""
    logger = get_run_logger()
    record_error: HsxError | None = None
    status = "completed" if verification["ok"] and not tally.failed else "failed"
    try:
        record_attempt(settings, attempt, status, {"summary": summary})
    except HsxError as exc:  # a full or read-only disk: the failed chunks must still be named
        record_error = exc
        logger.error("the run record could not be written: %r", exc, exc_info=True)
    stage.recorded = True
    rows = chunk_rows(attempt.run_id, tally.pending, tally.results, tally.errors, tally.not_started)
    chunk_table(
        rows,
        f"attempt {attempt.attempt}: {len(tally.results)} chunks committed, "
        f"{len(tally.failed)} failed",
    )
    retried = sum(1 for r in rows if isinstance(r["attempts"], int) and r["attempts"] > 1)
    run_summary(
        attempt,
        settings,
        status,
        {
            "chunks": plan["chunks"],
            "chunks_committed_now": summary["chunks_extracted_now"],
            "chunks_failed": len(tally.failed),
            "chunks_retried": retried,
            "tokens_extracted_now": tally.extracted_tokens,
            "extract_tokens_per_s": summary["extract_tokens_per_s"],
            "verification": verification["summary"],
            "audit": summary.get("audit", "off"),
        },
    )
    create_markdown_artifact(
        "# hsx extraction\n\n"
        + "\n".join(f"- **{key}**: {value}" for key, value in summary.items()),
        key="hsx-extract-summary",
        description=f"{summary['chunks_extracted_now']} chunks extracted, {verification['summary']}",
    )
    if tally.failed or tally.not_started or not verification["ok"]:
        raise ExtractionIncompleteError(_incomplete_message(tally, verification, record_error))
    if record_error is not None:
        raise record_error
    return summary


def _incomplete_message(
    tally: ChunkTally, verification: dict[str, Any], record_error: HsxError | None
) -> str:
    failed = tally.failed
    listed = "".join(f"\n  chunk {index}: {tally.errors[index]}" for index in failed[:20])
    more = (
        f"\n  ... and {len(failed) - 20} more (the run record lists all)"
        if len(failed) > 20
        else ""
    )
    unrecorded = (
        f"\n  the store's run record could not be written: {record_error}"
        if record_error is not None
        else ""
    )
    return (
        f"expected every work chunk committed and verified, found {len(failed)} failed, "
        f"{len(tally.not_started)} not started, and verification {verification['summary']}; "
        f"re-run (or Retry in the UI) to redo only what is missing.{listed}{more}{unrecorded}"
    )


def stopped(
    settings: HsxSettings,
    attempt: RunAttempt,
    stage: _Stage,
    failed: list[int],
    abandoned: list[int],
    not_started: list[int],
    cancelled: bool,
) -> State:
    """The end of a stopped run (a signal to the CLI, a Cancel from the UI or API, a worker's
    stop): its record in the store and its summary row, and Prefect's Cancelled state (a stop
    is neither a crash nor a failure; `hsx extract` reports it and exits 130 or 143)."""
    fields = record_interrupted(settings, attempt, failed, abandoned, not_started, cancelled)
    stage.recorded = True
    message = (
        f"stopped ({fields['reason']}): {fields['chunks_extracted_now']} chunks committed by "
        f"this run ({fields['tokens_extracted_now']} tokens), {len(abandoned)} abandoned before "
        f"their commit, {len(not_started)} not started; {fields['resume']}"
    )
    get_run_logger().warning("%s", message)
    return Cancelled(message=message)


def record_interrupted(
    settings: HsxSettings,
    attempt: RunAttempt,
    failed: list[int],
    abandoned: list[int],
    not_started: list[int],
    cancelled: bool = False,
) -> dict[str, Any]:
    """The store's run record of a stopped run: what this attempt committed (chunks and tokens,
    counted from the store's commit records: chunks in flight at a SIGTERM may have committed
    all the same), what it abandoned, and how to finish it. Returns the record's fields."""
    committed = ExtractionStore.open(settings.store).committed_by(attempt.run_id, attempt.attempt)
    status = "cancelled" if cancelled else "interrupted"
    fields = {
        "reason": stop_reason(),
        "chunks_extracted_now": len(committed),
        "tokens_extracted_now": sum(int(record.tokens) for record in committed),
        "chunks_abandoned": sorted(set(abandoned)),
        "chunks_failed": failed,
        "chunks_not_started": not_started,
        "resume": (
            "retry the run (the UI's Retry) or run it again"
            if deployment.get_id()
            else f"resume with: hsx extract --model {settings.model} --dataset "
            f"{settings.dataset} --store {settings.store}"
        ),
    }
    record_attempt(settings, attempt, status, fields)
    run_summary(
        attempt,
        settings,
        status,
        {
            "chunks_committed_now": fields["chunks_extracted_now"],
            "tokens_extracted_now": fields["tokens_extracted_now"],
            "chunks_abandoned": len(fields["chunks_abandoned"]),
            "chunks_not_started": len(not_started),
            "reason": fields["reason"],
        },
    )
    return fields
