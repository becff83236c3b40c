"""The team setup of issue 13, for real: a Prefect server and process worker (infra/), an
`hsx serve` beside them, and the `extract-served` deployment run through the REST API as the UI
runs it. Two flow runs on two stores and a UI Retry of a run whose chunk failed all go to the one
server: the model is loaded once (its log, its instance in every commit, its token counters),
while the worker starts a fresh process for every flow run and builds no engine there."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hsx.store.zarr_store import ExtractionStore
from tests.cli import hsx
from tests.conftest import REPO_ROOT
from tests.prefect_stack import Stack, running_stack
from tests.servers import READY, ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]


def _flow_logs(stack: Stack, run_id: str) -> list[str]:
    logs = stack.call(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    return [log["message"] for log in logs]


def test_two_runs_and_a_ui_retry_share_one_model_load(tmp_path: Path) -> None:
    from hsx.extraction.steps import plan_and_create_store, resolve_settings
    from settings import HsxSettings, merge_partial

    with running_stack("sqlite") as stack:
        # The deployment's defaults (the tiny Llama the stack built, its own dtype and lengths):
        # `hsx serve` with its defaults serves exactly what those runs freeze.
        server = ServeProcess(REPO_ROOT / "models" / "tiny-llama", tmp_path, "--no-probe")
        server.start()
        try:
            instance = server.info()["instance"]
            tokens_before = server.metric("vllm:prompt_tokens_total")
            common = {
                "data": {"max_samples": 60},
                "engine": {"url": [server.url]},
                "layout": {"rows_per_chunk": 256, "min_work_chunk_tokens": 1024},
                "run": {"retries": 1, "retry_delay_seconds": 0},
            }
            first_store, second_store = str(tmp_path / "one.zarr"), str(tmp_path / "two.zarr")

            first = stack.run(
                "hsx-extract", "extract-served", {"settings": {**common, "store": first_store}}
            )
            done = stack.wait(first)
            assert done["state_type"] == "COMPLETED", done["state"]["message"]

            # The second store, planned as the run will plan it, with a directory where chunk
            # 1's first hidden-state object must go: its writes fail for real.
            partial = {**common, "store": second_store}
            deployment = stack.deployment_id("hsx-extract", "extract-served")
            defaults = stack.call("GET", f"/deployments/{deployment}").json()["parameters"]
            settings = resolve_settings(
                HsxSettings.model_validate(merge_partial(defaults["settings"], partial))
            )
            plan_and_create_store(settings)
            opened = ExtractionStore.open(second_store)
            chunk = opened.work_chunks[1]
            blocker = (
                Path(second_store)
                / "hidden_states"
                / f"c.{chunk.row_start // opened.rows_per_chunk}.0.0"
            )
            blocker.mkdir()
            second = stack.run("hsx-extract", "extract-served", {"settings": partial})
            failed = stack.wait(second)
            assert failed["state_type"] == "FAILED" and "chunk 1: " in failed["state"]["message"]
            blocker.rmdir()
            started = time.monotonic()
            stack.retry_like_the_ui(second)
            retried = stack.wait(second)
            retry_seconds = time.monotonic() - started
            assert retried["state_type"] == "COMPLETED", retried["state"]["message"]
            assert retried["run_count"] == 2

            # One load served the three attempts: every commit of both stores names the one
            # instance, the server started once and loaded its weights once, and it computed
            # (at least) every token of both stores.
            totals = 0
            for store in (first_store, second_store):
                commits = ExtractionStore.open(store).committed_chunks()
                assert sorted(commits) == list(range(len(ExtractionStore.open(store).work_chunks)))
                assert {(c.extra or {})["engine_server"]["instance"] for c in commits.values()} == {
                    instance
                }
                totals += sum(c.tokens for c in commits.values())
            log = server.log()
            assert log.count(READY) == 1
            # Counted at its start: tqdm may print the 100% line twice for one load.
            assert log.split("hsx serve: loading", 1)[1].count("checkpoint shards:   0%") == 1
            assert server.metric("vllm:prompt_tokens_total") - tokens_before >= totals
            commits = ExtractionStore.open(second_store).committed_chunks()
            assert commits[1].extra["flow_run_attempt"] == 2
            assert all(c.extra["flow_run_attempt"] == 1 for i, c in commits.items() if i != 1)
            # Each attempt ran in a fresh worker process and checked the server instead of
            # probing a model: no engine was built there.
            for run_id in (first, second):
                logs = " ".join(_flow_logs(stack, run_id))
                assert "preflight servers: PASS" in logs, logs[-2000:]
                assert f"on server {server.url} (instance {instance})" in logs, logs[-2000:]
                assert "preflight probe" not in logs
            # The audit: `hsx info` names the server (URL and instance) of every chunk.
            shown = hsx("info", second_store, env=stack.env)
            assert shown.returncode == 0 and "server (instance)" in shown.stdout, shown.stdout
            listed = json.loads(hsx("info", second_store, "--json", env=stack.env).stdout)
            assert [c["extra"]["engine_server"]["url"] for c in listed["commits"]] == [
                server.url
            ] * len(commits)
            print(f"the UI's Retry of the second run took {retry_seconds:.1f} s, no model load")
        finally:
            server.stop()
