"""Shared fixtures: tiny models built once per session, the bundled dataset, a real Prefect
engine (prefect_test_harness), and settings for small real runs."""

from __future__ import annotations

import os

# Before vllm/prefect are imported anywhere: they read these once.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hsx")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATASET = REPO_ROOT / "data" / "sample_conversations.jsonl"
# Set by CI (.ci/run): a test whose component is missing (PostgreSQL, root for a tmpfs or another
# user's folder) fails there, where a skip would show only as an -rs line nobody reads.
REQUIRE_ALL = "TESTS_REQUIRE_ALL_COMPONENTS"


def missing_component(reason: str) -> NoReturn:
    """Skip for ``reason``; fail instead where every component is required (CI)."""
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL}=1: CI requires it)")
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    """Count the run's expensive starts (engines, servers, Prefect stacks): tests/starts.py."""
    from tests.starts import install

    install(config)


# The longest modules, longest first (bench/ci-times.md has their times): with test workers
# (pytest-xdist --dist loadfile --no-loadscope-reorder: whole modules, in this order, each to the
# first worker with at most two tests left) they start first, so that no worker is left with a
# long module at the end while the other idles. Serially the order changes nothing.
LONGEST_MODULES = (
    "test_prefect_deployments.py",
    "test_many_nodes.py",
    "test_regenerate.py",
    "test_serve.py",
    "test_bad_inputs.py",
    "test_families.py",
    "test_trainer_exports.py",
    "test_interrupt.py",
    "test_portability.py",
    "test_storage_faults.py",
    "test_capture_matches_hf.py",
    "test_audit.py",
    "test_kill_resume.py",
    "test_own_server.py",
    "test_serve_hostile.py",
    "test_preflight.py",
    "test_flow.py",
)


def _module_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (a stable sort: each module's own order is kept). Tests marked
    ``vllm`` are skipped, with the reason, where vLLM is not installed (the unit-test venvs of
    other Pythons); where it is, they run."""
    import importlib.util

    items.sort(key=_module_rank)
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed in this environment")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hsx.data.tiny_models import ensure_tiny_models

    return ensure_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["tiny-llama"]


@pytest.fixture(scope="session")
def tiny_deepseek(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["tiny-deepseek-v3"]


@pytest.fixture(scope="session")
def sample_dataset() -> Path:
    return SAMPLE_DATASET


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real Prefect API server for the session (the CLI's own temporary server, on a fresh
    SQLite database in a Prefect home of its own), named in ``PREFECT_API_URL`` for every
    process the tests start: a CLI run then uses it instead of starting its own server (~7 s a
    run on these 2-core machines). Tests of the CLI's own server (tests/integration/
    test_demo.py, test_interrupt.py) take ``PREFECT_API_URL`` out of their children's env."""
    from flows.temporary_server import TemporaryServer

    home = tmp_path_factory.mktemp("prefect-home")
    saved = {name: os.environ.get(name) for name in ("PREFECT_HOME", "PREFECT_API_URL")}
    os.environ["PREFECT_HOME"] = str(home)
    server = TemporaryServer(home, timeout_s=120)
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        yield server.api_url
    finally:
        from flows.run_guard import drain_prefect_workers

        drain_prefect_workers(timeout_s=3.0)
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def prefect_harness(prefect_api: str) -> Iterator[None]:
    """A real Prefect engine in this process, on the session's API server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        yield


@pytest.fixture(scope="session")
def trainers_site() -> Path:
    """The trainers' packages (speculators, specforge, nvidia-modelopt), installed --no-deps by
    scripts/bootstrap.sh into .venv/trainers: put on a child process's PYTHONPATH."""
    site = REPO_ROOT / ".venv" / "trainers"
    if not (site / "speculators").is_dir() or not (site / "specforge").is_dir():
        missing_component(f"the trainers' packages at {site}: run `make venv`")
    return site


def make_settings(model: Path, dataset: Path, store: str, **sections: dict[str, Any]) -> Any:
    """fp32 engine (bit-level comparisons with HF), small KV cache, small work chunks."""
    from settings import HsxSettings

    engine = {
        "dtype": "float32",
        "max_model_len": 2048,
        "kv_cache_memory_gib": 0.25,
        **sections.pop("engine", {}),
    }
    layout = {"min_work_chunk_tokens": 1024, "rows_per_chunk": 256, **sections.pop("layout", {})}
    run = {"retry_delay_seconds": 0.0, **sections.pop("run", {})}
    data = {"max_length": 2047, **sections.pop("data", {})}  # below max_model_len
    return HsxSettings(
        model=model,
        dataset=dataset,
        store=store,
        engine=engine,
        layout=layout,
        run=run,
        data=data,
        **sections,
    )


@pytest.fixture
def host() -> Iterator[Any]:
    """A run's host pipeline (engine queue, write budget, staging buffers, pools) of the default
    settings, as a run builds it; a test that needs other limits builds its own."""
    from hsx.engine.homes import engine_queue_limit
    from hsx.extraction.host_pipeline import HostPipeline
    from settings import PipelineSettings

    with HostPipeline(PipelineSettings(), engine_queue_limit(4096, None)) as pipeline:
        yield pipeline
