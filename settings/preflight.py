"""Settings of `hsx preflight MODEL_DIR`: the model, and the engine and capture sections that a
run or a server would use, from the same ``HSX_`` variables, so that a team's environment file
is checked before the long load (an unknown variable is refused here, naming the closest one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from settings.models import CaptureSettings, EngineSettings
from settings.strict import refuse_unknown_keys

# Sections of `hsx extract` and `hsx serve` that preflight does not read: their variables may
# share its environment file.
_NOT_CHECKED_HERE = frozenset({"dataset", "store", "data", "layout", "run", "pipeline", "server"})


class PreflightSettings(BaseSettings):
    """What `hsx preflight` checks. The CLI builds it; hsx.preflight takes its sections."""

    model_config = SettingsConfigDict(
        env_prefix="HSX_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    model: Path = Field(..., description="Model folder: config.json; weights optional.")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return refuse_unknown_keys(cls, data, _NOT_CHECKED_HERE)
