"""The preflight flow alone: check a model folder (its config, tokenizer, weights, vLLM's
signatures and contracts, then the reduced model through the real path) in seconds to a few
minutes, without a dataset or a store; the report is the run's artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from hsx.extraction.steps import resolve_settings
from settings import CaptureSettings, EngineSettings, HsxSettings
from tasks.preflight import model_load_probe_task, signature_validation_task

# What the checks need of a dataset and a store: nothing is read or written (preflight only
# asks the store URL's scheme, and memory:// is always known).
_NO_DATASET = Path("/dev/null")
_NO_STORE = "memory://hsx-preflight-only"


@flow(name="hsx-preflight", persist_result=False)
def preflight_flow(
    model: Path,
    capture: CaptureSettings | None = None,
    engine: EngineSettings | None = None,
    probe: bool = True,
) -> dict[str, Any]:
    """Check ``model`` for an extraction with ``capture`` and ``engine``; ``probe`` also runs
    the reduced model through the exact engine path (a minute or so)."""
    settings = resolve_settings(
        HsxSettings(
            model=model,
            dataset=_NO_DATASET,
            store=_NO_STORE,
            capture=capture or CaptureSettings(),
            engine=engine or EngineSettings(),
        )
    )
    report = signature_validation_task(settings)
    if probe:
        report["probe"] = model_load_probe_task(settings)
    return report
