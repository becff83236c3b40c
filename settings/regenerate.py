"""Settings of `hsx regenerate`: the target model regenerates a dataset's assistant turns (the
on-policy data an EAGLE-3 draft learns best from) into a dataset that `hsx extract` reads.

The engine, data and run sections are extraction's own (one environment file serves both
commands); ``generation`` is regeneration's: ``HSX_GENERATION__MAX_TOKENS``, ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from settings.models import DatasetLocation, DataSettings, EngineSettings, RunSettings
from settings.strict import StrictSection, refuse_unknown_keys

# Sampling parameters hsx sets per request itself: a per-sample seed (a resumed chunk generates
# the same tokens), one completion, the token budget of generation.max_tokens.
RESERVED_SAMPLING = frozenset({"seed", "n", "max_tokens", "detokenize", "output_kind"})


class GenerationSettings(StrictSection):
    """How each assistant turn is generated."""

    SECTION: ClassVar[str] = "generation"

    sampling: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM sampling parameters merged into every request, as JSON "
        '(\'{"temperature": 0.7, "top_p": 0.95}\'); default vLLM\'s (temperature 1.0; greedy is '
        '{"temperature": 0}). Checked against the '
        "installed vLLM's SamplingParams before the load.",
    )
    max_tokens: int = Field(2048, ge=1, description="Most tokens generated for one turn.")
    turns: Literal["all", "last"] = Field(
        "all",
        description="all: every assistant turn, each conditioned on the ones regenerated before "
        "it; last: the last assistant turn only (earlier ones kept, not trained on).",
    )
    on_length: Literal["keep", "mark", "drop"] = Field(
        "keep",
        description="A turn cut by max_tokens: keep it (trained on), mark it (kept, loss mask 0 "
        "on it), or drop the conversation (counted in the chunk's record).",
    )
    reasoning: Literal["keep", "drop"] = Field(
        "keep",
        description="A turn's reasoning (up to its '</think>'): keep it in the content and "
        "train on it, or move it to reasoning_content with loss mask 0 (its tokens stay: the "
        "model conditioned on them).",
    )
    seed: int = Field(
        0, ge=0, description="Run seed; each sample's turn gets a seed derived from it and its id."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='Passed to the chat template, e.g. {"enable_thinking": false}.',
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Longest wait for one served completion (engine.url)."
    )
    conversations_per_chunk: int = Field(
        256, ge=1, le=1_000_000, description="Conversations per retryable chunk."
    )

    @field_validator("sampling", "chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        parsed = value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"expected a JSON object, found {value!r}: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError(f"expected a JSON object, found {value!r}")
        return parsed

    @field_validator("sampling")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(value) & RESERVED_SAMPLING)
        if reserved:
            raise ValueError(
                f"expected no {', '.join(reserved)} in sampling: hsx sets them per request "
                "(max_tokens: generation.max_tokens; seed: generation.seed, per sample)"
            )
        return value


# Sections of the extraction settings that regeneration does not read: their variables may share
# its environment file.
_EXTRACTION_ONLY = frozenset({"store", "capture", "layout", "pipeline", "timeouts", "server"})


class RegenerateSettings(BaseSettings):
    """Everything one regeneration needs. The CLI and the flow take this same model."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    model: Path = Field(..., description="Model folder: config.json, tokenizer, safetensors.")
    dataset: DatasetLocation = Field(
        ..., description="Conversations, in any format `hsx extract` reads (see data.format)."
    )
    out: str = Field(
        ...,
        description="Where the regenerated dataset goes (local folder or fsspec URL); "
        "`hsx extract --dataset OUT` reads it.",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    run: RunSettings = Field(default_factory=RunSettings)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return refuse_unknown_keys(cls, data, _EXTRACTION_ONLY)
