"""Extraction on running `hsx serve` servers (``engine.url``): what a run expects of them, the
preflight check against them, and one work chunk on one of them.

The run's identity (what the store's plan froze: model config, weights, layer ids, dtype,
lengths) is compared with each server's ``/hsx/info`` before any work; a chunk goes whole to the
least loaded live server and is written, checksummed and committed here as with an engine of
this process.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hsx.engine.options import result_ring_bytes
from hsx.engine.server_protocol import shm_folder
from hsx.errors import ConfigError, EngineError
from hsx.extraction.chunk_extraction import RunContext, engine_queue_limit, extract_chunk
from hsx.model.config import text_config
from hsx.plan.building import config_hash
from hsx.plan.chunks import WorkChunk
from hsx.plan.frozen_inputs import weights_fingerprint
from hsx.store.zarr_store import CommitRecord, ExtractionStore
from settings import HsxSettings

if TYPE_CHECKING:
    from hsx.engine.server_pool import ServerPool
    from hsx.extraction.steps import RunSpec

logger = logging.getLogger(__name__)


def server_expectation(settings: HsxSettings, spec: RunSpec) -> dict[str, Any]:
    """What a server must serve for this run: compared with its /hsx/info before any work."""
    max_length = settings.data.max_length
    if max_length is None:  # resolve_lengths fills it in; a bare setting is a caller's bug
        raise ConfigError("data.max_length: expected it resolved from the model, found None")
    return {
        "model_config_hash": config_hash(spec.config),
        "weights_fingerprint": weights_fingerprint(
            settings.model, settings.engine.load_format, settings.engine.seed
        ),
        "layer_ids": list(spec.layer_ids),
        "engine_dtype": spec.engine_dtype,
        "max_model_len": max_length + 1,  # vLLM samples one token after each prompt
    }


def server_pool(settings: HsxSettings, spec: RunSpec) -> ServerPool:
    """This process's pool of ``engine.url``'s servers for this run's identity."""
    from hsx.engine.server_pool import get_server_pool

    return get_server_pool(
        settings.engine.url,
        server_expectation(settings, spec),
        int(text_config(spec.config)["hidden_size"]),
        result_ring_bytes(settings.engine, shm_folder()),
        settings.engine.server_wait_s,
        settings.engine.api_key.get_secret_value() if settings.engine.api_key else None,
    )


def served_queue_limit(settings: HsxSettings) -> int:
    """Tokens this process keeps queued across its servers: one engine's worth per server."""
    one = engine_queue_limit(settings.engine.batch_tokens, settings.engine.max_num_batched_tokens)
    return one * max(1, len(settings.engine.url))


def extract_on_a_server(
    settings: HsxSettings,
    spec: RunSpec,
    store: ExtractionStore,
    chunk: WorkChunk,
    context: RunContext,
) -> CommitRecord:
    """One chunk, whole, on the least loaded live server of ``engine.url``; the commit record
    names the server (URL, instance, host) that computed it."""
    pool = server_pool(settings, spec)
    server = pool.acquire()
    logger.info("%s goes to server %s (instance %s)", chunk.name, server.url, server.instance)
    served = replace(context, extra={**(context.extra or {}), "engine_server": server.describe()})
    try:
        return extract_chunk(
            store,
            chunk,
            server,
            settings.engine.batch_tokens,
            served,
            queue_limit=served_queue_limit(settings),
            bad_states=settings.capture.on_bad_states,
        )
    except EngineError:
        if not server.alive:
            pool.drop(server)  # the retry goes to a server that answers
        raise
    finally:
        pool.release(server)
