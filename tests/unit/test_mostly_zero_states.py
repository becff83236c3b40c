"""The hybrid failure class (vLLM PR #51328: 70%+ zeros and NaN states on hybrid linear/full
attention models): a layer whose values are mostly exactly zero, though no state vector is
wholly zero, fails its chunk naming the layer and the sample, in bf16 and float32 stores."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.engine.capture_checks import MOSTLY_ZERO_FRACTION, CapturedDataError, SampleScan
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.store.zarr_store import ExtractionStore
from tests.unit.test_plan_store import H, StatesEngine, make_plan, meta

pytestmark = pytest.mark.timeout(120)
LENGTHS = [20, 30, 25, 18]
VICTIM = 1  # StatesEngine's first token id of sample i is 100*i % 997


class MostlyZeroEngine(StatesEngine):
    """StatesEngine's states, with 75% of layer index 1's values zeroed in one sample (every
    vector keeps a quarter of its values: no vector is all zero)."""

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        out = super().extract(prompts)
        for states, prompt in zip(out, prompts, strict=True):
            if int(prompt[0]) == 100 * VICTIM:
                states[:, 1, : (3 * H) // 4] = 0.0
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mostly_zero_layer_fails_its_chunk_naming_layer_and_sample(
    host: HostPipeline, tmp_path: Path, dtype: str
) -> None:
    plan = make_plan(LENGTHS, c=16, work=200)
    store = ExtractionStore.open_or_create(
        str(tmp_path / f"{uuid.uuid4().hex}.zarr"), plan, meta(dtype)
    )
    chunk = plan.chunks[0]
    assert chunk.sample_start <= VICTIM < chunk.sample_end
    with pytest.raises(CapturedDataError, match=r"mostly zero states: .* layer id 2 75%") as failed:
        extract_chunk(host, store, chunk, MostlyZeroEngine(), 60, RunContext("r"))
    assert failed.value.sample == VICTIM and f"sample {VICTIM}:" in str(failed.value)
    assert "all-zero" not in str(failed.value)  # no vector of it is all zero
    assert store.read_commit(chunk.index) is None


def test_the_share_is_per_layer_over_the_whole_sample() -> None:
    """Zeros add up per layer over the sample's blocks: half a layer's values passes, more
    fails, naming the layer and its share; zeros of a real state (a few) count for nothing."""
    scan = SampleScan((1, 2), tokens=8)
    block = np.ones((4, 2, 10), dtype=np.float32)
    block[:, 0, :5] = 0.0  # layer id 1: 50% zero
    scan.add(block, 0)
    scan.add(block, 4)
    assert MOSTLY_ZERO_FRACTION == 0.5 and scan.problem() is None
    block[:, 0, 5] = 0.0  # 60%
    scan.add(block, 8)
    scan.add(block, 12)
    assert "layer id 1 55%" in str(scan.problem())
    few = SampleScan((1, 2), tokens=4)
    sparse = np.ones((4, 2, 10), dtype=np.float32)
    sparse[0, 1, 3] = 0.0
    few.add(sparse, 0)
    assert few.problem() is None and few.layer_zero_values.tolist() == [0, 0]
