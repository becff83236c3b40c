"""One work chunk per task run: retried alone, its traceback in the logs, committed last."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import ExtractionRun
from hsx.plan.building import code_version
from tasks.common import logged_failures, retry_unless_fatal


@task(
    name="extract-chunk",
    task_run_name="extract-chunk-{chunk_index:06d}",
    persist_result=False,  # the store's commit records are the results
    cache_policy=NO_CACHE,  # resume comes from the store's commit records, not Prefect's cache
    retries=2,
    retry_delay_seconds=[2.0, 4.0],
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_fatal,
)
def extract_chunk_task(run: ExtractionRun, chunk_index: int) -> dict[str, Any]:
    """One work chunk of ``run`` (built once by the flow: no config.json read here)."""
    with logged_failures(f"work chunk {chunk_index}") as logger:
        context = RunContext(
            run_id=str(flow_run.get_id() or "no-flow-run"),
            attempt=int(task_run.get_run_count() or 1),
            code_version=code_version(),
            extra={
                "task_run_id": str(task_run.get_id()),
                "flow_run_name": str(flow_run.get_name()),
                "flow_run_attempt": int(flow_run.get_run_count() or 1),
            },
        )
        record = run.extract(chunk_index, context)
        if record is None:
            return {"chunk_index": chunk_index, "skipped": True, "tokens": 0, "seconds": 0.0}
        server = (record.extra or {}).get("engine_server")
        collision = (record.extra or {}).get("collision")
        logger.info(
            "chunk %06d %s: samples %d..%d, %d tokens in %.2f s (%.0f tokens/s), attempt %d%s",
            chunk_index,
            "computed, but another attempt had committed it" if collision else "committed",
            record.sample_start,
            record.sample_end - 1,
            record.tokens,
            record.seconds,
            record.tokens / max(record.seconds, 1e-9),
            record.attempt,
            f", on server {server['url']} (instance {server['instance']})" if server else "",
        )
        return {
            "chunk_index": chunk_index,
            "skipped": False,
            "tokens": record.tokens,
            "rows": record.row_end - record.row_start,
            "seconds": record.seconds,
            "attempt": record.attempt,
            # The digest of the chunk's first hidden-state object: the UI's chunk table.
            "checksum": (record.checksums.get("hidden_states") or ["-"])[0],
            "samples_skipped": len(record.skipped_samples),
            "server": server["url"] if server else "-",
            "collision": bool(collision),
        }
