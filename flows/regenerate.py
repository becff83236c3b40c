"""The regeneration flow: plan (every row checked, frozen inputs compared) -> one task per chunk
of conversations not yet committed -> verify of every committed part.

A chunk that fails is retried alone; the flow raises when any chunk failed, so the UI shows
Failed and its Retry (or the same command again) redoes only the missing chunks. The output is a
dataset `hsx extract --dataset OUT` reads, once every chunk is committed.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from flows.reporting import settings_from_parameters
from hsx.regeneration.generators import make_generator
from hsx.regeneration.output import RegeneratedOutput
from hsx.regeneration.run import CHUNKS_IN_FLIGHT, RegenerationRun
from settings.regenerate import RegenerateSettings
from tasks.common import backoff, describe
from tasks.regenerate import plan_regeneration_task, regenerate_chunk_task


class RegenerationIncompleteError(RuntimeError):
    """Some chunks failed, or a committed part does not verify (the flow's logs name them)."""


@flow(
    name="hsx-regenerate",
    validate_parameters=False,  # settings_from_parameters merges a deployment run's partial ones
    persist_result=False,  # the output is the result
    task_runner=ThreadPoolTaskRunner(max_workers=CHUNKS_IN_FLIGHT + 1),
)
def regenerate_flow(settings: RegenerateSettings) -> dict[str, Any]:
    """Regenerate the assistant turns of ``settings.dataset`` with ``settings.model`` into
    ``settings.out``. From a deployment, ``settings`` may name only what it changes."""
    logger = get_run_logger()
    resolved = settings_from_parameters(settings, RegenerateSettings)
    started = time.perf_counter()
    tokenizer, plan = plan_regeneration_task(resolved)
    output = RegeneratedOutput(resolved.out)
    generator = make_generator(
        resolved.model, resolved.engine, resolved.generation.request_timeout_s
    )
    try:
        run = RegenerationRun(resolved, tokenizer, plan, generator, output)
        chunks_started = time.perf_counter()
        results, failed = _run_chunks(run, resolved)
        chunk_phase_s = time.perf_counter() - chunks_started
    finally:
        generator.close()
    problems = output.verify()
    tally = _tally(results, plan.conversations, len(plan.chunks))
    summary = {
        "out": resolved.out,
        **tally,
        "chunks_failed": len(failed),
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
    if failed or problems:
        listed = "".join(f"\n  chunk {i}: {error}" for i, error in sorted(failed.items())[:20])
        listed += "".join(f"\n  {problem}" for problem in problems[:20])
        raise RegenerationIncompleteError(
            f"regeneration {resolved.out}: expected every chunk committed and verified, found "
            f"{len(failed)} failed and {len(problems)} problems; run it again (or Retry) to redo "
            f"only what is missing.{listed}"
        )
    logger.info("regenerated: %s", summary)
    return summary


def _run_chunks(
    run: RegenerationRun, settings: RegenerateSettings
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Every pending chunk as a task, CHUNKS_IN_FLIGHT at a time: results and failures."""
    chunk_task = regenerate_chunk_task.with_options(
        retries=settings.run.retries,
        retry_delay_seconds=backoff(settings.run.retry_delay_seconds, settings.run.retries),
    )
    queue = deque(run.pending())
    in_flight: deque[tuple[int, PrefectFuture[dict[str, Any]]]] = deque()
    results: list[dict[str, Any]] = []
    failed: dict[int, str] = {}
    while queue or in_flight:
        while queue and len(in_flight) < CHUNKS_IN_FLIGHT:
            index = queue.popleft()
            in_flight.append((index, chunk_task.submit(run, index)))
        index, future = in_flight.popleft()
        future.wait()
        if future.state.is_failed() or future.state.is_crashed():
            failed[index] = describe(future.result(raise_on_failure=False))
            continue
        results.append(future.result())
    return results, failed


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
