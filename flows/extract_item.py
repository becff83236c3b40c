"""One work item of an extraction fanned out over many nodes (flows/fanout.py): its chunks on
this node's `hsx serve` servers, each committed once. No planning (the parent created the store)
and no whole-store verify (the parent verifies what needs it)."""

from __future__ import annotations

import os
import threading
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.context import SettingsContext
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner

from flows.chunk_loop import ChunkLoop, ChunkTally
from flows.reporting import (
    Progress,
    ThroughputPlot,
    hold_further_sigterms,
    run_is_cancelling,
    settings_from_parameters,
    tag_run,
)
from hsx.extraction.host_pipeline import MAX_CHUNKS_IN_FLIGHT
from hsx.extraction.run import ExtractionRun
from hsx.extraction.steps import resolve_settings
from hsx.interrupt import request_stop, stop_requested
from settings import EngineSettings, HsxSettings
from tasks.common import backoff
from tasks.extract import extract_chunk_task


class ItemIncompleteError(RuntimeError):
    """Raised when a work item ends with chunks neither committed by it nor by another attempt."""


@flow(
    name="hsx-extract-item",
    validate_parameters=False,  # partial settings merged over the deployment's (reporting)
    persist_result=False,
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_CHUNKS_IN_FLIGHT + 2),
)
def extract_item_flow(
    settings: HsxSettings | dict[str, Any], chunks: list[int], item: str = "item"
) -> dict[str, Any] | Any:
    """Extract the work chunks ``chunks`` of the store ``settings.store`` (created by the
    parent) on this node: engine.url from the node's environment (HSX_ENGINE__URL)."""
    logger = get_run_logger()
    resolved = resolve_settings(on_this_node(settings_from_parameters(settings)))
    tag_run("hsx", "extract-item", item)
    logger.info(
        "%s: %d work chunks of %s on %s",
        item,
        len(chunks),
        resolved.store,
        ", ".join(resolved.engine.url) or "an engine of this process",
    )
    watch = RunStateWatch(resolved.timeouts.state_watch_s)
    with ExtractionRun.open(resolved) as run:
        store = run.store()
        wanted = set(chunks)
        tokens = sum(c.tokens for c in store.work_chunks if c.index in wanted)
        task = extract_chunk_task.with_options(
            retries=resolved.run.retries,
            retry_delay_seconds=backoff(resolved.run.retry_delay_seconds, resolved.run.retries),
        )
        loop = ChunkLoop(
            run,
            task,
            list(chunks),
            run.concurrency(tokens, len(chunks)),
            Progress(len(chunks), f"{item}: {len(chunks)} work chunks"),
            ThroughputPlot(f"{resolved.store}: {item}"),
        )
        watch.start()
        try:
            loop.run_all()
        except TerminationSignal:
            hold_further_sigterms()
            request_stop("cancelled from Prefect" if run_is_cancelling() else "SIGTERM received")
            loop.abandon_in_flight(resolved.timeouts.stop_wait_s)
        finally:
            watch.stop()
    return _item_end(item, loop.tally, resolved.engine.url)


def on_this_node(settings: HsxSettings) -> HsxSettings:
    """The settings with this node's servers (HSX_ENGINE__URL of the worker that started this
    run), which the parent, running elsewhere, cannot know."""
    node_urls = os.environ.get("HSX_ENGINE__URL", "").strip()
    if not node_urls:
        return settings
    engine = EngineSettings.model_validate(
        {**settings.engine.model_dump(), "url": node_urls, "api_key": settings.engine.api_key}
    )
    return settings.model_copy(update={"engine": engine})


def _item_end(item: str, tally: ChunkTally, servers: list[str]) -> dict[str, Any] | Any:
    """The item's result for the parent; Cancelled when stopped; raises when a chunk failed."""
    # A chunk another attempt had committed before this one started is skipped, not redone.
    skipped = [i for i, r in tally.results.items() if r.get("skipped")]
    committed = [i for i in tally.results if i not in tally.collided and i not in skipped]
    result = {
        "item": item,
        "committed": sorted(committed),
        "committed_before": sorted(skipped),
        "collided": sorted(tally.collided),
        "tokens": tally.extracted_tokens,
        "tokens_per_s": round(tally.extracted_tokens / tally.seconds, 1) if tally.seconds else 0,
        "servers": servers,
    }
    logger = get_run_logger()
    if stop_requested():
        message = (
            f"{item} stopped: {len(committed)} chunks committed by it, {len(skipped)} found "
            f"committed by another attempt, {len(tally.abandoned)} abandoned before their "
            f"commit, {len(tally.not_started)} not started"
        )
        logger.warning("%s", message)
        return Cancelled(message=message)
    if tally.failed or tally.not_started:
        listed = "".join(f"\n  chunk {i}: {tally.errors[i]}" for i in tally.failed[:20])
        raise ItemIncompleteError(
            f"{item}: expected {len(tally.pending)} chunks committed, found {len(tally.failed)} "
            f"failed and {len(tally.not_started)} not started{listed}"
        )
    logger.info("%s done: %s", item, result)
    return result


class RunStateWatch:
    """Reads this flow run's state every ``period_s`` (timeouts.state_watch_s). Once it is no
    longer Running (the parent or an operator cancelled it, or the zombie automation declared it
    Crashed) the run stops, and its chunks abandon before their commit rather than commit work
    the parent is already giving to another node."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        # Read here: the thread has no run context of its own.
        self._logger = get_run_logger()
        self._run_id = flow_run.get_id()
        self._done = threading.Event()
        # The run's Prefect settings (the API it reports to) go with the thread: a thread starts
        # with no context, and its client would start an ephemeral server where the API came
        # from a context (temporary_settings), not the environment. Settings only: the run's
        # own clients stay in its thread.
        self._settings = SettingsContext.get()
        self._thread = threading.Thread(target=self._watch, name="hsx-state-watch", daemon=True)

    def start(self) -> None:
        if self._run_id:
            self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._settings is None:
            self._read_states()
            return
        with SettingsContext(profile=self._settings.profile, settings=self._settings.settings):
            self._read_states()

    def _read_states(self) -> None:
        run_id = UUID(str(self._run_id))
        logger = self._logger
        while not self._done.wait(self._period_s):
            try:
                with get_client(sync_client=True) as client:
                    state = client.read_flow_run(run_id).state
            except Exception as exc:  # the API away for a while: keep working, look again
                logger.warning("could not read this run's state: %r", exc)
                continue
            if state is not None and not state.is_running():
                request_stop(f"this flow run is {state.name} in Prefect")
                logger.warning("flow run is %s: chunks abandon before their commit", state.name)
                return
