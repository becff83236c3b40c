"""A retried extraction on a running hsx Prefect stack, as a user makes one from the UI: the
extract deployment's run with a chunk that fails for real (a directory where its first
hidden-state object must go), the fix, then the UI's Retry (set_state AwaitingRetry). Prints the
flow run id. Used by scripts/screenshot-retried-run.sh.

    PREFECT_API_URL=http://127.0.0.1:4517/api python scripts/retried_run.py STORE
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.extraction.steps import plan_and_create_store, resolve_settings
from hsx.store.zarr_store import ExtractionStore
from settings import HsxSettings, merge_partial


def _call(api: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    for _ in range(20):  # SQLite answers 503 on a lock; Prefect's own client retries too
        response = api.request(method, path, **kwargs)
        if response.status_code != 503:
            break
        time.sleep(0.5)
    response.raise_for_status()
    return response.json()


def _wait(api: httpx.Client, run_id: str, run_count: int) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        run = _call(api, "GET", f"/flow_runs/{run_id}")
        terminal = run["state_type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
        if terminal and run["run_count"] >= run_count:
            return dict(run)
        time.sleep(1)
    raise SystemExit(f"flow run {run_id}: expected attempt {run_count} to finish within 600 s")


def main(store: str) -> None:
    api = httpx.Client(base_url=os.environ["PREFECT_API_URL"], timeout=30)
    deployment = _call(api, "GET", "/deployments/name/hsx-extract/extract")
    partial = {
        "store": store,
        "data": {"max_samples": 60},
        "layout": {"rows_per_chunk": 256, "min_work_chunk_tokens": 1024},
        "run": {"preflight": False, "retries": 1, "retry_delay_seconds": 0},
    }
    merged = merge_partial(deployment["parameters"]["settings"], partial)
    plan_and_create_store(resolve_settings(HsxSettings.model_validate(merged)))
    opened = ExtractionStore.open(store)
    chunk = opened.work_chunks[1]
    blocker = Path(store, "hidden_states", f"c.{chunk.row_start // opened.rows_per_chunk}.0.0")
    blocker.mkdir()
    run = _call(
        api,
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        json={"parameters": {"settings": partial}},
    )
    first = _wait(api, run["id"], 1)
    print(f"attempt 1: {first['state_name']}", file=sys.stderr)
    blocker.rmdir()
    _call(
        api,
        "POST",
        f"/flow_runs/{run['id']}/set_state",
        json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True},
    )
    second = _wait(api, run["id"], 2)
    print(f"attempt 2: {second['state_name']}", file=sys.stderr)
    print(run["id"])


if __name__ == "__main__":
    main(sys.argv[1])
