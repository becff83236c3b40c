"""One extraction run as an object built once where the run starts (the flow, the CLI's probe,
a bench, a test) and passed to every chunk: the settings with the model's defaults filled in,
the model's spec (config.json read once), the host pipeline and the engine's home.

A chunk task gets this object and an index; it never re-reads config.json, never rebuilds
the settings and never chooses where the engine lives.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from hsx.engine.homes import make_engine_home
from hsx.engine.interface import EngineHome
from hsx.engine.options import resolve_dtype
from hsx.errors import ConfigError
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline, chunks_in_flight
from hsx.model.config import read_config
from hsx.model.limits import resolve_lengths
from hsx.plan.building import logical_dtype, resolve_layer_ids
from hsx.store.zarr_store import CommitRecord, ExtractionStore
from settings import HsxSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """What is derived from the settings and the model folder, before anything is loaded."""

    config: dict[str, Any]
    layer_ids: tuple[int, ...]
    engine_dtype: str
    stored_dtype: str
    settings: HsxSettings  # with the model-derived defaults filled in (hsx.model.limits)


def run_spec(settings: HsxSettings) -> RunSpec:
    """Read config.json once and derive the run's spec; a length or layer id the model cannot
    take fails here, in seconds."""
    config = read_config(settings.model)
    resolved = resolve_lengths(settings, config)
    layer_ids = resolve_layer_ids(settings, config)
    engine_dtype = resolve_dtype(settings.engine, config)
    return RunSpec(config, layer_ids, engine_dtype, logical_dtype(settings, engine_dtype), resolved)


class ExtractionRun:
    """A run's extraction of work chunks (see the module's docstring). Close it when the run
    ends: its pools end; the engine stays cached for the process (a long-lived worker)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.settings = spec.settings
        self.engines: EngineHome = make_engine_home(
            self.settings, spec.config, spec.layer_ids, spec.engine_dtype
        )
        self.host = HostPipeline(self.settings.pipeline, self.engines.queue_limit)
        self._store: ExtractionStore | None = None
        self._store_lock = threading.Lock()

    @classmethod
    def open(cls, settings: HsxSettings) -> ExtractionRun:
        return cls(run_spec(settings))

    def concurrency(self, tokens: int, chunks: int) -> int:
        """Work chunks to extract at once for a plan of ``tokens`` in ``chunks``."""
        return chunks_in_flight(
            self.settings.pipeline, self.host.engine_queue.limit, tokens / max(chunks, 1)
        )

    def store(self) -> ExtractionStore:
        """The store, opened once for the run (opening one through zarr costs ~5 ms of CPU per
        chunk, paid out of the engine's cores): chunk threads share it; its layout is read-only
        and each chunk writes its own objects."""
        with self._store_lock:
            if self._store is None:
                self._store = ExtractionStore.open(
                    self.settings.store, mode="r+", direct_io=self.settings.layout.direct_io
                )
            return self._store

    def extract(self, chunk_index: int, context: RunContext) -> CommitRecord | None:
        """Extract one work chunk unless it is already committed (then returns None)."""
        store = self.store()
        chunk = next((c for c in store.work_chunks if c.index == chunk_index), None)
        if chunk is None:
            raise ConfigError(
                f"work chunk {chunk_index}: expected 0..{len(store.work_chunks) - 1}, found "
                f"none in {self.settings.store}"
            )
        if store.read_commit(chunk_index) is not None:
            logger.info("%s already committed; skipping", chunk.name)
            return None
        with self.engines.borrow() as engine:
            extra = {**(context.extra or {}), **self.engines.record_of(engine)}
            return extract_chunk(
                self.host,
                store,
                chunk,
                engine,
                self.settings.engine.batch_tokens,
                replace(context, extra=extra),
                bad_states=self.settings.capture.on_bad_states,
            )

    def close(self) -> None:
        self.host.close()
        self.engines.close()

    def __enter__(self) -> ExtractionRun:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def extract_work_chunk(
    settings: HsxSettings, chunk_index: int, context: RunContext
) -> CommitRecord | None:
    """One chunk in a run of its own: for scripts and tests (a flow builds one run for all)."""
    with ExtractionRun.open(settings) as run:
        return run.extract(chunk_index, context)
