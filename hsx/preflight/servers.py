"""Preflight against running `hsx serve` servers (``engine.url``)."""

from __future__ import annotations

from hsx.engine.homes import make_engine_home
from hsx.engine.server_pool import ServerPool
from hsx.errors import ConfigError
from hsx.extraction.run import RunSpec
from hsx.preflight.report import CheckResult, Status
from settings import HsxSettings


def server_pool(settings: HsxSettings, spec: RunSpec) -> ServerPool:
    """This process's pool of ``engine.url``'s servers for the run's identity."""
    home = make_engine_home(settings, spec.config, spec.layer_ids, spec.engine_dtype)
    pool = getattr(home, "pool", None)
    if not isinstance(pool, ServerPool):
        raise ConfigError(f"engine.url: expected server URLs to check, found {home.kind} engine")
    return pool


def check_servers(settings: HsxSettings, spec: RunSpec) -> CheckResult:
    """Preflight against ``engine.url``: every server that answers within
    ``engine.server_wait_s`` must serve what the run froze, and states of one short prompt must
    come back through this node's shared memory. FAIL on any mismatch, or when none answers."""
    pool = server_pool(settings, spec)
    report = pool.check(settings.engine.server_wait_s)
    details = tuple(
        f"{url}: instance {info.get('instance')}, {info.get('model_dir')}, layer ids "
        f"{info.get('layer_ids')}, {info.get('engine_dtype')}, TP "
        f"{info.get('tensor_parallel_size')}, vLLM {info.get('vllm_version')}, loaded in "
        f"{info.get('load_seconds', '?')} s"
        for url, info in report.ready.items()
    )
    details += tuple(f"{url}: {error}" for url, error in report.unreachable.items())
    if report.mismatched:
        problems = [
            f"{url}: {problem}" for url, found in report.mismatched.items() for problem in found
        ]
        return CheckResult(
            "servers",
            Status.FAIL,
            f"expected every server to serve what the run froze, found {len(problems)} "
            f"difference(s): {problems[0]}",
            tuple(problems[1:]) + details,
        )
    if not report.ready:
        return CheckResult(
            "servers",
            Status.FAIL,
            f"engine.url: expected at least one of {len(settings.engine.url)} servers to "
            f"answer within {settings.engine.server_wait_s:g} s (engine.server_wait_s), found "
            "none: start them with `hsx serve MODEL_DIR` (the run's engine and capture settings)",
            details,
        )
    if report.unreachable:
        return CheckResult(
            "servers",
            Status.WARN,
            f"{len(report.ready)} of {len(settings.engine.url)} servers ready; the others get "
            "chunks once they answer",
            details,
        )
    return CheckResult(
        "servers",
        Status.PASS,
        f"{len(report.ready)} server(s) serve this run's model, layer ids and dtype; states "
        "came back through shared memory",
        details,
    )
