"""An extraction fanned out over many nodes through Prefect's own work pools.

The parent (this flow, on a CPU pool) checks the resume, plans and creates the store once, cuts
the plan into work items of a few minutes of one node's work, and starts one child run of the
`extract-item` deployment per item (flows/extract_item.py) on the GPU pool, whose workers run
beside each node's `hsx serve`. It watches them with one filtered read per poll, resubmits the
uncommitted chunks of an item that ended Failed or Crashed (a dead node) a bounded number of
times, and verifies the chunks that more than one attempt touched before it reports the run done.
A Retry of the parent re-attaches to the children it made (their idempotency keys)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelling

from flows.reporting import current_attempt, run_summary, settings_from_parameters, tag_run
from hsx.extraction.steps import resolve_settings
from hsx.plan.work_items import (
    WorkItem,
    cut_work_items,
    item_tokens,
    measured_rate,
    pending_items,
)
from hsx.store.zarr_store import ExtractionStore
from settings import FanoutSettings, HsxSettings
from tasks.plan import plan_task, resume_check_task
from tasks.verify import verify_task

# Prefect's API answers at most this many runs per read.
READ_LIMIT = 200
# How long the parent waits out an unanswering API (a server restart) before it fails.
API_OUTAGE_S = 600.0


class FanoutIncompleteError(RuntimeError):
    """Raised when items gave up after their resubmits or the touched chunks do not verify."""


@dataclass
class _Submitted:
    """One item's current child run and how many runs it has had."""

    item: WorkItem
    run_id: UUID
    tries: int
    history: list[tuple[str, str]] = field(default_factory=list)  # (run id, final state)


@flow(name="hsx-extract-fanout", validate_parameters=False, persist_result=False)
def extract_fanout_flow(
    settings: HsxSettings | dict[str, Any], fanout: FanoutSettings | dict[str, Any] | None = None
) -> dict[str, Any]:
    """Extract ``settings.dataset`` into ``settings.store`` with one child run per work item on
    the GPU nodes' pool (``fanout``: item size, resubmits, polling)."""
    attempt = current_attempt("hsx-extract-fanout")
    resolved = resolve_settings(settings_from_parameters(settings))
    plan_of_run = settings_from_parameters(fanout or {}, FanoutSettings, key="fanout")
    tag_run("hsx", "extract-fanout", f"store:{resolved.store.rsplit('/', 1)[-1]}")
    resume_check_task(resolved)
    plan = plan_task(resolved)
    store = ExtractionStore.open(resolved.store)
    items = _cut(store, plan_of_run)
    watcher = _Children(resolved, plan_of_run, str(attempt.run_id), attempt.attempt)
    try:
        watcher.run(pending_items(items, store.committed_chunks()), store)
    except TerminationSignal:  # the parent cancelled or stopped: so are the runs it started
        watcher.cancel_open()
        raise
    summary = _finish(resolved, store, plan, watcher)
    run_summary(attempt, resolved, "completed" if summary["verified"] else "failed", dict(summary))
    create_markdown_artifact(
        "# hsx extraction over many nodes\n\n"
        + "\n".join(f"- **{key}**: {value}" for key, value in summary.items()),
        key="hsx-fanout-summary",
    )
    if summary["items_given_up"] or not summary["verified"]:
        raise FanoutIncompleteError(
            f"expected every chunk committed once and verified, found items given up "
            f"{summary['items_given_up']} and verification {summary['verification']}; a Retry "
            "of this run re-attaches to its children and resubmits what is missing"
        )
    return summary


def _cut(store: ExtractionStore, fanout: FanoutSettings) -> list[WorkItem]:
    """Items of ``fanout.item_minutes`` at the rate measured by chunks committed before this
    run started (the same on every attempt of this run, so its items and keys are too)."""
    created = _run_created()
    before = [
        (record.tokens, record.seconds)
        for record in store.committed_chunks().values()
        if created is None or datetime.fromisoformat(record.finished_at) < created
    ]
    rate = measured_rate(before) or fanout.node_tokens_per_s
    total = sum(chunk.tokens for chunk in store.work_chunks)
    size = item_tokens(fanout.item_minutes, rate, total, fanout.min_items)
    items = cut_work_items(store.work_chunks, size)
    get_run_logger().info(
        "%d work items of about %.3g min at %.0f tokens/s per node (%s)",
        len(items),
        fanout.item_minutes,
        rate,
        "measured" if before else "fanout.node_tokens_per_s",
    )
    return items


def _run_created() -> datetime | None:
    """When this flow run was created: the same on each of its attempts."""
    run_id = flow_run.get_id()
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(run_id)).created


