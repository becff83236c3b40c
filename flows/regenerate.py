"""The regeneration flow: plan (every row checked, frozen inputs compared) -> one task per chunk
of conversations not yet committed -> verify of every committed part.

A chunk that fails is retried alone; the flow raises when any chunk failed, so the UI shows
Failed and its Retry (or the same command again) redoes only the missing chunks. A stop (the UI's
Cancel, a worker's SIGTERM, the CLI's Ctrl-C) starts no new chunk, lets the chunks in flight
abandon between turns, and ends the run Cancelled. Every attempt leaves its summary row for
`hsx runs`. The output is a dataset `hsx extract --dataset OUT` reads, once every chunk is
committed.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.states import Cancelled, State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.reporting import (
    current_attempt,
    hold_further_sigterms,
    run_is_cancelling,
    run_summary,
    settings_from_parameters,
)
from hsx.interrupt import request_stop, stop_reason, stop_requested
from hsx.regeneration.generators import make_generator
from hsx.regeneration.output import RegeneratedOutput
from hsx.regeneration.run import CHUNKS_IN_FLIGHT, RegenerationRun
from hsx.store.run_records import RunAttempt
from settings.regenerate import RegenerateSettings
from tasks.common import backoff, describe
from tasks.regenerate import plan_regeneration_task, regenerate_chunk_task

# Seconds a stopped run waits for its chunks in flight to abandon (they look every STOP_POLL_S)
# or commit; the CLI exits at run_guard.STOP_GRACE_S in any case.
STOP_WAIT_S = 5.0


class RegenerationIncompleteError(RuntimeError):
    """Some chunks failed, or a committed part does not verify (the flow's logs name them)."""


@flow(
    name="hsx-regenerate",
    validate_parameters=False,  # settings_from_parameters merges a deployment run's partial ones
    persist_result=False,  # the output is the result
    task_runner=ThreadPoolTaskRunner(max_workers=CHUNKS_IN_FLIGHT + 1),
)
def regenerate_flow(settings: RegenerateSettings) -> dict[str, Any] | State:
    """Regenerate the assistant turns of ``settings.dataset`` with ``settings.model`` into
    ``settings.out``. From a deployment, ``settings`` may name only what it changes."""
    attempt = current_attempt("hsx-regenerate")
    resolved = settings_from_parameters(settings, RegenerateSettings)
    try:
        return _regenerate(resolved, attempt)
    except TerminationSignal:  # a Cancel or a worker's stop outside the chunk phase
        hold_further_sigterms()
        request_stop("cancelled from Prefect" if run_is_cancelling() else "SIGTERM received")
        run_summary(attempt, resolved, _stop_status(), {"reason": stop_reason()})
        return Cancelled(message=f"stopped ({stop_reason()}); a re-run finishes it")
    except BaseException as exc:
        run_summary(attempt, resolved, "failed", {"error": describe(exc)[:2000]})
        raise


def _regenerate(settings: RegenerateSettings, attempt: RunAttempt) -> dict[str, Any] | State:
    logger = get_run_logger()
    started = time.perf_counter()
    tokenizer, plan = plan_regeneration_task(settings)
    output = RegeneratedOutput(settings.out)
    generator = make_generator(
        settings.model,
        settings.engine,
        settings.generation.request_timeout_s,
        plan.sampling,
    )
    try:
        run = RegenerationRun(settings, tokenizer, plan, generator, output)
        chunks_started = time.perf_counter()
        loop = _ChunkLoop(run, settings)
        try:
            loop.run_all()
        except TerminationSignal:
            # Prefect's SIGTERM bridge (the UI's Cancel, a worker's stop) raised here: the
            # chunks in flight abandon at their next turn, before their commit.
            hold_further_sigterms()
            request_stop("cancelled from Prefect" if run_is_cancelling() else "SIGTERM received")
            loop.abandon_in_flight()
        chunk_phase_s = time.perf_counter() - chunks_started
    finally:
        generator.close()
    if stop_requested():  # no verify: a stop is asked to end within seconds
        # Counted from the commit records this attempt wrote: a chunk in flight at the stop
        # may have committed after its future was given up on.
        records = output.committed_by(attempt.run_id, attempt.attempt)
        counted = _tally([_as_result(r) for r in records], plan.conversations, len(plan.chunks))
        return _stopped(settings, attempt, loop, counted)
    tally = _tally(loop.results, plan.conversations, len(plan.chunks))
    problems = output.verify()
    summary = {
        "out": settings.out,
        **tally,
        "chunks_failed": len(loop.failed),
        # Over the chunk phase: the first chunk's start (the engine's load included) to the last
        # commit.
        "generated_tokens_per_s": round(
            tally["generated_tokens_now"] / max(chunk_phase_s, 1e-9), 1
        ),
        "wall_seconds": round(time.perf_counter() - started, 2),
        "engine": generator.describe(),
        "verify": "OK" if not problems else f"{len(problems)} problems",
    }
    create_markdown_artifact(
        "# hsx regenerate\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in summary.items()),
        key="hsx-regenerate-summary",
        description=f"{tally['chunks_committed_now']} chunks committed now",
    )
    if loop.failed or problems:
        listed = "".join(f"\n  chunk {i}: {e}" for i, e in sorted(loop.failed.items())[:20])
        listed += "".join(f"\n  {problem}" for problem in problems[:20])
        raise RegenerationIncompleteError(
            f"regeneration {settings.out}: expected every chunk committed and verified, found "
            f"{len(loop.failed)} failed and {len(problems)} problems; run it again (or Retry) to "
            f"redo only what is missing.{listed}"
        )
    run_summary(attempt, settings, "completed", _summary_row(summary))
    logger.info("regenerated: %s", summary)
    return summary


class _ChunkLoop:
    """Every pending chunk as a task, CHUNKS_IN_FLIGHT at a time; none started after a stop."""

    def __init__(self, run: RegenerationRun, settings: RegenerateSettings) -> None:
        self.run = run
        self.task = regenerate_chunk_task.with_options(
            retries=settings.run.retries,
            retry_delay_seconds=backoff(settings.run.retry_delay_seconds, settings.run.retries),
        )
        self.queue = deque(run.pending())
        self.in_flight: deque[tuple[int, PrefectFuture[dict[str, Any]]]] = deque()
        self.results: list[dict[str, Any]] = []
        self.failed: dict[int, str] = {}
        self.abandoned: list[int] = []

    def run_all(self) -> None:
        while self.queue or self.in_flight:
            while self.queue and len(self.in_flight) < CHUNKS_IN_FLIGHT and not stop_requested():
                index = self.queue.popleft()
                self.in_flight.append((index, self.task.submit(self.run, index)))
            if not self.in_flight:
                break
            index, future = self.in_flight[0]
            future.wait()
            self.in_flight.popleft()
            self._finished(index, future)

    def _finished(self, index: int, future: PrefectFuture[dict[str, Any]]) -> None:
        if future.state.is_failed() or future.state.is_crashed():
            if stop_requested():  # abandoned before its commit: not a failure of the chunk
                self.abandoned.append(index)
            else:
                self.failed[index] = describe(future.result(raise_on_failure=False))
            return
        self.results.append(future.result())

    def abandon_in_flight(self) -> None:
        """After a stop: chunks in flight abandon at their next turn (STOP_POLL_S) or commit;
        waiting for them lets the summary count what was committed."""
        deadline = time.monotonic() + STOP_WAIT_S
        for index, future in self.in_flight:
            future.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if future.state.is_completed():
                self.results.append(future.result())
            else:
                self.abandoned.append(index)
        self.in_flight.clear()


def _stop_status() -> str:
    return "cancelled" if stop_reason() == "cancelled from Prefect" else "interrupted"


def _stopped(
    settings: RegenerateSettings, attempt: RunAttempt, loop: _ChunkLoop, tally: dict[str, Any]
) -> State:
    """A stopped run's summary row and Prefect's Cancelled state (neither a crash nor a
    failure: what is committed stays; a re-run or Retry redoes only the rest)."""
    message = (
        f"stopped ({stop_reason()}): {tally['chunks_committed_now']} chunks committed by this "
        f"run ({tally['generated_tokens_now']} tokens generated), {len(loop.abandoned)} "
        f"abandoned before their commit, {len(loop.queue)} not started; a re-run (or Retry) "
        "redoes only what is missing"
    )
    fields = {
        "reason": stop_reason(),
        "chunks_committed_now": tally["chunks_committed_now"],
        "chunks_abandoned": len(loop.abandoned),
        "chunks_not_started": len(loop.queue),
    }
    run_summary(attempt, settings, _stop_status(), fields)
    get_run_logger().warning("%s", message)
    return Cancelled(message=message)


def _summary_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The completed run's row for ``hsx runs`` (its scalars)."""
    return {
        "chunks_committed_now": summary["chunks_committed_now"],
        "chunks_failed": summary["chunks_failed"],
        "generated_tokens_now": summary["generated_tokens_now"],
        "generated_tokens_per_s": summary["generated_tokens_per_s"],
        "verify": summary["verify"],
    }


def _as_result(record: dict[str, Any]) -> dict[str, Any]:
    """A commit record read back, in the shape of the chunk task's result."""
    return {
        "index": record["index"],
        "skipped": False,
        "rows": record["rows"],
        "generated_tokens": record["generated_tokens"],
        "failed": len(record["failed"]),
        "dropped": len(record["dropped"]),
        "finish_reasons": record["finish_reasons"],
    }


def _tally(results: list[dict[str, Any]], conversations: int, chunks: int) -> dict[str, Any]:
    done = [r for r in results if not r["skipped"]]
    reasons: Counter[str] = Counter()
    for result in done:
        reasons.update(result["finish_reasons"])
    return {
        "conversations": conversations,
        "chunks": chunks,
        "chunks_committed_now": len(done),
        "rows_written_now": sum(r["rows"] for r in done),
        "generated_tokens_now": sum(r["generated_tokens"] for r in done),
        "samples_failed_now": sum(r["failed"] for r in done),
        "samples_dropped_now": sum(r["dropped"] for r in done),
        "finish_reasons_now": dict(sorted(reasons.items())),
    }
