"""Settings: the cross-field check sees values from the CLI and from HSX_* variables together."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import build_settings
from settings import HsxSettings

pytestmark = [pytest.mark.timeout(60)]


def test_max_length_must_be_below_max_model_len() -> None:
    with pytest.raises(
        ValidationError,
        match=r"data.max_length 4096 must be below engine.max_model_len 4096.*at most 4095.*at least 4097",
    ):
        HsxSettings(
            model="m",
            dataset="d",
            store="s",
            engine={"max_model_len": 4096},
            data={"max_length": 4096},
        )
    ok = HsxSettings(
        model="m", dataset="d", store="s", engine={"max_model_len": 4096}, data={"max_length": 4095}
    )
    assert (ok.data.max_length, ok.engine.max_model_len) == (4095, 4096)


def test_lengths_default_to_the_models_own() -> None:
    # None until the model's config is read (hsx.model.limits.resolve_lengths fills both).
    unset = HsxSettings(model="m", dataset="d", store="s")
    assert (unset.engine.max_model_len, unset.data.max_length) == (None, None)
    only_length = HsxSettings(model="m", dataset="d", store="s", data={"max_length": 100000})
    assert only_length.data.max_length == 100000  # checked against the model in preflight


def test_cli_values_and_environment_are_validated_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The environment alone (max_model_len 1024 against max_length 4000) is invalid;
    # with the CLI's max_length it is not, and the CLI's values win over the environment's.
    monkeypatch.setenv("HSX_ENGINE__MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("HSX_ENGINE__DTYPE", "float32")
    monkeypatch.setenv("HSX_DATA__MAX_LENGTH", "4000")
    settings = build_settings(
        model="m", dataset="d", store="s", **{"data.max_length": 512, "engine.seed": 7}
    )
    assert settings.engine.max_model_len == 1024
    assert settings.engine.dtype == "float32"
    assert settings.engine.seed == 7
    assert settings.data.max_length == 512


def test_pipeline_tunables_reach_the_run_s_host_pipeline() -> None:
    """The write budget, prefetch depth and I/O threads are settings: None scales with the
    machine (never below the 2-core measurement), a number is taken as it is; each run's host
    pipeline applies them, and two runs in one process keep their own limits."""
    from hsx.extraction.host_pipeline import (
        DEFAULT_IO_THREADS,
        HostPipeline,
        min_write_budget_bytes,
        write_budget_bytes,
    )
    from settings import PipelineSettings

    auto = write_budget_bytes(PipelineSettings())
    assert min_write_budget_bytes(DEFAULT_IO_THREADS) <= auto <= 4 << 30
    tuned = PipelineSettings(write_budget_mib=512, prefetch_batches=3, io_threads=3)
    with HostPipeline(tuned, 1000) as first, HostPipeline(PipelineSettings(), 2000) as second:
        assert first.write_budget.limit == 512 << 20
        assert first.prefetch_batches == 3
        assert first.staging.keep == 32  # enough staging buffers to fill the budget
        assert first.io_pool._max_workers == 3
        assert first.engine_queue.limit == 1000
        # The second run's defaults are its own: nothing of the first leaked into it.
        assert second.write_budget.limit == auto and second.prefetch_batches == 2
        assert second.io_pool._max_workers == DEFAULT_IO_THREADS
        assert second.engine_queue.limit == 2000


def test_timeouts_are_settings_with_their_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits on servers, the stop's wait and verify's readers: read from HSX_TIMEOUTS__*,
    refused out of bounds naming the setting and the bound, and handed to the server pool and
    its clients (the pool of other timeouts is another pool)."""
    from hsx.engine.server_pool import get_server_pool
    from settings import TimeoutSettings

    monkeypatch.setenv("HSX_TIMEOUTS__SERVER_HANDSHAKE_S", "7.5")
    monkeypatch.setenv("HSX_TIMEOUTS__VERIFY_READERS", "3")
    settings = build_settings(model="m", dataset="d", store="s")
    assert settings.timeouts.server_handshake_s == 7.5
    assert settings.timeouts.verify_readers == 3
    assert settings.timeouts.server_request_s == 1800.0  # the default where nothing is said
    with pytest.raises(
        ValidationError, match=r"timeouts\.server_recheck_s[\s\S]*greater than or equal to 0.1"
    ):
        HsxSettings(model="m", dataset="d", store="s", timeouts={"server_recheck_s": 0})
    with pytest.raises(ValidationError, match=r"stop_wait_s"):
        HsxSettings(model="m", dataset="d", store="s", timeouts={"stop_wait_s": 601})
    assert settings.timeouts.state_watch_s == 2.0
    with pytest.raises(ValidationError, match=r"timeouts\.state_watch_s[\s\S]*greater than or"):
        HsxSettings(model="m", dataset="d", store="s", timeouts={"state_watch_s": 0.1})
    identity = {"model_config_hash": "x"}
    first = get_server_pool(["http://127.0.0.1:9"], identity, 8, 1 << 20, 1.0)
    same = get_server_pool(
        ["http://127.0.0.1:9"], identity, 8, 1 << 20, 1.0, None, TimeoutSettings()
    )
    other = get_server_pool(
        ["http://127.0.0.1:9"], identity, 8, 1 << 20, 1.0, None, TimeoutSettings(server_recheck_s=9)
    )
    try:
        assert first is same and other is not first
        assert other._timeouts.server_recheck_s == 9
    finally:
        for pool in (first, other):
            pool.close()


