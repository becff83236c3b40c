"""Non-finite states from the real vLLM engine: a tiny Llama whose layer 3 MLP weights hold a
NaN computes NaN states from layer id 4 on. The chunk fails naming the sample, the reason and the
first bad layer; with on_bad_states=skip it commits with every sample recorded as skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hsx.engine.capture_checks import CapturedDataError
from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import extract_work_chunk
from hsx.extraction.steps import plan_and_create_store
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nan_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    model = tmp_path_factory.mktemp("nan-llama") / "model"
    shutil.copytree(tiny_llama, model)
    weights = load_file(model / "model.safetensors")
    name = next(n for n in weights if n.endswith("layers.3.mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_nan_states_fail_the_chunk_or_are_skipped(
    nan_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from hsx.engine.vllm_engine import close_all_engines

    url = str(tmp_path / "nan.zarr")
    settings = make_settings(nan_llama, sample_dataset, url, data={"max_samples": 6})
    try:
        plan_and_create_store(settings)
        with pytest.raises(CapturedDataError) as failed:
            extract_work_chunk(settings, 0, RunContext("fail-run"))
        message = str(failed.value)
        assert "chunk-000000, sample 0: non-finite values (inf/NaN)" in message, message
        assert "layer id 4" in message and "on_bad_states=skip" in message, message
        store = ExtractionStore.open(url)
        assert store.read_commit(0) is None

        skipping = settings.model_copy(
            update={"capture": settings.capture.model_copy(update={"on_bad_states": "skip"})}
        )
        for chunk in store.work_chunks:
            record = extract_work_chunk(skipping, chunk.index, RunContext("skip-run"))
            assert record is not None
            skipped = [entry["sample"] for entry in record.skipped_samples]
            assert skipped == list(range(chunk.sample_start, chunk.sample_end))
            assert all("layer id 4" in entry["reason"] for entry in record.skipped_samples)
        report = verify_store(store)
        assert report.ok and len(report.skipped_samples) == 6, report.summary()
        assert len(HiddenStatesReader(url)) == 0
    finally:
        close_all_engines()
