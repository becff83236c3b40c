"""hsx settings (pydantic-settings). Imports nothing of hsx, tasks or flows."""

from settings.fanout import FanoutSettings
from settings.merge import merge_partial
from settings.models import (
    CaptureSettings,
    DataSettings,
    EngineSettings,
    HsxSettings,
    PipelineSettings,
    RunSettings,
    StoreSettings,
    TimeoutSettings,
)
from settings.preflight import PreflightSettings
from settings.regenerate import GenerationSettings, RegenerateSettings
from settings.serve import ServerSettings, ServeSettings

__all__ = [
    "CaptureSettings",
    "DataSettings",
    "EngineSettings",
    "FanoutSettings",
    "GenerationSettings",
    "HsxSettings",
    "PipelineSettings",
    "PreflightSettings",
    "RegenerateSettings",
    "RunSettings",
    "ServeSettings",
    "ServerSettings",
    "StoreSettings",
    "TimeoutSettings",
    "merge_partial",
]
