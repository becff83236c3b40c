"""Captured states are checked before commit, on real Zarr stores: non-finite values, an all-zero
layer or state vector, a row count other than planned, a refused capture (token ids). Each fails
the chunk naming the sample and the reason, or with on_bad_states=skip commits the chunk with the
sample recorded as skipped, which readers and verify then show."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.engine.capture_checks import CapturedDataError, SampleScan, check_token_ids
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.unit.test_plan_store import StatesEngine, make_plan, meta

pytestmark = pytest.mark.timeout(120)
LAYER_IDS = (1, 2, 4)  # meta()'s


class FaultyEngine(StatesEngine):
    """StatesEngine's states, with one fault in the prompt whose first token id is ``victim``."""

    def __init__(self, victim: int, fault: str) -> None:
        self.victim, self.fault = victim, fault

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        out = super().extract(prompts)
        for i, prompt in enumerate(prompts):
            if int(prompt[0]) != self.victim:
                continue
            if self.fault == "nan":
                out[i][3, 1, 5] = float("nan")
            elif self.fault == "inf":
                out[i][0, 2, 0] = float("-inf")
            elif self.fault == "zero layer":
                out[i][:, 2] = 0.0
            elif self.fault == "zero vector":
                out[i][4, 0] = 0.0
            elif self.fault == "rows":
                out[i] = out[i][:-1]
        return out


REASONS = {
    "nan": r"non-finite values \(inf/NaN\) at 1 of \d+ \(token, layer\) positions, first at token 3, layer id 2",
    "inf": r"non-finite values .* first at token 0, layer id 4",
    "zero layer": r"all-zero states at every token of layer id\(s\) \[4\]",
    "zero vector": r"all-zero state vectors at 1 of \d+ .* first at token 4, layer id 1",
    "rows": r"captured \d+ rows, expected \d+ as planned",
}
LENGTHS = [20, 30, 25, 18, 40, 22]
VICTIM = 2  # sample 2; StatesEngine's first token id of sample i is 100*i % 997


def _store(tmp_path: Path, dtype: str = "float32") -> tuple[ExtractionStore, object]:
    plan = make_plan(LENGTHS, c=16, work=200)
    store = ExtractionStore.open_or_create(
        str(tmp_path / f"{uuid.uuid4().hex}.zarr"), plan, meta(dtype)
    )
    return store, plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fault", sorted(REASONS))
def test_a_bad_sample_fails_its_chunk_naming_sample_and_reason(
    host: HostPipeline, tmp_path: Path, fault: str, dtype: str
) -> None:
    store, plan = _store(tmp_path, dtype)
    chunk = plan.chunks[0]
    assert chunk.sample_start <= VICTIM < chunk.sample_end
    with pytest.raises(CapturedDataError, match=REASONS[fault]) as failed:
        extract_chunk(host, store, chunk, FaultyEngine(100 * VICTIM, fault), 60, RunContext("r"))
    assert failed.value.sample == VICTIM and f"sample {VICTIM}:" in str(failed.value)
    assert failed.value.retryable  # a device fault or a leak may not repeat
    assert store.read_commit(chunk.index) is None  # nothing committed


@pytest.mark.parametrize("fault", sorted(REASONS))
def test_skip_records_the_sample_and_readers_leave_it_out(
    host: HostPipeline, tmp_path: Path, fault: str
) -> None:
    store, plan = _store(tmp_path)
    for chunk in plan.chunks:
        extract_chunk(
            host,
            store,
            chunk,
            FaultyEngine(100 * VICTIM, fault),
            60,
            RunContext("r"),
            bad_states="skip",
        )
    record = store.read_commit(plan.chunks[0].index)
    assert record is not None
    assert [entry["sample"] for entry in record.skipped_samples] == [VICTIM]
    assert re.search(REASONS[fault], record.skipped_samples[0]["reason"])
    reader = HiddenStatesReader(store.url)
    assert VICTIM not in reader.available_samples.tolist()
    assert len(reader) == len(LENGTHS) - 1
    assert re.search(REASONS[fault], reader.skipped_samples[VICTIM])
    with pytest.raises(Exception, match="skipped at extraction"):
        reader.sample(VICTIM)
    report = verify_store(store)
    assert report.ok and report.skipped_samples.keys() == {VICTIM}
    assert "1 samples skipped" in report.summary()


def test_off_checks_nothing(host: HostPipeline, tmp_path: Path) -> None:
    store, plan = _store(tmp_path)
    chunk = plan.chunks[0]
    record = extract_chunk(
        host, store, chunk, FaultyEngine(100 * VICTIM, "nan"), 60, RunContext("r"), bad_states="off"
    )
    assert record.skipped_samples == []
    assert torch.isnan(HiddenStatesReader(store.url).sample(VICTIM).hidden_states).any()


def test_good_states_pass_and_bits_are_read_right() -> None:
    scan = SampleScan(LAYER_IDS, tokens=4)
    states = np.full((4, 3, 8), 1e-30, dtype=np.float32)  # tiny but not zero
    states[2, 1, 7] = -np.finfo(np.float32).max  # the largest finite magnitude
    scan.add(states, 0)
    assert scan.problem() is None
    bf16 = torch.full((4, 3, 8), -0.0).to(torch.bfloat16)  # negative zero is zero
    bf16[:, :, :4] = 3.0  # half the values: more zeros fail as a mostly-zero layer
    scan = SampleScan(LAYER_IDS, tokens=4)
    scan.add(bf16.view(torch.int16).numpy().view(np.uint16), 0)
    assert scan.problem() is None


def test_token_ids_other_than_planned_are_named() -> None:
    assert check_token_ids("r1", [5, 6, 7], [5, 6, 7]) is None
    shifted = check_token_ids("r1", [5, 6, 7], [1, 5, 6, 7])
    assert (
        shifted is not None
        and "3 planned token ids, found 4 ids differing from position 0" in shifted
    )
