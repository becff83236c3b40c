"""Planning task: validate the dataset, tokenize, cut work chunks, create the store."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from hsx.pipeline import plan_and_create_store
from settings import HsxSettings
from tasks.common import logged_failures


@task(name="plan", cache_policy=NO_CACHE, retries=0)
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
