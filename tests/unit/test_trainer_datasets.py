"""hsx's training datasets over a store in DataLoader workers (fork and spawn: each worker opens
the store itself), and the length-grouped sampler's sharding by rank. (That each item equals
the trainer's own reader's item: tests/integration/test_trainer_exports.py.)"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.store.zarr_store import ExtractionStore
from hsx.trainers.datasets import LengthGroupedSampler, ModelOptDataset, SpeculatorsDataset
from tests.conftest import REPO_ROOT
from tests.unit.test_plan_store import StatesEngine, committed_store, make_plan, meta

pytestmark = pytest.mark.timeout(180)


# Run in a fresh interpreter: forking the test process, which may hold a vLLM CPU engine and its
# bound threads from earlier tests, is what users must not do either; a trainer's process is new.
_WORKERS = """
import sys, torch
from torch.utils.data import DataLoader
from hsx.store.reader import HiddenStatesReader
from hsx.trainers.datasets import SpeculatorsDataset
url, context = sys.argv[1], sys.argv[2]
dataset = SpeculatorsDataset(url)
assert dataset._reader is not None  # open here; each worker opens its own
loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
reader = HiddenStatesReader(url)
items = list(loader)
assert len(items) == 4, len(items)
for position, item in enumerate(items):
    sample = reader.sample(int(dataset.samples[position]))
    assert torch.equal(item["hidden_states"], sample.aux_hidden_states), position
    assert torch.equal(item["verifier_last_hidden_states"], sample.target_hidden_states), position
    assert torch.equal(item["input_ids"], sample.input_ids), position
    assert item["lengths"].tolist() == [sample.input_ids.shape[0]], position
print("WORKERS OK", len(items))
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_items_in_workers_equal_the_reader(
    host: HostPipeline, tmp_path: Path, context: str
) -> None:
    url = str(tmp_path / "store")
    committed_store(host, url)
    done = subprocess.run(
        [sys.executable, "-c", _WORKERS, url, context],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0 and "WORKERS OK 4" in done.stdout, done.stdout + done.stderr


def test_a_batch_reads_each_storage_object_once(host: HostPipeline, tmp_path: Path) -> None:
    """Eight short samples packed in objects of 16 rows (two or three share an object, some
    span two): read one by one they open shared objects again; as one batch, each once."""
    url = str(tmp_path / "store")
    plan = make_plan([6, 9, 7, 12, 5, 10, 8, 11], c=16, work=80)
    store = ExtractionStore.open_or_create(url, plan, meta())
    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, StatesEngine(), 100, RunContext("r"))
    dataset = SpeculatorsDataset(url)
    order = [5, 0, 7, 2, 3, 6, 1, 4]
    folder = str(Path(url) / "hidden_states")
    opened: list[str] = []
    armed = [False]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if armed[0] and event == "open" and str(args[0]).startswith(folder):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    armed[0] = True
    try:
        one_by_one = [dataset[p] for p in range(8)]
        singly = list(opened)
        opened.clear()
        batch = dataset.__getitems__(order)
    finally:
        armed[0] = False
    assert len(opened) == len(set(opened)) == len(set(singly)), (opened, singly)
    assert len(singly) > len(opened), singly  # shared objects were read again one by one
    for item, position in zip(batch, order, strict=True):
        expected = one_by_one[position]
        assert all(torch.equal(item[key], expected[key]) for key in expected)


def test_modelopt_items_carry_labels_and_the_prenorm_flag(
    host: HostPipeline, tmp_path: Path
) -> None:
    url = str(tmp_path / "store")
    committed_store(host, url)
    item = ModelOptDataset(url)[1]
    ids = item["input_ids"]
    assert torch.equal(item["labels"][:-1], ids[1:]) and int(item["labels"][-1]) == -100
    assert item["base_hidden_prenorm"] is True
    assert item["aux_hidden_states"].shape == (ids.shape[0], 2 * 32)  # K-1 aux layers of H


def test_the_sampler_shards_every_position_once_in_length_groups() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(5, 500, size=103)
    shards = [list(LengthGroupedSampler(lengths, rank, 4, group=16, seed=7)) for rank in range(4)]
    assert {len(shard) for shard in shards} == {26}  # equal counts: 103 padded to 104
    seen = [p for shard in shards for p in shard]
    assert sorted(set(seen)) == list(range(103)) and len(seen) == 104
    # Within a window, neighbours are close in length: sorting inside the window holds per rank.
    first = LengthGroupedSampler(lengths, 0, 1, group=16, seed=7)
    order = list(first)
    windows = [order[i : i + 16] for i in range(0, 96, 16)]
    assert all(list(lengths[w]) == sorted(lengths[w]) for w in windows)
    first.set_epoch(1)
    assert list(first) != order  # another epoch, another shuffle
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.3, found 4"):
        LengthGroupedSampler(lengths, 4, 4)


def test_exported_torch_files_skip_the_zip_crc_and_load_as_specforge_loads_them(
    tmp_path: Path,
) -> None:
    """torch_bytes switches torch.save's per-record CRC32 off while it serializes (the export's
    manifest holds every file's xxh3), from several threads at once, and switches it back when
    the last one is done; the files load with mmap=True (SpecForge's loader) and equal the input."""
    from concurrent.futures import ThreadPoolExecutor

    from hsx.trainers.formats import torch_bytes

    if not hasattr(torch.serialization, "set_crc32_options"):
        pytest.skip("torch < 2.6 has no switch for torch.save's CRC32")
    records = [
        {"hidden_state": torch.randn(1, 50 + n, 64).to(torch.bfloat16), "n": n} for n in range(16)
    ]
    assert torch.serialization.get_crc32_options() is True
    with ThreadPoolExecutor(8) as pool:
        payloads = list(pool.map(torch_bytes, records))
    assert torch.serialization.get_crc32_options() is True, "the process-wide switch was left off"
    for n, (payload, record) in enumerate(zip(payloads, records, strict=True)):
        path = tmp_path / f"data_{n:09d}.ckpt"
        path.write_bytes(payload)
        loaded = torch.load(path, weights_only=False, mmap=True)
        assert loaded["n"] == n
        assert torch.equal(loaded["hidden_state"], record["hidden_state"])
    # The CRC fields are zero (what made the serialization 3-4x cheaper), and the bytes repeat.
    with_crc = io.BytesIO()
    torch.save(records[0], with_crc)
    assert payloads[0] != with_crc.getvalue()
    assert torch_bytes(records[0]) == payloads[0]