def test_cpu_thread_binding_splits_this_process_cpus_between_ranks() -> None:
    import os

    from hsx.engine.platform import cpu_thread_binding

    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_thread_binding(1) is None
    if len(cpus) >= 2:
        groups = [g.split(",") for g in (cpu_thread_binding(2) or "").split("|")]
        assert len(groups) == 2 and len(groups[0]) == len(groups[1]) == len(cpus) // 2
        assert {int(c) for g in groups for c in g} <= set(cpus)
    assert cpu_thread_binding(len(cpus) + 1) is None  # fewer CPUs than ranks: vLLM decides


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        (
            "HSX_ENGINE__MAX_MODEL_LENN",
            r"'engine.max_model_lenn'.*did you mean engine.max_model_len\?",
        ),
        ("HSX_ENGIN__DTYPE", r"HSX_ENGIN__DTYPE: did you mean HSX_ENGINE__DTYPE\?"),
        ("HSX_MODELL", r"HSX_MODELL: did you mean HSX_MODEL\?"),
        (
            "HSX_LAYOUT__ROWS_PER_CHUNKS",
            r"'layout.rows_per_chunks'.*did you mean layout.rows_per_chunk\?",
        ),
    ],
)
def test_a_misspelt_variable_fails_naming_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, message: str
) -> None:
    """Settings are as strict as data: a typo is not silently ignored while the default runs."""
    monkeypatch.setenv(variable, "2048")
    with pytest.raises(ValidationError, match=message):
        HsxSettings(model="m", dataset="d", store="s")


def test_unknown_keys_in_parameters_fail_naming_the_closest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a deployment's parameters (JSON) or a script pass: sections as dicts.
    with pytest.raises(ValidationError, match=r"'run.retrys'.*did you mean run.retries\?"):
        HsxSettings(model="m", dataset="d", store="s", run={"retrys": 3})
    with pytest.raises(ValidationError, match=r"unknown setting 'stor'.*did you mean store\?"):
        HsxSettings(model="m", dataset="d", store="s", stor="x")
    with pytest.raises(ValidationError, match=r"'engine.zzz'.*expected one of .*batch_tokens"):
        HsxSettings(model="m", dataset="d", store="s", engine={"zzz": 1})
    # Variables that are not settings (the bootstrap's, the allocator's) are left alone.
    monkeypatch.setenv("HSX_VLLM", "cpu")
    monkeypatch.setenv("HSX_ALLOCATOR", "glibc")
    assert HsxSettings(model="m", dataset="d", store="s").run.retries == 2


