"""The model-folder checks an extraction can run before Prefect or the engine start, in about a
second and without importing vLLM: the tokenizer loads and has a chat template, and the weights
the engine will load are there with readable, complete safetensors headers.

The CLI calls ``validate_inputs`` before it starts Prefect (~35 s on 2 cores for a server), so
these fail in seconds; the flow's preflight runs them again as its first task. Resolving the architecture through vLLM's
registry stays in the flow's preflight: importing vLLM alone takes seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx.data.tokenization import validate_dataset
from hsx.errors import ConfigError
from hsx.extraction.steps import check_resume, run_spec
from hsx.preflight.contract import check_tokenizer
from hsx.preflight.report import Status
from hsx.preflight.weights import check_weights
from hsx.store.zarr_store import check_store_url
from settings import EngineSettings, HsxSettings


def check_model_inputs(model_dir: Path, config: dict[str, Any], engine: EngineSettings) -> None:
    """Raise ConfigError naming the first problem of the tokenizer or the weights (what was
    expected and what was found); return quietly when both would pass preflight."""
    for result in (
        check_tokenizer(model_dir),
        check_weights(model_dir, config, required=engine.load_format != "dummy"),
    ):
        if result.status == Status.FAIL:
            details = f" ({'; '.join(result.details[:3])})" if result.details else ""
            raise ConfigError(f"{result.check}: {result.summary}{details}")


def validate_inputs(settings: HsxSettings) -> int:
    """Everything about the inputs that can be checked in seconds, before any model load:
    the model folder, the store URL, every line of the dataset, and on resume the inputs the
    store froze. Returns the sample count."""
    spec = run_spec(settings)  # model folder, config.json, layer ids in range
    # Tokenizer, chat template and weight files: a second, no vLLM import.
    check_model_inputs(settings.model, spec.config, settings.engine)
    check_store_url(settings.store)
    data = settings.data
    samples = validate_dataset(
        settings.dataset, data.max_line_bytes, data.format, data.split, data.columns
    )
    check_resume(settings)
    return samples
