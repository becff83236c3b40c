"""Preflight tasks, the extraction flow's first steps: "signature validation" (every check that
needs no engine, seconds) and "model-load probe" (the reduced model through the exact path), or
with ``engine.url`` "server check" (each `hsx serve` server's identity against the run's, and
one prompt's states through shared memory; the servers ran the probe when they started).
A failed check stops the flow before the long model load; the log names the check and why."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from hsx.errors import FatalError
from hsx.preflight.report import CheckResult, PreflightReport, Status
from hsx.preflight.run import probe_check, static_checks
from settings import HsxSettings
from tasks.common import logged_failures, retry_unless_fatal


class PreflightFailedError(FatalError):
    """A preflight check failed: the flow stops before loading the model."""


def _report(settings: HsxSettings, results: list[CheckResult], key: str) -> PreflightReport:
    report = PreflightReport(str(settings.model), results)
    create_markdown_artifact(report.to_markdown(), key=key, description=report._headline())
    return report


def _raise_on_failure(report: PreflightReport, stage: str) -> None:
    failed = [r for r in report.results if r.status == Status.FAIL]
    if failed:
        lines = "; ".join(f"{r.check}: {r.summary}" for r in failed)
        raise PreflightFailedError(
            f"{stage} failed before the model load ({len(failed)} check(s)): {lines}"
        )


def _publish(
    settings: HsxSettings, result: CheckResult, key: str, stage: str, logger: Any
) -> dict[str, Any]:
    """One check's artifact and log line; PreflightFailedError when it failed."""
    report = _report(settings, [result], key)
    (logger.error if result.status == Status.FAIL else logger.info)(
        "preflight %s: %s: %s %s",
        result.check,
        result.status.value.upper(),
        result.summary,
        list(result.details),
    )
    _raise_on_failure(report, stage)
    return report.to_dict()


@task(name="signature-validation", cache_policy=NO_CACHE, retries=0, persist_result=False)
def signature_validation_task(settings: HsxSettings) -> dict[str, Any]:
    with logged_failures("signature validation") as logger:
        results, _ = static_checks(
            settings.model,
            settings.capture,
            settings.engine,
            settings.store,
            max_length=settings.data.max_length,
            local_engine=not settings.engine.url,
        )
        report = _report(settings, results, "hsx-preflight-static")
        for result in results:
            (logger.error if result.status == Status.FAIL else logger.info)(
                "preflight %s: %s: %s", result.check, result.status.value.upper(), result.summary
            )
        _raise_on_failure(report, "signature validation")
        return report.to_dict()


@task(
    name="model-load-probe",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_delay_seconds=2.0,
    retry_condition_fn=retry_unless_fatal,  # a failed check is fatal; an engine crash is not
)
def model_load_probe_task(settings: HsxSettings) -> dict[str, Any]:
    with logged_failures("model-load probe") as logger:
        _, context = static_checks(
            settings.model, settings.capture, settings.engine, settings.store
        )
        layer_ids = context.get("layer_ids", ())
        # Imported here: hsx.engine.vllm_engine imports vLLM (seconds), and the flow's module
        # is imported by the UI's deployments for nothing but its parameter form.
        from hsx.engine.vllm_engine import engine_is_loaded

        if layer_ids and engine_is_loaded(settings.model, settings.engine, layer_ids):
            # The real engine already runs in this process (a re-run): probing would evict it
            # and cost a second model load.
            result = CheckResult(
                "probe", Status.PASS, "skipped: the real engine is loaded and alive in this process"
            )
        else:
            result = probe_check(context, settings.engine)
        return _publish(settings, result, "hsx-preflight-probe", "model-load probe", logger)


@task(name="server-check", cache_policy=NO_CACHE, persist_result=False, retries=0)
def server_check_task(settings: HsxSettings) -> dict[str, Any]:
    with logged_failures("server check") as logger:
        from hsx.extraction.run import run_spec
        from hsx.preflight.servers import check_servers

        result = check_servers(settings, run_spec(settings))
        return _publish(settings, result, "hsx-preflight-servers", "server check", logger)


def preflight_tasks(settings: HsxSettings) -> None:
    """Run both in order; each raises PreflightFailedError (fatal, not retried) on a failure."""
    signature_validation_task(settings)
    if settings.engine.url:
        server_check_task(settings)
    else:
        model_load_probe_task(settings)
