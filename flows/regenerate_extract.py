"""The regenerate-then-extract flow: the target model regenerates a dataset's assistant turns,
then the hidden states of the regenerated conversations are extracted, with the model loaded
once.

One engine serves both jobs: `hsx serve` (vLLM's own server with hsx's connector) generates for
the regeneration, which sends no extraction channel, and captures states for the extraction,
which does. Its generation is greedy only (hsx.regeneration.generators says why); a sampled
regeneration runs on a plain engine, then `hsx extract`. With ``engine.url`` set the run uses those servers; without, it starts a server of
its own (flows.own_server) and stops it at its end. Each job is its own subflow run (`hsx runs`
lists both, each with its record), so the UI's Retry of this run resumes both: the regeneration
finds its chunks committed, the extraction its chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.logging import get_run_logger
from prefect.states import State

from flows.extract import extract_flow
from flows.own_server import own_server, serve_settings_for
from flows.regenerate import regenerate_flow
from flows.reporting import settings_from_parameters
from hsx.regeneration.generators import check_capture_engine_sampling, effective_sampling
from settings import HsxSettings
from settings.merge import merge_partial
from settings.regenerate import RegenerateSettings


@flow(
    name="hsx-regenerate-extract",
    validate_parameters=False,  # settings_from_parameters merges a deployment run's partial ones
    persist_result=False,  # the regenerated dataset and the store are the results
)
def regenerate_extract_flow(
    settings: RegenerateSettings, extract: HsxSettings | dict[str, Any]
) -> dict[str, Any] | State:
    """Regenerate ``settings.dataset`` into ``settings.out``, then extract ``settings.out``
    into ``extract.store`` through the same engine. ``extract`` holds the extraction's own
    sections (store, capture, layout, ...); its model, dataset and engine are the
    regeneration's."""
    logger = get_run_logger()
    regeneration = settings_from_parameters(settings, RegenerateSettings)
    sampling = effective_sampling(regeneration.model, regeneration.generation.sampling)
    check_capture_engine_sampling(sampling, "hsx serve, for both jobs")
    extraction = extraction_settings(regeneration, extract)
    if regeneration.engine.url:
        return _both(regeneration, extraction, list(regeneration.engine.url))
    serve = serve_settings_for(extraction, probe=extraction.run.preflight)
    with own_server(serve, _log_dir(), logger.info) as url:
        return _both(regeneration, extraction, [url])


def extraction_settings(
    regeneration: RegenerateSettings, extract: HsxSettings | dict[str, Any]
) -> HsxSettings:
    """The extraction's settings: its own sections (store, capture, layout, ...) over the
    regeneration's model, output (as the dataset) and engine: one engine serves both jobs. From
    a deployment, ``extract`` may name only what it changes."""
    # (python mode: engine.api_key stays a secret, not its masked text)
    shared = {
        "model": regeneration.model,
        "dataset": regeneration.out,
        "engine": regeneration.engine.model_dump(),
    }
    if isinstance(extract, HsxSettings):
        given = extract.model_dump(exclude_unset=True)
        own = {k: v for k, v in given.items() if k not in shared}
        return HsxSettings.model_validate(merge_partial(own, shared))
    clash = sorted(set(shared) & set(extract))
    if clash:
        raise ValueError(
            "extract: expected only the extraction's own sections (store, capture, layout, "
            f"pipeline, ...), found {', '.join(clash)}: the regeneration's model, output and "
            "engine are the extraction's"
        )
    return settings_from_parameters(merge_partial(dict(extract), shared), HsxSettings, "extract")


def _both(
    regeneration: RegenerateSettings, extraction: HsxSettings, urls: list[str]
) -> dict[str, Any] | State:
    """Both jobs through the servers at ``urls``; a stopped or failed job ends the run there."""
    engine = regeneration.engine.model_copy(update={"url": urls})
    regenerated = regenerate_flow(regeneration.model_copy(update={"engine": engine}))
    if isinstance(regenerated, State):  # stopped: Cancelled, the extraction not started
        return regenerated
    extracted = extract_flow(extraction.model_copy(update={"engine": engine}))
    if isinstance(extracted, State):
        return extracted
    return {"engine": ", ".join(urls), "regenerate": regenerated, "extract": extracted}


def _log_dir() -> Path:
    import os

    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    return home / "hsx-servers"
