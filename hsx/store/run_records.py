"""Run records: one per attempt of every flow run, never overwritten by a later attempt (a
Retry from the UI is attempt 2 of the same flow run). They live in the store (``runs/``); a run
that failed before its store existed (bad input, preflight) keeps its record beside the store's
URL (``<store>.runs/``), where ``hsx info`` and ``hsx runs`` look for it too."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hsx.plan.building import code_version
from hsx.store.storage_io import exists, store_io, write_atomic
from hsx.store.zarr_store import ExtractionStore, existing_store_meta, fs_and_root
from settings import HsxSettings

BESIDE_SUFFIX = ".runs"


def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass(frozen=True)
class RunAttempt:
    """Which flow run, and which attempt of it, is writing."""

    run_id: str  # the Prefect flow run id ("local-..." outside Prefect)
    attempt: int  # 1; 2 after a Retry of the same flow run; ...
    started_at: float  # unix time
    name: str | None = None  # the flow run's name, as the UI shows it
    flow: str = "hsx-extract"

    @property
    def record_id(self) -> str:
        return f"{self.run_id}-attempt-{self.attempt}"


def run_parity(settings: HsxSettings) -> dict[str, Any] | None:
    """What this run's record says of its states' parity with HF (hsx.model.families): the
    model's family, its status on vLLM's CPU build, whether preflight's probe compared it with
    HF, and a warning when nothing established parity. None when config.json does not read:
    the record is written all the same."""
    import torch

    from hsx.errors import ConfigError
    from hsx.model.config import read_config
    from hsx.model.families import parity_note

    try:
        config = read_config(settings.model)
    except ConfigError:
        return None
    # The probe runs with preflight (a served engine's server ran it when it started).
    return parity_note(config, settings.run.preflight, bool(torch.cuda.is_available()))


def record_attempt(
    settings: HsxSettings, attempt: RunAttempt, status: str, fields: dict[str, Any]
) -> str:
    """Write (or update, while it runs) this attempt's record; returns where it went."""
    now = time.time()
    record = {
        "run_id": attempt.run_id,
        "attempt": attempt.attempt,
        "flow": attempt.flow,
        "flow_run_name": attempt.name,
        "status": status,
        "started_at": iso_time(attempt.started_at),
        "ended_at": None if status == "running" else iso_time(now),
        "seconds": round(now - attempt.started_at, 2),
        "code_version": code_version(),
        "settings": settings.model_dump(mode="json"),
        "recorded_at": now,
        "parity": run_parity(settings),
        **fields,
    }
    if existing_store_meta(settings.store) is not None:
        ExtractionStore.open(settings.store, mode="r+").write_run_record(attempt.record_id, record)
        return f"{settings.store}/runs/{attempt.record_id}.json"
    fs, root = fs_and_root(settings.store)
    path = f"{root}{BESIDE_SUFFIX}/{attempt.record_id}.json"
    payload = json.dumps(record, indent=1, sort_keys=True, default=str).encode()
    write_atomic(fs, path, payload, durable=True, store=settings.store)
    return path


def records_beside(url: str) -> list[dict[str, Any]]:
    """Records of runs that failed before the store at ``url`` existed, oldest first."""
    fs, root = fs_and_root(url)
    folder = f"{root}{BESIDE_SUFFIX}"
    if not exists(fs, url, folder):
        return []
    listing = store_io(fs, url, folder, "list", lambda: fs.ls(folder, detail=False))
    records = [
        json.loads(store_io(fs, url, str(path), "read", lambda p=path: fs.cat_file(p)))
        for path in sorted(listing)
        if str(path).endswith(".json")
    ]
    return sorted(records, key=lambda r: r.get("recorded_at", 0))
