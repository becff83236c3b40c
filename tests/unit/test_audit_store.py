"""The audit on real stores written through hsx's writer (tests/audit_models.py: states built so
that the final layer predicts each next token through the model's own norm and head, as greedy
data would): a clean store passes, each planted defect is named by chunk and sample, fp8, tied
embeddings, memory:// and an older layout work, and bad input is refused before any work."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zarr

from hsx.audit import StoreAudit, audit_store
from hsx.audit.scope import greedy_provenance, select_chunks
from hsx.engine.homes import engine_queue_limit
from hsx.errors import ConfigError, StoreError
from hsx.extraction.host_pipeline import HostPipeline
from hsx.plan.building import config_hash
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import HSX_ATTR, ExtractionStore
from hsx.trainers.final_norm import load_final_norm
from settings import PipelineSettings
from tests import audit_defects
from tests.audit_models import LAYER_IDS, greedy_dataset, write_model, write_store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pipeline() -> Iterator[HostPipeline]:
    with HostPipeline(PipelineSettings(), engine_queue_limit(4096, None)) as host:
        yield host


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("audit") / "model")


@pytest.fixture(scope="module")
def greedy_store(
    pipeline: HostPipeline, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    root = tmp_path_factory.mktemp("audit-store")
    return write_store(
        pipeline, str(root / "greedy.zarr"), model, greedy_dataset(root / "regen", model)
    )


def test_a_greedy_store_agrees_exactly_and_its_states_are_aligned(greedy_store: str) -> None:
    report = audit_store(greedy_store)
    assert report.ok, [f.message for f in report.findings]
    assert report.greedy["exact"] and report.greedy_check.positions > 100
    assert report.greedy_check.agree == report.greedy_check.positions
    assert report.alignment.startswith("aligned")
    assert report.chunks_audited == report.chunks_committed == len(report.chunks) >= 5
    assert [layer.layer_id for layer in report.layers] == list(LAYER_IDS)
    assert all(layer.nan == layer.zero == layer.repeated == 0 for layer in report.layers)
    assert report.data.samples == 10 and 0.4 < report.data.masked_tokens / report.data.tokens < 0.6
    json.dumps(report.to_json())  # the report is JSON as it is


def _plant(kind: str, url: str, model: Path) -> audit_defects.Planted:
    if kind == "post-norm":
        norm = load_final_norm(model)
        return audit_defects.apply_final_norm(url, norm.weight.numpy(), norm.eps)
    plant = {
        "shifted": audit_defects.shift_states,
        "zero-vectors": audit_defects.zero_layer,
        "swapped": audit_defects.swap_samples,
        "nan-vectors": audit_defects.nan_vector,
        "wrong-order": audit_defects.reverse_layers,
        "rows-short": audit_defects.cut_rows,
    }[kind]
    return plant(url)


# defect -> (the finding's kind, what its message must say)
DEFECTS = {
    "shifted": ("shifted", r"states are shifted by -1 \(the state at row t predicts token t,"),
    "zero-vectors": ("zero-vectors", r"layer id 2: (\d+) of \1 all-zero vectors"),
    "swapped": ("greedy-disagreement", r"sample (\d+) holds the states of sample (\d+)"),
    "nan-vectors": ("nan-vectors", r"layer id 1: 1 of \d+ NaN vectors .*position 3"),
    "post-norm": ("post-norm", r"looks post-norm: RMS of state / norm weight is 1"),
    "wrong-order": ("greedy-disagreement", r"generated positions do not predict the next token"),
    "rows-short": ("rows-short", r"states cover (\d+) of its (\d+) tokens .*last 5 rows"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_planted_defect_is_named_by_chunk_and_sample(
    defect: str, greedy_store: str, model: Path, tmp_path: Path
) -> None:
    url = audit_defects.copy_store(greedy_store, tmp_path / "copy.zarr")
    planted = _plant(defect, url, model)
    assert verify_store(ExtractionStore.open(url)).ok  # the bytes check out: only meaning is off
    report = audit_store(url)
    kind, message = DEFECTS[defect]
    found = [f for f in report.errors if f.kind == kind and re.search(message, f.message)]
    assert found, [f.message for f in report.findings]
    assert found[0].chunks == [planted.chunk], found[0].message
    assert f"chunk {planted.chunk}" in found[0].message
    assert set(found[0].samples) & set(planted.samples), (found[0].samples, planted)
    other_chunks = {c for f in report.errors for c in f.chunks} - {planted.chunk}
    assert not other_chunks, [f.message for f in report.errors]


def test_an_fp8_store_is_audited_through_its_scales(
    pipeline: HostPipeline, model: Path, tmp_path: Path
) -> None:
    url = write_store(
        pipeline,
        str(tmp_path / "fp8.zarr"),
        model,
        greedy_dataset(tmp_path / "regen", model),
        "fp8_e4m3",
    )
    report = audit_store(url)
    assert report.ok and report.greedy_check.disagree == 0, [f.message for f in report.findings]
    assert report.greedy_check.agree + report.greedy_check.ties == report.greedy_check.positions
    assert all(layer.scale_min is not None and layer.scale_max for layer in report.layers)


def test_tied_embeddings_are_the_head(pipeline: HostPipeline, tmp_path: Path) -> None:
    tied = write_model(tmp_path / "tied", tied=True)
    url = write_store(
        pipeline, str(tmp_path / "tied.zarr"), tied, greedy_dataset(tmp_path / "regen", tied)
    )
    report = audit_store(url)
    assert report.head is not None and report.head["tied"]
    assert report.head["tensor"] == "model.safetensors:model.embed_tokens.weight"
    assert report.ok and report.greedy_check.agree == report.greedy_check.positions > 0


def test_a_store_in_memory_and_an_older_layout_are_audited(
    pipeline: HostPipeline, model: Path, tmp_path: Path
) -> None:
    memory = write_store(pipeline, "memory://hsx-audit-test/store.zarr", model)
    report = audit_store(memory)
    assert report.ok and report.masked.rate() == 1.0 and not report.greedy["exact"]
    # A store of an hsx before token objects, sample-index digests and hsx-layout.json.
    older = write_store(pipeline, str(tmp_path / "older.zarr"), model, token_rows=16)
    group = zarr.open_group(older, mode="r+")
    attrs = dict(group.attrs[HSX_ATTR])
    for key in ("token_rows_per_object", "sample_index_checksums"):
        attrs.pop(key)
    group.attrs[HSX_ATTR] = attrs
    (tmp_path / "older.zarr" / "hsx-layout.json").unlink()
    assert ExtractionStore.open(older).object_rows("input_ids") == 16
    report = audit_store(older)
    assert report.ok and report.rows_read == 303, [f.message for f in report.findings]


def test_a_budget_of_positions_reaches_every_chunk_it_can(greedy_store: str) -> None:
    reader = HiddenStatesReader(greedy_store)
    every = select_chunks(reader, 0)
    assert sum(s.positions for s in every) == 303 and all(s.windows for s in every)
    spread = select_chunks(reader, 7 * 32)
    assert all(s.windows for s in spread) and sum(s.positions for s in spread) <= 7 * 32 + 7
    few = select_chunks(reader, 64)  # two chunks' worth: two chunks, far apart
    assert [s.chunk for s in few if s.windows] == [0, 3]
    assert all(s.samples for s in few)  # the data's shape still covers every chunk
    ranged = select_chunks(reader, 0, "2:5")
    assert sorted(x for s in ranged for x in s.samples) == [2, 3, 4]
    report = audit_store(greedy_store, positions=64)
    assert report.ok and report.rows_read <= 64 + 32


def test_bad_input_is_refused_before_any_state_is_read(
    pipeline: HostPipeline, model: Path, greedy_store: str, tmp_path: Path
) -> None:
    other = write_model(tmp_path / "other", seed=1)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 128  # another model: its config digest differs
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError,
        match=r"expected the model the store was extracted with \(config digest \w+\), found \w+",
    ):
        StoreAudit(greedy_store, other)
    headless = write_model(tmp_path / "headless", head=False)
    url = write_store(pipeline, str(tmp_path / "headless.zarr"), headless, chunks=1)
    with pytest.raises(ConfigError, match=r"no LM head weights found: expected 'lm_head.weight'"):
        StoreAudit(url)
    empty = write_store(pipeline, str(tmp_path / "empty.zarr"), model, chunks=0)
    with pytest.raises(
        StoreError,
        match=r"expected committed samples to audit in 0:10, found none \(0 chunks committed of \d+, 0 samples skipped at extraction\): nothing to audit",
    ):
        StoreAudit(empty)
    with pytest.raises(
        StoreError, match=r"--samples: expected a range within the store's 10 samples"
    ):
        StoreAudit(greedy_store, samples="20:30")


@pytest.mark.parametrize(
    ("sampling", "exact", "reason"),
    [
        ({"temperature": 0}, True, "regenerated greedily by this model"),
        ({"temperature": 0.7}, False, "not greedy"),
        ({"temperature": 0, "repetition_penalty": 1.2}, False, "repetition_penalty=1.2"),
        ({"temperature": 0, "logit_bias": {"3": 5}}, False, "logit_bias"),
    ],
)
def test_greedy_data_is_known_from_its_regeneration_manifest(
    sampling: dict[str, Any], exact: bool, reason: str, model: Path, tmp_path: Path
) -> None:
    folder = greedy_dataset(tmp_path / "regen", model, sampling)
    store_meta = {
        "dataset": str(folder),
        "model": {"config_hash": config_hash(json.loads((model / "config.json").read_text()))},
    }
    found = greedy_provenance(store_meta)
    assert found.exact is exact and reason in found.reason
    other = greedy_provenance({**store_meta, "model": {"config_hash": "0" * 16}})
    assert not other.exact and "regenerated by another model" in other.reason


def test_rows_read_in_place_are_the_rows_and_a_missing_object_is_named(
    pipeline: HostPipeline, model: Path, greedy_store: str, tmp_path: Path
) -> None:
    """The sampled reader of the end-of-run audit: a few rows' bytes out of each object."""
    import numpy as np

    memory = write_store(pipeline, "memory://hsx-audit-test/in-place.zarr", model)
    for url in (greedy_store, memory):
        store = ExtractionStore.open(url)
        for name in store.row_arrays:
            for start, end in ((0, 1), (3, 17), (15, 49), (100, 160), (290, 303)):
                expected = store.read_rows(name, start, end)
                assert np.array_equal(store.read_rows_in_place(name, start, end), expected)
    url = audit_defects.copy_store(greedy_store, tmp_path / "missing.zarr")
    (tmp_path / "missing.zarr" / "hidden_states" / "c.2.0.0").unlink()
    with pytest.raises(
        StoreError,
        match=r"hidden_states rows \[35, 48\): expected storage object .*c\.2\.0\.0, found none",
    ):
        ExtractionStore.open(url).read_rows_in_place("hidden_states", 35, 60)
