"""The deployment file names a flow that loads, with parameters the flow accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_deployment_entrypoints_and_parameters_are_valid() -> None:
    """Each deployment's flow loads, and its defaults are what the flow accepts: the extract
    defaults validate as HsxSettings once the checkout is put in for ``{{ $HSX_REPO }}``."""
    import inspect

    from prefect.flows import load_flow_from_entrypoint

    from settings import HsxSettings

    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    names = {}
    for deployment in spec["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
        names[deployment["name"]] = flow.name
        accepted = set(inspect.signature(flow.fn).parameters)
        assert set(deployment["parameters"]) <= accepted, (deployment["name"], accepted)
        # Partial run parameters reach the flow, which merges and validates them itself.
        assert deployment["enforce_parameter_schema"] is False
        # Parents over many nodes plan and watch on the CPU pool; everything else on GPU nodes.
        pool = "hsx-cpu" if deployment["name"] == "extract-fanout" else "hsx-gpu"
        assert deployment["work_pool"]["name"] == pool
    assert names == {
        "extract": "hsx-extract",
        "extract-served": "hsx-extract",
        "extract-fanout": "hsx-extract-fanout",
        "extract-item": "hsx-extract-item",
        "preflight": "hsx-preflight",
        "verify": "hsx-verify",
        "export": "hsx-export",
        "audit": "hsx-audit",
        "regenerate": "hsx-regenerate",
        "regenerate-extract": "hsx-regenerate-extract",
    }
    (regenerate,) = [d for d in spec["deployments"] if d["name"] == "regenerate"]
    rendered = yaml.safe_load(
        yaml.safe_dump(regenerate["parameters"]["settings"]).replace("{{ $HSX_REPO }}", str(ROOT))
    )
    from settings import RegenerateSettings

    regeneration = RegenerateSettings.model_validate(rendered)
    assert regeneration.generation.sampling == {"temperature": 0.7}
    (both,) = [d for d in spec["deployments"] if d["name"] == "regenerate-extract"]
    rendered = yaml.safe_load(
        yaml.safe_dump(both["parameters"]).replace("{{ $HSX_REPO }}", str(ROOT))
    )
    from flows.regenerate_extract import extraction_settings

    greedy = RegenerateSettings.model_validate(rendered["settings"])
    extraction = extraction_settings(greedy, rendered["extract"])
    assert str(extraction.dataset) == greedy.out and extraction.store.endswith("greedy.zarr")
    assert greedy.generation.sampling == {"temperature": 0}
    (fanout,) = [d for d in spec["deployments"] if d["name"] == "extract-fanout"]
    from settings import FanoutSettings

    assert FanoutSettings.model_validate(fanout["parameters"]["fanout"]).max_resubmits == 2
    for name in ("extract", "extract-served", "extract-fanout", "extract-item"):
        (extract,) = [d for d in spec["deployments"] if d["name"] == name]
        rendered = yaml.safe_load(
            yaml.safe_dump(extract["parameters"]["settings"]).replace("{{ $HSX_REPO }}", str(ROOT))
        )
        settings = HsxSettings.model_validate(rendered)
        assert settings.model == ROOT / "models" / "tiny-llama"
        assert settings.dataset == (ROOT / "data" / "sample_conversations.jsonl")
        # The served deployment sends its chunks to `hsx serve`'s default address.
        assert settings.engine.url == (
            ["http://127.0.0.1:8100"] if name == "extract-served" else []
        )
    (verify,) = [d for d in spec["deployments"] if d["name"] == "verify"]
    assert verify["schedules"][0]["cron"] == "0 3 * * *"


def test_the_compose_file_names_the_team_services() -> None:
    """On paper (no Docker engine here): at least it parses and wires what the scripts do."""
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "server", "minio", "serve", "worker"}
    # The worker and `hsx serve` share the host's network (127.0.0.1:8100) and /dev/shm.
    for name in ("serve", "worker"):
        assert services[name]["ipc"] == "host" and services[name]["network_mode"] == "host"
    assert services["worker"]["depends_on"]["serve"]["condition"] == "service_healthy"
    assert "hsx serve" in services["serve"]["command"]
    assert (
        "postgresql+asyncpg"
        in services["server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    )
    assert services["worker"]["command"] == "bash infra/start-worker.sh"
    assert all(port.startswith("${HSX_BIND:-127.0.0.1}") for port in services["server"]["ports"])


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


def test_the_worker_restart_line_is_what_the_stack_tests_look_for(tmp_path: Path) -> None:
    """The Prefect-stack tests fail on a worker restart by finding start-worker.sh's own line in
    its log; if the script's words change, that check would find nothing and pass."""
    from tests.prefect_stack import RESTART_LINE, worker_restarts

    script = (ROOT / "infra" / "start-worker.sh").read_text()
    echoed = [line for line in script.splitlines() if "echo" in line and RESTART_LINE in line]
    assert len(echoed) == 1, f"expected one echo of {RESTART_LINE!r} in start-worker.sh"
    log = tmp_path / "worker.log"
    log.write_text("ok\n" + RESTART_LINE + " with status 1; restarting it in 5 s\nok\n")
    assert worker_restarts(log) == [RESTART_LINE + " with status 1; restarting it in 5 s"]
    assert worker_restarts(tmp_path / "absent.log") == []


def test_the_worker_leaves_a_run_whose_last_attempt_holds_a_slot_for_the_next_poll() -> None:
    """Prefect 3.7's worker exits when a retried run comes back while its last attempt still
    holds a token of the ``--limit`` limiter; flows/worker_launch.py leaves such a run for the
    next poll (a real anyio limiter, holding one run's token, as the worker's does)."""
    import uuid
    from types import SimpleNamespace

    import anyio

    from flows.worker_launch import runs_to_submit, skip_runs_still_holding_a_slot

    assert skip_runs_still_holding_a_slot(), "the installed Prefect's worker cannot be patched"
    retried, other = uuid.uuid4(), uuid.uuid4()
    entries = [SimpleNamespace(flow_run=SimpleNamespace(id=i)) for i in (retried, other)]

    async def held_by_retried() -> list[object]:
        limiter = anyio.CapacityLimiter(2)
        limiter.acquire_on_behalf_of_nowait(retried)
        kept = runs_to_submit(limiter, entries)
        with pytest.raises(RuntimeError, match="already holding"):  # what made the worker exit
            limiter.acquire_on_behalf_of_nowait(retried)
        return kept

    assert anyio.run(held_by_retried) == [entries[1]]
    assert runs_to_submit(None, entries) == entries


def test_every_hsx_command_keeps_nvlink_multicast_off() -> None:
    """The CLI sets NCCL_NVLS_ENABLE=0 before any engine (or its TP workers) start; a value the
    user set stays."""
    import os
    import subprocess
    import sys

    probe = "import os, flows.cli; print(os.environ['NCCL_NVLS_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    unset = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert unset.stdout.strip() == "0", unset.stderr[-2000:]
    chosen = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "NCCL_NVLS_ENABLE": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert chosen.stdout.strip() == "1", chosen.stderr[-2000:]
