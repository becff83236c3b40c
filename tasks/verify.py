"""Checksum verification of every committed chunk, with a Prefect artifact of the result."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from hsx.extraction.steps import verify
from tasks.common import logged_failures


@task(
    name="verify-checksums",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_delay_seconds=2.0,
)
def verify_task(
    store_url: str,
    repair: bool = False,
    readers: int | None = None,
    only: list[int] | None = None,
) -> dict[str, Any]:
    """``repair``: drop the commit records of corrupt chunks (the flow re-extracts them);
    ``readers``: threads reading and hashing (timeouts.verify_readers; None = the CPU count);
    ``only``: these chunks alone (a many-node parent's re-check of chunks two attempts did)."""
    with logged_failures("verification") as logger:
        report, dropped = verify(
            store_url, repair=repair, readers=readers, only=None if only is None else set(only)
        )
        lines = [f"# Verification of `{report.url}`", "", f"**{report.summary()}**", ""]
        if report.missing:
            lines.append(f"Missing (uncommitted) chunks: {report.missing[:50]}")
        for problem in report.problems[:50]:
            lines.append(f"- chunk {problem.chunk_index}: {problem.message}")
        for message in report.index_problems:
            lines.append(f"- sample index: {message}")
        for message in report.metadata_problems:
            lines.append(f"- metadata: {message}")
        if report.metadata_repaired:
            lines.append(f"Repair: rewrote {report.metadata_repaired} from the layout copy")
        if dropped:
            lines.append(f"Repair: commit records dropped for chunks {sorted(dropped)[:50]}")
            logger.warning("repair: dropped the commits of corrupt chunks %s", sorted(dropped))
        create_markdown_artifact("\n".join(lines), key="hsx-verify", description=report.summary())
        (logger.info if report.ok else logger.error)(
            "verification %s (%.1f MB read)", report.summary(), report.bytes_read / 1e6
        )
        return {
            "ok": report.ok,
            "summary": report.summary(),
            "verified": report.chunks_verified,
            "planned": report.chunks_planned,
            "missing": report.missing,
            "problems": [p.message for p in report.problems]
            + report.index_problems
            + report.metadata_problems,
            "bytes_read": report.bytes_read,
            "repaired": sorted(dropped),
        }
