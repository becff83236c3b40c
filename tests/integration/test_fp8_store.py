"""fp8 stores through the real engine (tiny Llama, fp32 engine): the states of one run stored
plain and as fp8 differ within fp8's documented bound and no more; half the bytes of bf16
(plus 4 bytes of scale per token and layer); the reader's raw fp8 and scales; verify finds a
flipped byte in the payload and in the scales, and --repair rewrites them; a resume that
changes capture.store_dtype is refused naming both values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsx.errors import StoreError
from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import ExtractionRun
from hsx.extraction.steps import plan_and_create_store
from hsx.store.fp8_states import SCALES_ARRAY, dequantize, error_bound
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.cli import hsx, said
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
SAMPLES = 16


def _extract(model: Path, dataset: Path, url: str, store_dtype: str) -> str:
    settings = make_settings(
        model,
        dataset,
        url,
        data={"max_samples": SAMPLES},
        capture={"store_dtype": store_dtype},
    )
    summary = plan_and_create_store(settings)
    with ExtractionRun.open(settings) as run:
        for index in summary.pending:
            run.extract(index, RunContext(f"fp8-test-{store_dtype}"))
    return url


@pytest.fixture(scope="module")
def stores(
    tiny_llama: Path, sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    return {
        dtype: _extract(tiny_llama, sample_dataset, str(root / f"{dtype}.zarr"), dtype)
        for dtype in ("float32", "fp8_e4m3")
    }


def test_fp8_states_are_the_plain_states_within_the_bound(stores: dict[str, str]) -> None:
    plain, fp8 = HiddenStatesReader(stores["float32"]), HiddenStatesReader(stores["fp8_e4m3"])
    raw = HiddenStatesReader(stores["fp8_e4m3"], dequantize=False)
    assert fp8.logical_dtype == "float32" and fp8.store.state_encoding == "fp8_e4m3"
    assert fp8.available_samples.tolist() == plain.available_samples.tolist() != []
    worst_relative = torch.zeros(len(plain.layer_ids))
    batch = fp8.samples(fp8.available_samples.tolist())  # the batch path reads scales too
    for index, batched in zip(fp8.available_samples.tolist(), batch, strict=True):
        expected = plain.sample(index).hidden_states  # [tokens, K, H] float32
        found = fp8.sample(index)
        assert found.hidden_states.dtype == torch.float32
        assert torch.equal(found.hidden_states, batched.hidden_states)
        assert found.input_ids.equal(plain.sample(index).input_ids)
        stored = raw.sample(index)
        assert stored.hidden_states.dtype == torch.float8_e4m3fn and stored.scales is not None
        assert stored.scales.shape == expected.shape[:-1]
        assert torch.equal(
            dequantize(stored.hidden_states.view(torch.uint8), stored.scales, torch.float32),
            found.hidden_states,
        )
        error = (found.hidden_states - expected).abs()
        assert bool((error <= error_bound(expected, stored.scales)).all()), f"sample {index}"
        per_vector = error.amax(-1) / expected.abs().amax(-1)  # [tokens, K]
        worst_relative = torch.maximum(worst_relative, per_vector.amax(0))
    # Relative to each vector's largest value: half of e4m3's step at 448 is 16/448.
    assert bool((worst_relative <= 16 / 448 + 1e-6).all()), worst_relative
    assert bool((worst_relative > 0.01).all()), "fp8 should not be lossless"


def test_fp8_stores_half_the_bytes_of_bf16(stores: dict[str, str]) -> None:
    store = ExtractionStore.open(stores["fp8_e4m3"], mode="r")
    root = Path(stores["fp8_e4m3"])
    k, h = int(store.meta["num_layers_captured"]), int(store.meta["hidden_size"])
    rows = sum(c.row_end - c.row_start for c in store.work_chunks)
    stored = sum(
        path.stat().st_size
        for name in ("hidden_states", SCALES_ARRAY)
        for path in (root / name).glob("c.*")
    )
    assert stored == rows * k * (h + 4)  # fp8 bits plus one float32 scale per vector
    assert stored / (rows * k * h * 2) <= 0.53  # against bf16 (H = 256: (256 + 4) / 512)
    info = hsx("info", stores["fp8_e4m3"])
    assert info.returncode == 0 and "fp8_e4m3 (read as float32)" in said(info), said(info)


def test_verify_finds_flipped_payload_and_scales_and_repair_rewrites_them(
    stores: dict[str, str], tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    import shutil

    url = str(tmp_path / "copy.zarr")
    shutil.copytree(stores["fp8_e4m3"], url)
    store = ExtractionStore.open(url)
    assert verify_store(store).ok
    before = HiddenStatesReader(url).sample(0).hidden_states
    chunks = store.work_chunks
    step = store.rows_per_chunk
    victims = {
        "hidden_states": Path(url, "hidden_states", f"c.{chunks[0].row_start // step}.0.0"),
        SCALES_ARRAY: Path(url, SCALES_ARRAY, f"c.{chunks[1].row_start // step}.0"),
    }
    for victim in victims.values():
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0x04
        victim.write_bytes(bytes(data))
    report = verify_store(ExtractionStore.open(url))
    assert not report.ok
    found = {(p.chunk_index, p.message.split(" rows")[0]) for p in report.problems}
    assert found == {(0, "hidden_states"), (1, SCALES_ARRAY)}, report.problems
    repair = subprocess.run(
        [
            *(sys.executable, "-m", "flows.cli", "verify", url, "--repair"),
            *("--model", str(tiny_llama), "--dataset", str(sample_dataset)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=400,
    )
    assert repair.returncode == 0, (repair.stdout + repair.stderr)[-3000:]
    assert verify_store(ExtractionStore.open(url)).ok
    assert torch.equal(HiddenStatesReader(url).sample(0).hidden_states, before)


def test_a_resume_that_changes_the_stored_dtype_is_refused(
    stores: dict[str, str], tiny_llama: Path, sample_dataset: Path
) -> None:
    settings = make_settings(
        tiny_llama,
        sample_dataset,
        stores["fp8_e4m3"],
        data={"max_samples": SAMPLES},
        capture={"store_dtype": "float32"},
    )
    with pytest.raises(StoreError) as refused:
        plan_and_create_store(settings)
    message = str(refused.value)
    assert "state_encoding (capture.store_dtype): stored 'fp8_e4m3', this run 'plain'" in message
