"""The audit's tasks: its plan (every check before a state is read), one work chunk (retried
alone), the data's shape, and the end-of-run audit of an extraction."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from hsx.audit import ChunkAudit, StoreAudit, audit_store, brief, markdown
from hsx.audit.data_shape import DataShape
from hsx.audit.scope import NothingToAuditError
from hsx.errors import AuditFailedError, ConfigError
from settings import HsxSettings
from tasks.common import logged_failures, retry_unless_fatal


@task(name="audit-plan", cache_policy=NO_CACHE, persist_result=False)
def plan_audit_task(
    store: str,
    model: str | None,
    positions: int,
    samples: str | None,
    device: str,
    draft_vocab_size: int,
) -> StoreAudit:
    """The store, its commits, the model against the store's config digest, the final norm and
    LM head: refused here, before any state is read."""
    with logged_failures("audit plan") as logger:
        audit = StoreAudit(store, model, positions, samples, device, draft_vocab_size)
        logger.info(
            "audit of %s: %d chunks in range, %d read (%s positions), head %s, greedy data: %s",
            store,
            len(audit.scopes),
            len(audit.audited_chunks),
            positions or "all",
            audit.head.source.tensor if audit.head else "-",
            audit.greedy.reason,
        )
        return audit


@task(
    name="audit-chunk",
    task_run_name="audit-chunk-{chunk:06d}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=[2.0, 4.0],
    retry_condition_fn=retry_unless_fatal,
)
def audit_chunk_task(audit: StoreAudit, chunk: int) -> ChunkAudit:
    with logged_failures(f"audit of chunk {chunk}"):
        return audit.audit_chunk(chunk)


@task(name="audit-data-shape", cache_policy=NO_CACHE, persist_result=False, retries=1)
def data_shape_task(audit: StoreAudit) -> DataShape:
    """Lengths, loss-mask coverage, draft vocabulary: the token arrays of every chunk in range."""
    with logged_failures("audit data shape"):
        return audit.data_shape()


@task(name="end-of-run-audit", cache_policy=NO_CACHE, persist_result=False, retries=0)
def run_audit_task(settings: HsxSettings) -> dict[str, Any]:
    """A sample of the extraction just done (run.audit_positions rows): states that do not
    line up with their tokens fail the run, naming what is wrong; everything else it finds is
    recorded with the run."""
    with logged_failures("end-of-run audit") as logger:
        scored = settings.engine.load_format != "dummy"  # dummy weights: nothing to score with
        positions = settings.run.audit_positions
        try:
            report = audit_store(settings.store, settings.model, positions, score=scored)
        except NothingToAuditError as exc:  # every sample skipped (capture.on_bad_states=skip)
            logger.warning("audit: %s", exc)
            return {"audit": f"nothing to audit: {exc}", "audit_rows": 0, "audit_errors": 0}
        except ConfigError as exc:  # no head to read (a quantized one...): the layers still
            logger.warning("audit: next-token agreement not measured: %r", exc, exc_info=True)
            report = audit_store(settings.store, settings.model, positions, score=False)
        line = brief(report)
        create_markdown_artifact(markdown(report), key="hsx-audit", description=line)
        (logger.info if report.ok else logger.warning)("audit: %s", line)
        for finding in report.errors[:20]:
            logger.warning("audit: %s", finding.message)
        failures = report.alignment_failures
        if failures:
            listed = "".join(f"\n  {f.message}" for f in failures[:20])
            raise AuditFailedError(
                f"end-of-run audit of {settings.store}: expected states aligned with their "
                f"tokens, found {len(failures)} problems (`hsx audit {settings.store}` "
                f"audits every row):{listed}"
            )
        return {
            "audit": line,
            "audit_rows": report.rows_read,
            "audit_errors": len(report.errors),
            "audit_seconds": report.seconds,
        }
