"""Planning task: validate the dataset, tokenize, cut work chunks, create the store."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from hsx.extraction.steps import check_resume, plan_and_create_store
from settings import HsxSettings
from tasks.common import logged_failures


@task(name="plan", cache_policy=NO_CACHE, retries=0, persist_result=False)
def plan_task(settings: HsxSettings) -> dict[str, Any]:
    with logged_failures("planning") as logger:
        summary = plan_and_create_store(settings)
        logger.info(
            "planned %d samples, %d tokens in %d work chunks; %d pending in %s",
            summary.samples,
            summary.tokens,
            summary.chunks,
            len(summary.pending),
            summary.store_url,
        )
        return asdict(summary)


@task(name="resume-check", cache_policy=NO_CACHE, retries=0, persist_result=False)
def resume_check_task(settings: HsxSettings) -> bool:
    """First of all, in seconds: a run on an existing store must not change what it froze
    (model, weights, layer ids, lengths, dataset, tokenizer, template, dtype)."""
    with logged_failures("resume check") as logger:
        resuming = check_resume(settings)
        if resuming:
            logger.info("store %s exists: every frozen input matches; resuming", settings.store)
        return resuming
