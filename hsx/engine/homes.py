"""The homes of a run's engine, behind one factory: ``make_engine_home`` picks the home once,
from the settings (``engine.url`` set: `hsx serve` servers; else an engine of this process,
in-process or in a child process by ``engine.in_process``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.engine.interface import EngineHome, HiddenStateEngine
from hsx.engine.options import result_ring_bytes
from hsx.engine.server_protocol import shm_folder
from hsx.errors import ConfigError, EngineError
from hsx.model.config import text_config
from hsx.plan.building import config_hash
from hsx.plan.frozen_inputs import weights_fingerprint
from settings import EngineSettings, HsxSettings

logger = logging.getLogger(__name__)


class LocalEngineHome(EngineHome):
    """vLLM's engine built in this process (its core in-process or in a child process), once
    per process and kept across chunks and runs (hsx.engine.vllm_engine's cache)."""

    def __init__(
        self, model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int], queue_limit: int
    ) -> None:
        self.kind = "in-process" if engine.in_process else "child process"
        self.queue_limit = queue_limit
        self._model_dir = model_dir
        self._engine = engine
        self._layer_ids = tuple(layer_ids)

    @contextmanager
    def borrow(self) -> Iterator[HiddenStateEngine]:
        from hsx.engine.vllm_engine import drop_engine, get_engine  # imports vLLM: only here

        engine = get_engine(self._model_dir, self._engine, self._layer_ids)
        try:
            yield engine
        except EngineError:
            # A dead engine is rebuilt by the retry; a live one is kept for the next chunk.
            drop_engine(self._model_dir, self._engine, self._layer_ids)
            raise

    def record_of(self, engine: HiddenStateEngine) -> dict[str, Any]:
        return {}  # the run record names the model and settings; one engine per process

    def close(self) -> None:
        pass  # the engine stays loaded for the process's next run (vllm_engine's cache)


class ServedEngineHome(EngineHome):
    """Running `hsx serve` servers (``engine.url``): a chunk goes whole to the least loaded live
    server; states come back through this node's shared memory."""

    kind = "server"

    def __init__(self, settings: HsxSettings, expected: dict[str, Any], hidden_size: int) -> None:
        from hsx.engine.server_pool import get_server_pool

        engine = settings.engine
        self.pool = get_server_pool(
            engine.url,
            expected,
            hidden_size,
            result_ring_bytes(engine, shm_folder()),
            engine.server_wait_s,
            engine.api_key.get_secret_value() if engine.api_key else None,
            settings.timeouts,
        )
        one = engine_queue_tokens(settings)
        self.queue_limit = one * max(1, len(engine.url))  # one engine's worth per server

    @contextmanager
    def borrow(self) -> Iterator[HiddenStateEngine]:
        server = self.pool.acquire()
        logger.info("chunk goes to server %s (instance %s)", server.url, server.instance)
        try:
            yield server
        except EngineError:
            if not server.alive:
                self.pool.drop(server)  # the retry goes to a server that answers
            raise
        finally:
            self.pool.release(server)

    def record_of(self, engine: HiddenStateEngine) -> dict[str, Any]:
        return {"engine_server": engine.describe()}

    def close(self) -> None:
        pass  # channels stay open for the process's next run (server_pool's cache)


def engine_queue_limit(
    batch_tokens: int, max_num_batched_tokens: int | None, prefetch_batches: int = 2
) -> int:
    """Tokens a run keeps queued at one engine: what two chunks with ``prefetch_batches`` each
    queued before, and at least four engine steps."""
    return max(2 * (prefetch_batches + 1) * batch_tokens, 4 * (max_num_batched_tokens or 16384))


def engine_queue_tokens(settings: HsxSettings) -> int:
    engine = settings.engine
    return engine_queue_limit(
        engine.batch_tokens, engine.max_num_batched_tokens, settings.pipeline.prefetch_batches
    )


def server_expectation(
    settings: HsxSettings, config: dict[str, Any], layer_ids: Sequence[int], engine_dtype: str
) -> dict[str, Any]:
    """What a server must serve for this run: compared with its /hsx/info before any work."""
    max_length = settings.data.max_length
    if max_length is None:  # resolve_lengths fills it in; a bare setting is a caller's bug
        raise ConfigError("data.max_length: expected it resolved from the model, found None")
    return {
        "model_config_hash": config_hash(config),
        "weights_fingerprint": weights_fingerprint(
            settings.model, settings.engine.load_format, settings.engine.seed
        ),
        "layer_ids": list(layer_ids),
        "engine_dtype": engine_dtype,
        "max_model_len": max_length + 1,  # vLLM samples one token after each prompt
    }


def make_engine_home(
    settings: HsxSettings, config: dict[str, Any], layer_ids: Sequence[int], engine_dtype: str
) -> EngineHome:
    """The run's engine home, chosen once from the settings."""
    if settings.engine.url:
        expected = server_expectation(settings, config, layer_ids, engine_dtype)
        return ServedEngineHome(settings, expected, int(text_config(config)["hidden_size"]))
    return LocalEngineHome(
        settings.model, settings.engine, layer_ids, engine_queue_tokens(settings)
    )
