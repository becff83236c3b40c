"""The extraction's steps as plain functions (datatrove-style: they know nothing of the executor).

Prefect tasks call these; so can a script. State shared between steps lives in the store (plan,
commit records) and in a per-process cache of what is expensive to rebuild (tokenizer, engine),
never in task inputs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.errors import StoreError
from hsx.extraction.run import run_spec
from hsx.model.config import read_config
from hsx.model.limits import resolve_lengths
from hsx.plan.building import (
    build_plan,
    load_tokenizer,
    store_metadata,
)
from hsx.plan.chunks import Plan
from hsx.plan.frozen_inputs import check_frozen, frozen_inputs
from hsx.store.layout_copy import repair_metadata
from hsx.store.storage_io import free_bytes_at
from hsx.store.verify import VerifyReport, repair_store, verify_store
from hsx.store.zarr_store import (
    ExtractionStore,
    bytes_per_row,
    check_store_url,
    existing_store_meta,
    fs_and_root,
)
from settings import HsxSettings

logger = logging.getLogger(__name__)


def resolve_settings(settings: HsxSettings) -> HsxSettings:
    """The settings with every model-derived default filled in (max_model_len, max_length):
    what the run records and every task uses, so all build the same engine."""
    return resolve_lengths(settings, read_config(settings.model))


def check_resume(settings: HsxSettings) -> bool:
    """On an existing store, refuse in seconds a run that would write other data (a changed
    model, weights, revision, layer ids, lengths, dataset, tokenizer, chat template or dtype)
    or cut other work chunks (an explicit layout setting), naming each change with both
    values. Returns whether the store exists (a resume)."""
    meta = existing_store_meta(settings.store)
    if meta is None:
        return False
    spec = run_spec(settings)
    current = frozen_inputs(
        spec.settings,
        spec.config,
        _tokenizer(str(settings.model)),
        spec.layer_ids,
        spec.engine_dtype,
        spec.stored_dtype,
    )
    layout = settings.layout
    planned = meta.get("plan_inputs", {})
    layout_changes = [
        f"layout.{name}: stored {stored}, this run {wanted}"
        for name, wanted, stored in (
            ("rows_per_chunk", layout.rows_per_chunk, meta.get("rows_per_chunk")),
            ("work_chunk_tokens", layout.work_chunk_tokens, planned.get("work_chunk_tokens")),
        )
        if wanted is not None and stored is not None and wanted != stored
    ]
    if layout_changes:
        raise StoreError(
            f"store {settings.store} was cut into other work chunks; a resume keeps the store's "
            "layout. Changed: " + "; ".join(layout_changes) + ". Leave these settings unset "
            "(the store's layout is used) or use a new store URL."
        )
    check_frozen(settings.store, meta, current)
    return True


def _tokenizer(model_dir: str) -> Any:
    """The model folder's tokenizer, loaded once per version of its files in this process (a
    long-lived worker must see a tokenizer that changed: the resume check compares it)."""
    folder = Path(model_dir)
    stamp = tuple(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )
    return _tokenizer_of(model_dir, stamp)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(model_dir: str, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    return load_tokenizer(Path(model_dir))


@dataclass
class PlanSummary:
    store_url: str
    samples: int
    tokens: int
    chunks: int
    pending: list[int]
    plan_hash: str
    samples_truncated: int = 0  # longer than data.max_length: cut to it
    samples_left_out: int = 0  # longer than data.max_length: skipped (data.on_overlength)


def plan_and_create_store(settings: HsxSettings) -> PlanSummary:
    """Validate the dataset, plan, and open or create the store at its final size."""
    # Planning reads every line: the first bad one fails the run here, before any load and before
    # anything is written (the CLI also validates before Prefect starts).
    spec = run_spec(settings)
    settings = spec.settings
    check_store_url(settings.store)
    tokenizer = _tokenizer(str(settings.model))
    frozen = frozen_inputs(
        settings, spec.config, tokenizer, spec.layer_ids, spec.engine_dtype, spec.stored_dtype
    )
    plan = build_plan(
        settings,
        tokenizer,
        spec.config,
        spec.layer_ids,
        spec.stored_dtype,
        dataset_fingerprint=frozen["dataset_fingerprint"],
    )
    meta = store_metadata(
        settings, spec.config, spec.layer_ids, spec.engine_dtype, spec.stored_dtype
    )
    meta["frozen_inputs"] = frozen
    try:
        check_free_space(settings.store, plan, meta)
        existing = existing_store_meta(settings.store)
        if existing is not None:  # the flow checked before its probe; a script may not have
            check_frozen(settings.store, existing, frozen)
        store = ExtractionStore.open_or_create(settings.store, plan, meta)
        if existing is not None:
            # Token rows of chunks not committed are written again from the plan: a repair
            # drops the commit of a chunk whose input_ids or loss_mask object was corrupt, and
            # re-extraction reads (and checksums) those rows.
            store.write_token_rows(plan, store.pending_chunks())
            if store.sample_index_problems():  # a flipped byte verify found: from the plan
                store.write_sample_index(plan)
    finally:
        plan.close()  # the token spool is in the store now (or the run failed): delete it
    pending = [chunk.index for chunk in store.pending_chunks()]
    logger.info(
        "dataset %s: %d conversations; store %s: %d of %d work chunks pending",
        settings.dataset,
        plan.num_samples,
        settings.store,
        len(pending),
        len(plan.chunks),
    )
    return PlanSummary(
        settings.store,
        plan.num_samples,
        plan.total_tokens,
        len(plan.chunks),
        pending,
        plan.plan_hash,
        len((plan.overlength or {}).get("truncated", [])),
        len((plan.overlength or {}).get("skipped", [])),
    )


def check_free_space(url: str, plan: Plan, meta: dict[str, Any]) -> None:
    """Refuse a new local store that cannot fit: terabytes of output must not fail at 90%."""
    free = free_bytes_at(url)
    if free is None or Path(url.removeprefix("file://"), "zarr.json").exists():
        return  # remote (unknown) or resuming an existing store
    needed = plan.total_rows * bytes_per_row(meta)
    folder, available = free
    if needed > available:
        raise StoreError(
            f"store {url}: expected {needed / 2**30:,.2f} GiB free for {plan.total_rows:,} rows, "
            f"found {available / 2**30:,.2f} GiB at {folder}"
        )


def verify(
    store_url: str, repair: bool = False, readers: int | None = None, only: set[int] | None = None
) -> tuple[VerifyReport, dict[int, list[str]]]:
    """Verify the store (``only``: those chunks); with ``repair``, drop the commit records of
    corrupt chunks (the caller re-extracts them). Returns the report and the dropped chunks."""
    repaired: list[str] = []
    if repair:  # before zarr reads them: a damaged document may not even open
        fs, root = fs_and_root(store_url)
        repaired = repair_metadata(fs, root, store_url)
        if repaired:
            logger.warning("repair: rewrote %s of %s from its layout copy", repaired, store_url)
    store = ExtractionStore.open(store_url, mode="r+" if repair else "r")
    report = verify_store(store, only=only, readers=readers)
    report.metadata_repaired = repaired
    return report, (repair_store(store, report) if repair else {})
