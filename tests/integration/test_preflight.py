"""Preflight on real public configs (no weights) and on the tiny models, with the real vLLM
engine in the probe; the numeric cross-check catches a wrong engine kernel; the extraction flow
stops at a failed check before any model load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.preflight.report import Status
from hsx.preflight.run import run_preflight
from settings import CaptureSettings, EngineSettings
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "configs"


def by_check(report: object) -> dict[str, object]:
    return {r.check: r for r in report.results}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fixture", "chain_end", "ids"),
    [
        ("kimi-k2", "DeepseekV2Model", "(2, 30, 58, 61)"),
        ("deepseek-v3", "DeepseekV2Model", "(2, 30, 58, 61)"),
        ("llama-3.1-8b", "LlamaModel", "(2, 16, 29, 32)"),
        # Attention sinks, alternating sliding window, MoE: its reduced copy keeps 5 of the 24
        # layer_types (issue 43: 8 kept for 5 layers, and HF's config refused itself).
        ("gpt-oss-20b", "GptOssModel", "(2, 12, 21, 24)"),
        # A multimodal wrapper: the probe runs its text model (HF's DeepseekV3ForCausalLM, not
        # vLLM's inner DeepseekV2ForCausalLM name); resolving it imports numba, which broke
        # every later engine start of the process on the CPU build (hsx.engine.vllm_compat).
        ("kimi-k2.5", "DeepseekV2Model", "(2, 30, 58, 61)"),
    ],
)
def test_public_configs_resolve_and_probe(fixture: str, chain_end: str, ids: str) -> None:
    report = run_preflight(FIXTURES / fixture)
    checks = by_check(report)
    assert checks["resolve"].status == Status.PASS and chain_end in checks["resolve"].summary
    assert checks["contract"].status == Status.PASS and ids in checks["contract"].summary
    assert checks["signatures"].status == Status.PASS
    # The reduced probe ran through vLLM and matched HF transformers numerically.
    assert checks["probe"].status in (Status.PASS, Status.WARN), checks["probe"].summary
    assert "matches HF within" in checks["probe"].summary
    # A config-only folder has no tokenizer: extraction could not run, so preflight says so.
    assert checks["tokenizer"].status == Status.FAIL and not report.ok


def test_tiny_model_passes_everything(tiny_llama: Path) -> None:
    report = run_preflight(tiny_llama)
    assert report.ok, [(r.check, r.summary) for r in report.results]
    assert by_check(report)["probe"].status == Status.PASS


def test_numeric_cross_check_catches_the_cpu_rotary_kernel(tiny_deepseek: Path) -> None:
    """vLLM's CPU rotary op is wrong for MLA's 3-D queries: the probe must fail with it on."""
    bad = run_preflight(tiny_deepseek, engine=EngineSettings(mla_rotary_custom_op="on"))
    probe = by_check(bad)["probe"]
    assert probe.status == Status.FAIL and "differ from HF transformers" in probe.summary
    good = run_preflight(tiny_deepseek, engine=EngineSettings(mla_rotary_custom_op="auto"))
    assert by_check(good)["probe"].status == Status.PASS


def test_layer_id_zero_on_deepseek_fails_the_contract(tiny_deepseek: Path) -> None:
    report = run_preflight(tiny_deepseek, capture=CaptureSettings(layer_ids=[0, 4, 8]), probe=False)
    contract = by_check(report)["contract"]
    assert contract.status == Status.FAIL and "0" in contract.summary


def test_cli_exit_codes_and_json(tiny_llama: Path) -> None:
    run = [sys.executable, "-m", "flows.cli", "preflight"]
    failing = subprocess.run(
        [*run, str(FIXTURES / "kimi-k2"), "--json", "--no-probe"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert failing.returncode == 1, failing.stderr[-2000:]
    payload = json.loads(failing.stdout)
    assert payload["ok"] is False and {r["check"] for r in payload["results"]} >= {
        "resolve",
        "contract",
        "signatures",
        "weights",
        "resources",
    }
    passing = subprocess.run(
        [*run, str(tiny_llama), "--no-probe"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert passing.returncode == 0, passing.stdout[-3000:]
    assert "Preflight OK" in passing.stdout


def test_preflight_checks_the_environment_a_run_would_use(tiny_llama: Path) -> None:
    """`hsx preflight` reads the HSX_ variables a run reads: a misspelt one is refused at the
    door naming the real one, and a setting the model cannot take fails its check."""
    from tests.cli import hsx, said

    misspelt = hsx("preflight", str(tiny_llama), env={"HSX_DTYPE": "float32"})
    assert misspelt.returncode == 2, said(misspelt)
    assert "unknown setting variable HSX_DTYPE: did you mean HSX_ENGINE__DTYPE?" in said(misspelt)
    assert "Traceback" not in said(misspelt)
    too_long = hsx(
        "preflight", str(tiny_llama), "--no-probe", env={"HSX_ENGINE__MAX_MODEL_LEN": "4096"}
    )
    assert too_long.returncode == 1, said(too_long)
    assert "4096" in said(too_long) and "Preflight OK" not in said(too_long)


def test_a_check_that_raises_reports_a_one_line_result() -> None:
    """A check whose error spans lines (a pydantic error) is a FAIL with details, never a
    traceback in place of the report."""
    from pydantic import ValidationError

    from hsx.preflight.run import _guarded
    from settings import EngineSettings as Engine

    def bad_settings() -> object:
        return Engine(dtype="float64")

    result = _guarded("probe", bad_settings)  # type: ignore[arg-type]
    assert result.status == Status.FAIL and "\n" not in result.summary
    assert result.summary.startswith("check raised ValidationError: 1 validation error")
    assert any("dtype" in line for line in result.details), result.details
    with pytest.raises(ValidationError):
        bad_settings()


def test_flow_stops_at_failed_preflight_before_loading(
    prefect_harness: None, tiny_deepseek: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.extract import extract_flow
    from hsx.engine import vllm_engine
    from tasks.preflight import PreflightFailedError
    from tests.integration.test_flow import flow_logs

    vllm_engine.close_all_engines()
    url = tmp_path / "never.zarr"
    settings = make_settings(
        tiny_deepseek, sample_dataset, str(url), capture={"layer_ids": [0, 4, 8]}
    )
    with pytest.raises(PreflightFailedError, match=r"signature validation failed .*contract: .*0"):
        extract_flow(settings)
    assert not url.exists()
    assert vllm_engine._ENGINES == {}  # the model was never loaded
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    messages = flow_logs(run.id)
    assert any("preflight contract: FAIL" in m for m in messages), messages[-5:]


def test_a_bfloat16_probe_reports_a_ratio_to_hfs_own_spread(tiny_llama: Path) -> None:
    """In bf16 (the GPU default) the probe reads as a ratio to HF's own bf16 spread per layer,
    PASS within it, never as an absolute error that looks like a failure."""
    import re

    from hsx.preflight.probe import run_probe
    from hsx.preflight.run import static_checks

    _, context = static_checks(tiny_llama, CaptureSettings(), EngineSettings())
    result = run_probe(
        context["config"],
        context["text"],
        context["layer_ids"],
        context["lowest_layer_id"],
        EngineSettings(),
        dtype="bfloat16",
    )
    assert result.status == Status.PASS, (result.summary, result.details)
    found = re.search(
        r"every layer within (\d+\.\d\d)x HF's own bfloat16 spread \(allowed 3x\)", result.summary
    )
    assert found and float(found.group(1)) <= 3.0, result.summary
    assert any("error vs HF's own bfloat16 spread per id" in line for line in result.details)
