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
from hsx.extract import RunContext, engine_queue_limit, extract_chunk
from hsx.frozen import weights_fingerprint
from hsx.plan import WorkChunk, text_config
from hsx.planning import config_hash
from hsx.preflight.report import CheckResult, Status
from hsx.store import CommitRecord, ExtractionStore
from settings import HsxSettings

if TYPE_CHECKING:
    from hsx.engine.server_pool import ServerPool
    from hsx.pipeline import RunSpec

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


def check_servers(settings: HsxSettings, spec: RunSpec) -> CheckResult:
    """Preflight against ``engine.url``: every server that answers within
    ``engine.server_wait_s`` must serve what the run froze, and states of one short prompt must
    come back through this node's shared memory. FAIL on any mismatch, or when none answers."""
    pool = server_pool(settings, spec)
    report = pool.check(settings.engine.server_wait_s)
    details = tuple(
        f"{url}: instance {info.get('instance')}, {info.get('model_dir')}, layer ids "
        f"{info.get('layer_ids')}, {info.get('engine_dtype')}, TP "
        f"{info.get('tensor_parallel_size')}, vLLM {info.get('vllm_version')}, loaded in "
        f"{info.get('load_seconds', '?')} s"
        for url, info in report.ready.items()
    )
    details += tuple(f"{url}: {error}" for url, error in report.unreachable.items())
    if report.mismatched:
        problems = [
            f"{url}: {problem}" for url, found in report.mismatched.items() for problem in found
        ]
        return CheckResult(
            "servers",
            Status.FAIL,
            f"expected every server to serve what the run froze, found {len(problems)} "
            f"difference(s): {problems[0]}",
            tuple(problems[1:]) + details,
        )
    if not report.ready:
        return CheckResult(
            "servers",
            Status.FAIL,
            f"engine.url: expected at least one of {len(settings.engine.url)} servers to "
            f"answer within {settings.engine.server_wait_s:g} s (engine.server_wait_s), found "
            "none: start them with `hsx serve MODEL_DIR` (the run's engine and capture settings)",
            details,
        )
    if report.unreachable:
        return CheckResult(
            "servers",
            Status.WARN,
            f"{len(report.ready)} of {len(settings.engine.url)} servers ready; the others get "
            "chunks once they answer",
            details,
        )
    return CheckResult(
        "servers",
        Status.PASS,
        f"{len(report.ready)} server(s) serve this run's model, layer ids and dtype; states "
        "came back through shared memory",
        details,
    )
