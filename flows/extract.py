"""The extraction flow: resume check -> [preflight] -> plan -> one task per pending work chunk -> verify.

A chunk that fails is retried alone (transient errors) or not at all (fatal ones), with its full
traceback in the logs; the other chunks go on. The flow raises when any chunk failed or
verification did not pass, so the UI shows Failed and its Retry re-runs only what is missing (the
store's commit records say what is done).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner

from flows.reporting import (
    Progress,
    chunk_rows,
    chunk_table,
    current_attempt,
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
from hsx.store.run_records import RunAttempt, record_attempt
from hsx.store.zarr_store import ExtractionStore
from settings import HsxSettings
from tasks.common import backoff, describe
from tasks.extract import extract_chunk_task
from tasks.plan import plan_task, resume_check_task
from tasks.preflight import preflight_tasks
from tasks.verify import verify_task

# Stop early when this many chunks in a row failed after their retries: the cause is shared
# (engine, storage), and each further attempt could cost a model load.
MAX_CONSECUTIVE_FAILURES = 3


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
    logger = get_run_logger()
    stage.name = "extract"
    record_attempt(settings, attempt, "running", {"pending_chunks": plan["pending"]})
    progress = Progress(len(plan["pending"]), f"{len(plan['pending'])} work chunks to extract")
    chunk_task = extract_chunk_task.with_options(
        retries=settings.run.retries,
        retry_delay_seconds=backoff(settings.run.retry_delay_seconds, settings.run.retries),
    )
    failed: list[int] = []
    errors: dict[int, str] = {}  # failed chunk -> its last error
    results: dict[int, dict[str, Any]] = {}  # committed chunk -> what its task returned
    abandoned: list[int] = []
    skipped_samples = 0
    extracted_tokens = 0
    consecutive = 0
    pending = plan["pending"]
    in_flight: deque[tuple[int, PrefectFuture[dict[str, Any]]]] = deque()
    queue = deque(pending)
    done = 0
    loop_started = time.perf_counter()
    # Enough chunk tasks at once that their batches fill the engine's queue while others write
    # and commit (hsx.extraction.host_pipeline.chunks_in_flight): the engine never waits for a commit.
    concurrency = run.concurrency(int(plan["tokens"]), int(plan["chunks"]))
    logger.info("%d work chunks in flight at once", concurrency)
    try:
        while queue or in_flight:
            while (
                queue
                and len(in_flight) < concurrency
                and consecutive < MAX_CONSECUTIVE_FAILURES
                and not stop_requested()  # a stopped run starts nothing more
            ):
                chunk_index = queue.popleft()
                in_flight.append((chunk_index, chunk_task.submit(run, chunk_index)))
            if not in_flight:
                break
            chunk_index, future = in_flight[0]
            future.wait()  # a TerminationSignal here leaves the chunk in in_flight
            in_flight.popleft()
            state = future.state
            done += 1
            if state.is_failed() or state.is_crashed():
                if stop_requested():  # abandoned before its commit: not a failure of the chunk
                    abandoned.append(chunk_index)
                    continue
                failed.append(chunk_index)
                errors[chunk_index] = describe(future.result(raise_on_failure=False))
                consecutive += 1
                if consecutive >= MAX_CONSECUTIVE_FAILURES and queue:
                    logger.error(
                        "%d chunks in a row failed; not starting the %d remaining",
                        consecutive,
                        len(queue),
                    )
                continue
            consecutive = 0
            result = future.result()
            results[chunk_index] = result
            progress.update(done)
            extracted_tokens += int(result["tokens"])
            skipped_samples += int(result.get("samples_skipped", 0))
            elapsed = time.perf_counter() - loop_started
            logger.info(
                "progress: %d/%d chunks, %d tokens, %.0f tokens/s, ETA %.0f s",
                done,
                len(pending),
                extracted_tokens,
                extracted_tokens / max(elapsed, 1e-9),
                elapsed / done * (len(pending) - done),
            )
    except TerminationSignal:
        # Prefect's SIGTERM bridge (the UI's or API's Cancel, a worker's stop) raised here: the
        # chunks in flight must abandon too, and the store must say the run was stopped.
        cancelled = run_is_cancelling()
        request_stop("cancelled from Prefect" if cancelled else "SIGTERM received")
        # Chunks in flight reach a batch boundary (and abandon) or their commit within seconds;
        # waiting for them makes the run record count what was committed.
        # (timeouts.stop_wait_s; the CLI's watchdog exits at 10 s in any case)
        deadline = time.monotonic() + settings.timeouts.stop_wait_s
        for chunk_index, future in in_flight:
            future.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if not future.state.is_completed():
                abandoned.append(chunk_index)
        in_flight.clear()
        return stopped(settings, attempt, stage, failed, abandoned, list(queue), cancelled)
    if stop_requested():
        # No verification: the user asked to stop within seconds; a re-run verifies everything.
        return stopped(settings, attempt, stage, failed, abandoned, list(queue), False)
    not_started = list(queue)
    loop_seconds = time.perf_counter() - loop_started
    progress.update(done, force=True)
    stage.name = "verify"
    verification = verify_task(
        settings.store, repair=settings.run.repair, readers=settings.timeouts.verify_readers
    )
    repaired: list[int] = verification["repaired"]
    if repaired:
        # Corrupt chunks lost their commits: extract them again, then verify everything again.
        redo = [(index, chunk_task.submit(run, index)) for index in repaired]
        for index, future in redo:
            future.wait()
            if future.state.is_failed() or future.state.is_crashed():
                failed.append(index)
                errors[index] = describe(future.result(raise_on_failure=False))
            else:
                results[index] = future.result()
                extracted_tokens += int(results[index]["tokens"])
        verification = verify_task(settings.store, readers=settings.timeouts.verify_readers)
    wall = time.perf_counter() - started
    summary = {
        "store": settings.store,
        "samples": plan["samples"],
        # Longer than data.max_length (data.on_overlength): the store lists each one.
        "samples_truncated": plan.get("samples_truncated", 0),
        "samples_left_out": plan.get("samples_left_out", 0),
        "tokens": plan["tokens"],
        "chunks": plan["chunks"],
        "chunks_extracted_now": len(pending) + len(repaired) - len(failed) - len(not_started),
        "chunks_repaired": repaired,
        "chunks_failed": failed,
        "chunk_errors": {str(index): errors[index] for index in failed},
        "chunks_not_started": not_started,
        "samples_skipped_now": skipped_samples,
        "tokens_extracted_now": extracted_tokens,
        # Tokens over the extraction phase (first chunk's start to last commit), as the progress
        # lines count them; preflight and planning are in wall_seconds.
        "extract_tokens_per_s": round(extracted_tokens / loop_seconds, 1)
        if extracted_tokens
        else 0.0,
        "wall_seconds": round(wall, 2),
        "verification": verification["summary"],
        "verified": verification["ok"],
    }
    record_error: HsxError | None = None
    status = "completed" if verification["ok"] and not failed else "failed"
    try:
        record_attempt(settings, attempt, status, {"summary": summary})
    except HsxError as exc:  # a full or read-only disk: the failed chunks must still be named
        record_error = exc
        logger.error("the run record could not be written: %r", exc, exc_info=True)
    stage.recorded = True
    rows = chunk_rows(attempt.run_id, pending, results, errors, not_started)
    chunk_table(
        rows,
        f"attempt {attempt.attempt}: {len(results)} chunks committed, {len(failed)} failed",
    )
    run_summary(
        attempt,
        settings,
        status,
        {
            "chunks": plan["chunks"],
            "chunks_committed_now": summary["chunks_extracted_now"],
            "chunks_failed": len(failed),
            "chunks_retried": sum(
                1 for r in rows if isinstance(r["attempts"], int) and r["attempts"] > 1
            ),
            "tokens_extracted_now": extracted_tokens,
            "extract_tokens_per_s": summary["extract_tokens_per_s"],
            "verification": verification["summary"],
        },
    )
    create_markdown_artifact(
        "# hsx extraction\n\n"
        + "\n".join(f"- **{key}**: {value}" for key, value in summary.items()),
        key="hsx-extract-summary",
        description=f"{summary['chunks_extracted_now']} chunks extracted, {verification['summary']}",
    )
    if failed or not_started or not verification["ok"]:
        listed = "".join(f"\n  chunk {index}: {errors[index]}" for index in failed[:20])
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
        raise ExtractionIncompleteError(
            f"expected every work chunk committed and verified, found {len(failed)} failed, "
            f"{len(not_started)} not started, and verification {verification['summary']}; "
            f"re-run (or Retry in the UI) to redo only what is missing.{listed}{more}{unrecorded}"
        )
    if record_error is not None:
        raise record_error
    return summary


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
    committed = [
        record
        for record in ExtractionStore.open(settings.store).committed_chunks().values()
        if record.run_id == attempt.run_id and record.attempt == attempt.attempt
    ]
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
