"""The deployment file names a flow that loads, with parameters the flow accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_deployment_entrypoint_and_parameters_are_valid() -> None:
    from prefect.flows import load_flow_from_entrypoint

    from settings import HsxSettings

    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
        assert flow.name == "hsx-extract"
        settings = HsxSettings.model_validate(deployment["parameters"]["settings"])
        assert settings.engine.tensor_parallel_size == 8


def test_flow_parameters_render_as_a_form() -> None:
    """Prefect builds the UI form from the parameter schema: one object with every section."""
    from prefect.utilities.callables import parameter_schema

    from flows.extract import extract_flow

    schema = parameter_schema(extract_flow.fn).model_dump()
    settings = schema["properties"]["settings"]
    assert "settings" in schema["required"]
    definitions = schema.get("definitions", {})
    assert {"EngineSettings", "CaptureSettings", "StoreSettings"} <= set(definitions), sorted(
        definitions
    )
    assert settings
