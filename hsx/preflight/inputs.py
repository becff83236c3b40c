"""The model-folder checks an extraction can run before Prefect or the engine start, in about a
second and without importing vLLM: the tokenizer loads and has a chat template, and the weights
the engine will load are there with readable, complete safetensors headers.

Today these run as the flow's first task ("signature validation"), after the CLI has started a
Prefect server (~35 s on 2 cores); ``hsx.pipeline.validate_inputs`` can call
``check_model_inputs`` to fail in seconds instead. Resolving the architecture through vLLM's
registry stays in the flow's preflight: importing vLLM alone takes seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx.errors import ConfigError
from hsx.preflight.contract import check_tokenizer
from hsx.preflight.report import Status
from hsx.preflight.weights import check_weights
from settings import EngineSettings


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
