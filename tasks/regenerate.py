"""Regeneration's tasks: its plan (every row checked, the output's frozen inputs compared) and one
chunk of conversations per task run, retried alone, committed last."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from hsx.regeneration.output import RegeneratedOutput
from hsx.regeneration.run import (
    RegenerationPlan,
    RegenerationRun,
    load_tokenizer,
    plan_regeneration,
)
from settings.regenerate import RegenerateSettings
from tasks.common import logged_failures, retry_unless_fatal


@task(name="regenerate-plan", cache_policy=NO_CACHE, persist_result=False)
def plan_regeneration_task(settings: RegenerateSettings) -> tuple[Any, RegenerationPlan]:
    """The tokenizer and the plan; the output's manifest created, or checked against this run's
    frozen inputs (a changed one is refused, naming both values)."""
    with logged_failures("regeneration plan") as logger:
        tokenizer = load_tokenizer(settings.model)
        plan = plan_regeneration(settings, tokenizer)
        RegeneratedOutput(settings.out).open_or_create(
            plan.frozen, len(plan.chunks), plan.conversations
        )
        logger.info(
            "regenerate %s -> %s: %d conversations in %d chunks (turns %s, max_tokens %d)",
            settings.dataset,
            settings.out,
            plan.conversations,
            len(plan.chunks),
            settings.generation.turns,
            settings.generation.max_tokens,
        )
        return tokenizer, plan


@task(
    name="regenerate-chunk",
    task_run_name="regenerate-chunk-{index:06d}",
    cache_policy=NO_CACHE,  # resume comes from the output's commit records
    persist_result=False,
    retries=2,
    retry_delay_seconds=[2.0, 4.0],
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_fatal,
)
def regenerate_chunk_task(run: RegenerationRun, index: int) -> dict[str, Any]:
    """One chunk of conversations, generated turn by turn and committed."""
    with logged_failures(f"regeneration chunk {index}") as logger:
        commit = run.regenerate(
            index,
            str(flow_run.get_id() or "no-flow-run"),
            int(task_run.get_run_count() or 1),
            int(flow_run.get_run_count() or 1),
        )
        if commit is None:
            return {"index": index, "skipped": True, "generated_tokens": 0, "seconds": 0.0}
        logger.info(
            "chunk %06d committed: %d of %d conversations, %d tokens generated in %.2f s "
            "(%.0f tokens/s), finish reasons %s, %d failed, %d dropped",
            index,
            commit.rows,
            commit.conversations,
            commit.generated_tokens,
            commit.seconds,
            commit.generated_tokens / max(commit.seconds, 1e-9),
            commit.finish_reasons,
            len(commit.failed),
            len(commit.dropped),
        )
        for failure in commit.failed[:5]:
            logger.warning(
                "chunk %06d: sample %s failed: %s", index, failure["id"], failure["error"]
            )
        return {
            "index": index,
            "skipped": False,
            "rows": commit.rows,
            "generated_tokens": commit.generated_tokens,
            "seconds": commit.seconds,
            "failed": len(commit.failed),
            "dropped": len(commit.dropped),
            "finish_reasons": commit.finish_reasons,
        }