class _Children:
    """The child runs of this parent: submitted, watched, resubmitted."""

    def __init__(
        self, settings: HsxSettings, fanout: FanoutSettings, parent_id: str, attempt: int
    ) -> None:
        self.settings = settings
        self.fanout = fanout
        self.parent_id = parent_id
        # Tries per item over this run's attempts: a Retry of the parent may try again.
        self.max_tries = (fanout.max_resubmits + 1) * attempt
        self.open: dict[UUID, _Submitted] = {}
        self.done: list[_Submitted] = []
        self.given_up: list[_Submitted] = []
        self.api_reads = 0
        self._away_since: float | None = None  # the API unanswered since (monotonic)

    def run(self, items: list[WorkItem], store: ExtractionStore) -> None:
        for item in items:
            self._submit(item, 1, [])
        logger = get_run_logger()
        while self.open:
            time.sleep(self.fanout.poll_s)
            for child in self._poll():
                if child.state is None or not child.state.is_final():
                    continue
                entry = self.open.pop(child.id)
                entry.history.append((str(child.id), str(child.state.name)))
                if child.state.is_completed():
                    self.done.append(entry)
                    continue
                left = [i for i in entry.item.chunks if store.read_commit(i) is None]
                logger.warning(
                    "%s run %s ended %s (%s); %d of its chunks uncommitted",
                    entry.item.name,
                    child.id,
                    child.state.name,
                    (child.state.message or "")[:300],
                    len(left),
                )
                self._resubmit(entry, left)

    def _poll(self) -> list[FlowRun]:
        """The children's states; none while the API is away (a server restart, a network
        cut): the children run on, and their states are read once it answers again."""
        try:
            runs = self._read_states()
        except Exception as exc:
            now = time.monotonic()
            self._away_since = self._away_since or now
            if now - self._away_since > API_OUTAGE_S:
                raise
            get_run_logger().warning("could not read the items' states; again later: %r", exc)
            return []
        self._away_since = None
        return runs

    def _resubmit(self, entry: _Submitted, left: list[int]) -> None:
        if not left:  # every chunk committed (by it before it died, or by another)
            self.done.append(entry)
        elif entry.tries >= self.max_tries:
            get_run_logger().error("%s: giving up after %d runs", entry.item.name, entry.tries)
            self.given_up.append(entry)
        else:
            item = WorkItem(entry.item.index, tuple(left), entry.item.tokens)
            self._submit(item, entry.tries + 1, entry.history)

    def _submit(self, item: WorkItem, tries: int, history: list[tuple[str, str]]) -> None:
        # The key names the parent run, the item's chunks and the try: a Retry of the parent
        # gets back the same child run instead of a second one racing it.
        key = f"{self.parent_id}:{item.chunks[0]}-{item.chunks[-1]}:{len(item.chunks)}:{tries}"
        child: FlowRun = run_deployment(  # type: ignore[assignment]
            self.fanout.item_deployment,
            parameters={
                "settings": self.settings.model_dump(mode="json"),
                "chunks": list(item.chunks),
                "item": item.name,
            },
            flow_run_name=f"{item.name}-try{tries}",
            timeout=0,  # started, not awaited: the parent polls every child at once
            as_subflow=True,
            idempotency_key=key,
            tags=["hsx", "extract-item"],
        )
        self.open[child.id] = _Submitted(item, child.id, tries, list(history))

    def cancel_open(self) -> None:
        """Cancel the child runs still open (their chunks abandon before their commit)."""
        with get_client(sync_client=True) as client:
            for run_id in self.open:
                try:
                    client.set_flow_run_state(run_id, Cancelling(message="parent stopped"))
                except Exception as exc:  # one unreachable: cancel the others all the same
                    get_run_logger().warning("could not cancel %s: %r", run_id, exc)

    def _read_states(self) -> list[FlowRun]:
        ids = list(self.open)
        runs: list[FlowRun] = []
        with get_client(sync_client=True) as client:
            for start in range(0, len(ids), READ_LIMIT):
                runs += client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        id=FlowRunFilterId(any_=ids[start : start + READ_LIMIT])
                    ),
                    limit=READ_LIMIT,
                )
                self.api_reads += 1
        return runs


def _finish(
    settings: HsxSettings, store: ExtractionStore, plan: dict[str, Any], children: _Children
) -> dict[str, Any]:
    """Every chunk committed, and the chunks more than one attempt touched (resubmitted items,
    collisions) verified: the others were hashed as they were written and committed once, and a
    whole-store verify of terabytes is the nightly `verify` deployment's job."""
    touched = {i for e in children.done if e.tries > 1 for i in e.item.chunks}
    touched |= {int(c["chunk_index"]) for c in store.collisions()}
    committed = store.committed_chunks()
    missing = [c.index for c in store.work_chunks if c.index not in committed]
    verification: dict[str, Any] = {"ok": True, "summary": "no chunk touched twice"}
    if touched:
        verification = verify_task(
            settings.store, readers=settings.timeouts.verify_readers, only=sorted(touched)
        )
    return {
        "store": settings.store,
        "chunks": plan["chunks"],
        "chunks_committed": len(committed),
        "chunks_missing": missing[:50],
        "items": len(children.done) + len(children.given_up),
        "items_resubmitted": sum(1 for e in children.done + children.given_up if e.tries > 1),
        "items_given_up": [e.item.name for e in children.given_up],
        "chunks_touched_twice": sorted(touched),
        "collisions": len(store.collisions()),
        "state_reads": children.api_reads,
        "verification": verification["summary"],
        "verified": bool(verification["ok"]) and not missing,
    }