def test_the_cli_reports_a_misspelt_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import typer

    monkeypatch.setenv("HSX_RUN__RETRIESS", "5")
    with pytest.raises(typer.Exit) as exit_info:
        build_settings(model="m", dataset="d", store="s")
    assert exit_info.value.exit_code == 2
    assert "did you mean run.retries?" in capsys.readouterr().out


def test_partial_settings_merge_over_the_deployments_section_by_section() -> None:
    from settings import HsxSettings, merge_partial

    defaults = {
        "model": "/models/a",
        "dataset": "/data/a.jsonl",
        "store": "/stores/a.zarr",
        "engine": {"tensor_parallel_size": 8, "dtype": "bfloat16"},
        "run": {"retries": 3},
    }
    partial = {"store": "/stores/b.zarr", "engine": {"tensor_parallel_size": 1}}
    merged = merge_partial(defaults, partial)
    assert merged["engine"] == {"tensor_parallel_size": 1, "dtype": "bfloat16"}
    assert merged["run"] == {"retries": 3} and merged["store"] == "/stores/b.zarr"
    assert defaults["engine"]["tensor_parallel_size"] == 8  # neither input is changed
    settings = HsxSettings.model_validate(merged)
    assert settings.engine.dtype == "bfloat16" and settings.engine.tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"max_model_lenn.*max_model_len"):
        HsxSettings.model_validate(merge_partial(defaults, {"engine": {"max_model_lenn": 9}}))


def test_a_run_hsx_makes_itself_ignores_the_users_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The preflight probe's reduced-model run: a user's HSX_ variables (even a misspelt one,
    which the entry point refuses before) neither change nor fail it."""
    from settings.models import SettingsWithoutEnvironment

    monkeypatch.setenv("HSX_DATA__MAX_SAMPLES", "3")
    monkeypatch.setenv("HSX_DTYPE", "float32")
    probe = SettingsWithoutEnvironment(model=Path("m"), dataset=Path("d"), store="memory://p")
    assert probe.data.max_samples is None and probe.engine.dtype == "auto"
    with pytest.raises(ValidationError, match="did you mean model"):
        SettingsWithoutEnvironment(modle=Path("m"), dataset=Path("d"), store="memory://p")


def test_regeneration_settings_share_the_environment_file_and_refuse_typos(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One environment file serves extraction, serving and regeneration: each reads its own
    sections, passes over the others', and a typo in any is refused naming the closest."""
    from settings import RegenerateSettings, ServeSettings

    monkeypatch.setenv("HSX_GENERATION__MAX_TOKENS", "64")
    monkeypatch.setenv("HSX_LAYOUT__ROWS_PER_CHUNK", "128")  # extraction's own
    monkeypatch.setenv("HSX_ENGINE__DTYPE", "float32")  # shared
    regenerate = RegenerateSettings(model="m", dataset="d", out="o")
    assert regenerate.generation.max_tokens == 64 and regenerate.engine.dtype == "float32"
    assert HsxSettings(model="m", dataset="d", store="s").layout.rows_per_chunk == 128
    assert ServeSettings(model="m").engine.dtype == "float32"
    monkeypatch.setenv("HSX_GENERATION__MAX_TOKEN", "64")
    with pytest.raises(
        ValidationError, match=r"HSX_GENERATION__MAX_TOKEN\): did you mean generation.max_tokens\?"
    ):
        RegenerateSettings(model="m", dataset="d", out="o")
    monkeypatch.delenv("HSX_GENERATION__MAX_TOKEN")
    with pytest.raises(ValidationError, match=r"expected no seed in sampling"):
        RegenerateSettings(model="m", dataset="d", out="o", generation={"sampling": {"seed": 1}})
    with pytest.raises(ValidationError, match=r"expected a JSON object, found '\[1\]'"):
        RegenerateSettings(model="m", dataset="d", out="o", generation={"sampling": "[1]"})
