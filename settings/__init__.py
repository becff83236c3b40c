"""hsx settings (pydantic-settings). Imports nothing of hsx, tasks or flows."""

from settings.models import (
    CaptureSettings,
    DataSettings,
    EngineSettings,
    HsxSettings,
    PipelineSettings,
    RunSettings,
    StoreSettings,
)

__all__ = [
    "CaptureSettings",
    "DataSettings",
    "EngineSettings",
    "HsxSettings",
    "PipelineSettings",
    "RunSettings",
    "StoreSettings",
]
