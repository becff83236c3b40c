"""The plan and the store on real Zarr stores (tmp_path and memory://), without an engine."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.errors import StoreError
from hsx.extraction.chunk_extraction import ChunkWriter, RunContext, chunk_samples, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.plan.chunks import Plan, WorkChunk, auto_work_chunk_tokens, cut_chunks
from hsx.plan.token_spool import TokenSpool
from hsx.store.checksums import digest
from hsx.store.layout_copy import METADATA_DOCUMENTS
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import CommitRecord, ExtractionStore

pytestmark = pytest.mark.timeout(120)
K, H = 3, 32


def sample_tokens(index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = (np.arange(length, dtype=np.int32) + 100 * index) % 997
    return ids, (np.arange(length) % 2).astype(np.uint8)


def make_plan(
    lengths: list[int],
    c: int = 16,
    work: int = 64,
    tag: str = "a",
    token_rows_per_object: int | None = None,
) -> Plan:
    arr = np.asarray(lengths, dtype=np.int32)
    chunks, starts, rows = cut_chunks(
        arr, np.arange(len(arr)) * 10, np.arange(len(arr)) + 1, c, work
    )
    inputs = {"tag": tag, "rows_per_chunk": c, "work_chunk_tokens": work}
    spool = TokenSpool()
    for index, length in enumerate(lengths):
        spool.append(*sample_tokens(index, length))
    return Plan(
        inputs,
        arr,
        starts,
        chunks,
        rows,
        c,
        tokens=spool,
        token_rows_per_object=token_rows_per_object,
    )


def meta(dtype: str = "float32") -> dict[str, object]:
    return {
        "num_layers_captured": K,
        "hidden_size": H,
        "logical_dtype": dtype,
        "layer_ids": [1, 2, 4],
    }


class StatesEngine:
    """Deterministic states from token ids: the store under test sees real, checkable data."""

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        out = []
        for p in prompts:
            base = torch.as_tensor(p, dtype=torch.float32)[:, None, None]
            out.append(base + torch.arange(K * H, dtype=torch.float32).reshape(1, K, H) / 7.0)
        return out


@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return (
        str(tmp_path / "store")
        if request.param == "local"
        else f"memory://hsx-test-{uuid.uuid4().hex}"
    )


def test_cut_chunks_owns_whole_zarr_chunks() -> None:
    plan = make_plan([5, 30, 17, 64, 100, 3, 3], c=16, work=64)
    assert [c.row_start % 16 for c in plan.chunks] == [0] * len(plan.chunks)
    assert all((c.row_end - c.row_start) % 16 == 0 for c in plan.chunks)
    assert plan.chunks[0].sample_start == 0 and plan.chunks[-1].sample_end == 7
    for a, b in zip(plan.chunks, plan.chunks[1:], strict=False):
        assert a.sample_end == b.sample_start and a.row_end == b.row_start
    # every sample lies inside its chunk's rows
    for c in plan.chunks:
        for i in range(c.sample_start, c.sample_end):
            assert (
                c.row_start <= plan.sample_starts[i]
                and plan.sample_starts[i] + plan.sample_lengths[i] <= c.row_end
            )
    assert sum(c.tokens for c in plan.chunks) == 222
    # a sample longer than a work chunk gets a chunk of its own
    assert any(c.sample_end - c.sample_start == 1 and c.tokens == 100 for c in plan.chunks)


def test_auto_work_chunk_tokens_targets_hundreds_of_tasks() -> None:
    assert auto_work_chunk_tokens(100_000_000, 256, 256, 4096) == 390_656
    assert auto_work_chunk_tokens(20_000, 256, 256, 4096) == 4096


def test_write_commit_verify_read_roundtrip(host: HostPipeline, store_url: str) -> None:
    plan = make_plan([5, 30, 17, 64, 100, 3, 3])
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    engine = StatesEngine()
    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, engine, 40, RunContext("run-1"))
    report = verify_store(ExtractionStore.open(store_url))
    assert report.ok, report.summary()
    reader = HiddenStatesReader(store_url)
    assert len(reader) == 7
    for index, length in enumerate([5, 30, 17, 64, 100, 3, 3]):
        ids, mask = sample_tokens(index, length)
        stored = reader.sample(index)
        assert np.array_equal(stored.input_ids.numpy(), ids)
        assert np.array_equal(stored.loss_mask.numpy(), mask.astype(bool))
    s = reader.sample(3)
    assert s.hidden_states.shape == (64, K, H)
    expected = engine.extract([s.input_ids.numpy()])[0]
    assert torch.equal(s.hidden_states, expected)
    assert s.aux_hidden_states.shape == (64, (K - 1) * H) and s.target_hidden_states.shape == (
        64,
        H,
    )


@pytest.mark.parametrize("token_rows", [16, 48, None], ids=["C rows", "3C rows", "default"])
def test_token_objects_span_work_chunks_and_every_read_and_verify_sees_the_planned_rows(
    host: HostPipeline, tmp_path: Path, token_rows: int | None
) -> None:
    """input_ids and loss_mask in objects of C rows (stores before), of 3C rows (an object
    spans two work chunks; the last one zero-padded to its full size), or the default (here
    one object): the same rows through read_rows, read_row_ranges, the reader and verify, and
    a flipped byte is charged to the chunk whose rows it is in."""
    lengths = [5, 30, 17, 64, 100, 3, 3]
    url = str(tmp_path / "store")
    plan = make_plan(lengths, work=48, token_rows_per_object=token_rows)
    store = ExtractionStore.open_or_create(url, plan, meta())
    size = store.object_rows("input_ids")
    rows = store.array("input_ids").shape[0]
    assert size == (token_rows or -(-rows // 16) * 16) and store.object_rows("hidden_states") == 16
    objects = sorted((tmp_path / "store" / "input_ids").glob("c.*"))
    assert len(objects) == -(-rows // size)
    assert all(path.stat().st_size == size * 4 for path in objects)  # the edge one whole
    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, StatesEngine(), 40, RunContext("run-1"))
    store = ExtractionStore.open(url)
    assert verify_store(store).ok
    reader = HiddenStatesReader(url)
    expected = [sample_tokens(i, n) for i, n in enumerate(lengths)]
    for index, (ids, mask) in enumerate(expected):
        stored = reader.sample(index)
        assert np.array_equal(stored.input_ids.numpy(), ids)
        assert np.array_equal(stored.loss_mask.numpy(), mask.astype(bool))
    starts, counts = store.sample_rows(0, len(lengths))
    ranges = [(int(a), int(a + n)) for a, n in zip(starts, counts, strict=True)][::-1]
    batch = store.read_row_ranges(("input_ids", "loss_mask"), ranges)
    for got, (ids, _) in zip(batch["input_ids"], expected[::-1], strict=True):
        assert np.array_equal(got, ids)
    # A flipped byte in a row of chunk 2: charged to chunk 2's input_ids and nothing else.
    row = plan.chunks[2].row_start + 1
    victim = tmp_path / "store" / "input_ids" / f"c.{row // size}"
    data = bytearray(victim.read_bytes())
    data[(row % size) * 4] ^= 0x01
    victim.write_bytes(bytes(data))
    report = verify_store(ExtractionStore.open(url))
    assert [(p.chunk_index, p.message.split(" rows")[0]) for p in report.problems] == [
        (2, "input_ids")
    ], report.problems


def test_a_store_from_before_token_objects_reads_its_token_arrays_in_c_rows(
    host: HostPipeline, tmp_path: Path
) -> None:
    """A store written before token_rows_per_object (its token arrays in C-row objects, no such
    key in its metadata) reads, verifies and resumes as before."""
    import zarr

    from hsx.store.layout_copy import write_layout_copy
    from hsx.store.zarr_store import HSX_ATTR

    url = str(tmp_path / "older.zarr")
    plan = make_plan([5, 30, 17, 64], work=48, token_rows_per_object=16)
    store = ExtractionStore.open_or_create(url, plan, meta())
    for chunk in plan.chunks[:2]:
        extract_chunk(host, store, chunk, StatesEngine(), 40, RunContext("r"))
    group = zarr.open_group(url, mode="r+")
    attrs = dict(group.attrs[HSX_ATTR])
    del attrs["token_rows_per_object"]
    group.attrs[HSX_ATTR] = attrs
    write_layout_copy(store.fs, store.root, url)  # as that hsx wrote it
    older = ExtractionStore.open(url)
    assert older.object_rows("input_ids") == 16
    older.write_token_rows(plan, older.pending_chunks())  # a resume's rewrite, in C rows
    report = verify_store(older)
    assert not report.problems and report.missing == [2], report.summary()
    for index, length in enumerate([5, 30]):
        assert np.array_equal(
            HiddenStatesReader(url).sample(index).input_ids.numpy(), sample_tokens(index, length)[0]
        )


def test_token_objects_must_be_whole_multiples_of_c() -> None:
    from hsx.errors import ConfigError
    from hsx.plan.chunks import token_object_rows

    with pytest.raises(
        ConfigError,
        match=r"token_rows_per_object: expected a multiple of rows_per_chunk \(16\), found 24",
    ):
        token_object_rows(1000, 16, 24)
    assert token_object_rows(1000, 16, None) == 1008  # no larger than the array, in C rows
    assert token_object_rows(10**6, 256, None) == 65_536


def test_bfloat16_is_stored_as_uint16_bit_exact(host: HostPipeline, store_url: str) -> None:
    plan = make_plan([20, 9])
    store = ExtractionStore.open_or_create(store_url, plan, meta("bfloat16"))
    assert store.array("hidden_states").dtype == np.uint16
    assert store.array("hidden_states").attrs["logical_dtype"] == "bfloat16"
    engine = StatesEngine()
    extract_chunk(host, store, plan.chunks[0], engine, 100, RunContext("r"))
    sample = HiddenStatesReader(store_url).sample(1)
    expected = engine.extract([sample.input_ids.numpy()])[0].to(torch.bfloat16)
    assert sample.hidden_states.dtype == torch.bfloat16 and torch.equal(
        sample.hidden_states, expected
    )


def test_uncommitted_chunk_is_invisible_and_reported(host: HostPipeline, store_url: str) -> None:
    plan = make_plan([30, 30, 30, 30], work=32)
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    writer = ChunkWriter(host, store, plan.chunks[1])
    s, _ = chunk_samples(store, plan.chunks[1])
    writer.append(s, StatesEngine().extract([x.input_ids for x in s]))
    writer.finish()  # rows written, but no commit record: the chunk does not exist
    extract_chunk(host, store, plan.chunks[0], StatesEngine(), 100, RunContext("r"))
    reader = HiddenStatesReader(store_url)
    assert list(reader.available_samples) == [0]
    with pytest.raises(StoreError, match="not committed"):
        reader.sample(1)
    report = verify_store(store)
    assert not report.ok and report.missing == [1, 2, 3] and report.chunks_verified == 1
    assert [c.index for c in store.pending_chunks()] == [1, 2, 3]


def committed_store(host: HostPipeline, url: str) -> tuple[Plan, ExtractionStore]:
    """Four samples in four work chunks, every chunk extracted and committed."""
    plan = make_plan([30, 30, 30, 30], work=32)
    store = ExtractionStore.open_or_create(url, plan, meta())
    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, StatesEngine(), 100, RunContext("r"))
    return plan, store


def extracted_store(host: HostPipeline, tmp_path: Path) -> tuple[str, list[Path]]:
    """A local store with every chunk extracted; its URL and hidden-state objects in order."""
    url = str(tmp_path / "store")
    plan = make_plan([40, 40], work=48)
    store = ExtractionStore.open_or_create(url, plan, meta())
    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, StatesEngine(), 100, RunContext("r"))
    return url, sorted((tmp_path / "store" / "hidden_states").glob("c.*"))


def test_flipped_byte_is_detected(host: HostPipeline, tmp_path: Path) -> None:
    url, files = extracted_store(host, tmp_path)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0x01
    files[-1].write_bytes(bytes(data))
    report = verify_store(ExtractionStore.open(url))
    assert not report.ok and len(report.problems) == 1
    assert "hidden_states" in report.problems[0].message and "Stored:" in report.problems[0].message


@pytest.mark.parametrize("damage", ["truncated", "not json", "other chunk"])
def test_corrupt_commit_record_is_refused_by_resume_and_dropped_by_repair(
    host: HostPipeline, store_url: str, damage: str
) -> None:
    from hsx.errors import CorruptRecordError
    from hsx.store.verify import repair_store

    plan, store = committed_store(host, store_url)
    path = f"{store.root}/commits/chunk-000002.json"
    raw = store.fs.cat_file(path)
    broken = {
        "truncated": raw[: len(raw) // 2],
        "not json": b"\xff\xfe garbage",
        "other chunk": raw.replace(b'"chunk_index": 2', b'"chunk_index": 1'),
    }[damage]
    store.fs.pipe_file(path, broken)
    with pytest.raises(CorruptRecordError, match=r"chunk-000002\.json: expected") as refused:
        store.pending_chunks()  # resume refuses to guess
    assert refused.value.chunk_index == 2
    named = "found plan" if damage == "other chunk" else "--repair"
    assert named in str(refused.value), str(refused.value)
    report = verify_store(store)
    assert not report.ok and [p.chunk_index for p in report.problems] == [2]
    assert report.chunks_verified == 3 and report.missing == []
    assert repair_store(store, report) == {2: [report.problems[0].message]}
    assert [c.index for c in store.pending_chunks()] == [2]
    extract_chunk(host, store, plan.chunks[2], StatesEngine(), 100, RunContext("r2"))
    assert verify_store(store).ok


def test_flipped_sample_index_is_found_and_rewritten_from_the_plan(
    host: HostPipeline, store_url: str
) -> None:
    plan, store = committed_store(host, store_url)
    assert store.sample_index_problems() == []
    path = f"{store.root}/sample_lengths/c.0"
    data = bytearray(store.fs.cat_file(path))
    data[4] ^= 0x01  # sample 1's length
    store.fs.pipe_file(path, bytes(data))
    reopened = ExtractionStore.open(store_url)
    report = verify_store(reopened)
    assert not report.ok and report.problems == [] and report.chunks_verified == 4
    assert (
        len(report.index_problems) == 1
        and "sample_lengths: stored and computed" in (report.index_problems[0])
    )
    assert "sample index corrupt" in report.summary()
    ExtractionStore.open(store_url, mode="r+").write_sample_index(plan)
    assert verify_store(ExtractionStore.open(store_url)).ok


@pytest.mark.parametrize("document", METADATA_DOCUMENTS)
def test_a_flipped_metadata_byte_is_found_and_rewritten_from_the_layout_copy(
    host: HostPipeline, store_url: str, document: str
) -> None:
    from hsx.store.layout_copy import metadata_problems, repair_metadata
    from hsx.store.zarr_store import fs_and_root

    committed_store(host, store_url)
    fs, root = fs_and_root(store_url)
    assert metadata_problems(fs, root, store_url) == []
    original = fs.cat_file(f"{root}/{document}")
    # A digit of the shape, or of the first number found: zarr would read it silently.
    at = next(i for i, c in enumerate(original) if chr(c).isdigit())
    damaged = original[:at] + bytes([original[at] ^ 0x01]) + original[at + 1 :]
    fs.pipe_file(f"{root}/{document}", damaged)
    (problem,) = metadata_problems(fs, root, store_url)
    assert problem.startswith(f"{document}: stored and computed checksum do not match"), problem
    assert repair_metadata(fs, root, store_url) == [document]
    assert fs.cat_file(f"{root}/{document}") == original
    assert verify_store(ExtractionStore.open(store_url)).ok


def test_other_plan_is_refused_with_a_diff(store_url: str) -> None:
    ExtractionStore.open_or_create(store_url, make_plan([10, 10], tag="a"), meta())
    with pytest.raises(StoreError, match=r"tag: stored 'a', this run 'b'"):
        ExtractionStore.open_or_create(store_url, make_plan([10, 10], tag="b"), meta())


def test_misaligned_write_is_refused(store_url: str) -> None:
    plan = make_plan([40, 40], work=48)
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    states = np.zeros((16, *store.array("hidden_states").shape[1:]), dtype=np.float16)
    with pytest.raises(StoreError, match="aligned to Zarr chunks of 16 rows"):
        store.write_rows(8, {"hidden_states": states})


def test_a_pending_chunks_token_rows_are_rewritten_whole_objects_from_the_plan(
    store_url: str,
) -> None:
    """A resumed run rewrites its pending chunks' token rows; the token arrays' objects span
    many chunks, so the objects holding them are rewritten whole from the plan: the other
    chunks' rows come back as planned even where the object was lost."""
    plan = make_plan([40, 40], work=48, token_rows_per_object=32)
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    rows = store.array("input_ids").shape[0]
    planned = store.read_rows("input_ids", 0, rows).copy()
    assert store.object_rows("input_ids") == 32 and len(plan.chunks) == 2
    for obj in range(-(-rows // 32)):  # every object gone
        store.fs.rm(f"{store.root}/input_ids/c.{obj}")
    store.write_token_rows(plan, [plan.chunks[1]])  # rows [48, 96): objects 1 and 2
    with pytest.raises(StoreError, match=r"input_ids rows \[0, 32\): expected storage object"):
        store.read_rows("input_ids", 0, rows)
    assert np.array_equal(store.read_rows("input_ids", 32, rows), planned[32:])
    assert np.array_equal(np.asarray(store.array("input_ids")[32:]), planned[32:])  # zarr too


def test_unknown_scheme_names_the_url() -> None:
    with pytest.raises(StoreError, match="nosuch://x"):
        ExtractionStore.open_or_create("nosuch://x/y", make_plan([4]), meta())


def test_planned_token_count_mismatch_is_fatal(host: HostPipeline, store_url: str) -> None:
    plan = make_plan([10, 10])
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    samples, _ = chunk_samples(store, plan.chunks[0])
    writer = ChunkWriter(host, store, plan.chunks[0])
    writer.append(samples[:1], StatesEngine().extract([samples[0].input_ids]))
    with pytest.raises(StoreError, match="expected 20 tokens as planned, found 10"):
        writer.finish()
    assert store.committed_chunks() == {}


def test_commit_record_carries_audit_fields(host: HostPipeline, tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    plan = make_plan([10])
    store = ExtractionStore.open_or_create(url, plan, meta())
    record = extract_chunk(
        host,
        store,
        plan.chunks[0],
        StatesEngine(),
        100,
        RunContext("run-x", attempt=2, code_version="v"),
    )
    on_disk = json.loads((tmp_path / "s" / "commits" / "chunk-000000.json").read_text())
    assert (
        on_disk["run_id"] == "run-x"
        and on_disk["attempt"] == 2
        and on_disk["plan_hash"] == plan.plan_hash
    )
    ids = store.read_rows("input_ids", 0, 16)
    assert on_disk["checksums"]["input_ids"] == [digest(ids)] == record.checksums["input_ids"]


def test_a_store_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from hsx.extraction.steps import check_free_space

    plan = make_plan([10])
    plan.total_rows = 10**13  # ~ 3.7 PB of hidden states at K=3, H=32, fp32
    with pytest.raises(StoreError, match=r"expected .* GiB free .* found .* GiB"):
        check_free_space(str(tmp_path / "huge.zarr"), plan, meta())
    assert not (tmp_path / "huge.zarr").exists()
    check_free_space(str(tmp_path / "small.zarr"), make_plan([10]), meta())  # fits: no error


def test_the_space_a_store_needs_follows_its_stored_dtype() -> None:
    """Bytes per token row: ids (4) + mask (1) + K x H states (4 fp32, 2 bf16, 1 fp8 plus a
    4-byte scale per layer), as the arrays are created."""
    from hsx.store.zarr_store import bytes_per_row

    base = {"num_layers_captured": 4, "hidden_size": 7168}
    fp32 = bytes_per_row({**base, "logical_dtype": "float32"})
    bf16 = bytes_per_row({**base, "logical_dtype": "bfloat16"})
    fp8 = bytes_per_row({**base, "logical_dtype": "bfloat16", "state_encoding": "fp8_e4m3"})
    assert (fp32, bf16, fp8) == (4 * 7168 * 4 + 5, 4 * 7168 * 2 + 5, 4 * (7168 + 4) + 5)


def test_missing_or_truncated_object_is_named_by_verify_not_read_as_zeros(
    host: HostPipeline, tmp_path: Path
) -> None:
    url, objects = extracted_store(host, tmp_path)
    objects[0].unlink()
    objects[-1].write_bytes(objects[-1].read_bytes()[:100])
    report = verify_store(ExtractionStore.open(url))
    messages = [problem.message for problem in report.problems]
    assert not report.ok and report.chunks_verified == 0, messages
    assert any("expected storage object" in m and objects[0].name in m for m in messages)
    assert any(f"expected {16 * K * H * 4} bytes" in m and "found 100" in m for m in messages)
    with pytest.raises(StoreError, match="found none"):
        ExtractionStore.open(url).read_rows("hidden_states", 0, 16)


def test_direct_io_store_round_trips_exact_bytes(host: HostPipeline, tmp_path: Path) -> None:
    # K*H*4 bytes a row, 16 rows an object: 16 KiB objects, aligned for O_DIRECT.
    url = str(tmp_path / "store")
    plan = make_plan([40, 7, 60], work=48)
    direct_meta = {**meta(), "num_layers_captured": 4, "hidden_size": 64, "layer_ids": [1, 2, 3, 4]}
    ExtractionStore.open_or_create(url, plan, direct_meta)
    store = ExtractionStore.open(url, mode="r+", direct_io=True)

    class WideEngine:
        def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
            return [
                torch.as_tensor(p, dtype=torch.float32)[:, None, None]
                + torch.arange(4 * 64, dtype=torch.float32).reshape(1, 4, 64)
                for p in prompts
            ]

    for chunk in plan.chunks:
        extract_chunk(host, store, chunk, WideEngine(), 32, RunContext("r"))
    assert verify_store(ExtractionStore.open(url)).ok
    reader = HiddenStatesReader(url)
    for index in range(3):
        sample = reader.sample(index)
        assert torch.equal(
            sample.hidden_states, WideEngine().extract([sample.input_ids.numpy()])[0]
        )


def test_streamed_digests_equal_digests_of_the_stored_rows(
    host: HostPipeline, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are hashed block by block as they are copied; the digest must be that of each whole
    stored Zarr chunk, padding included, whatever the block, sample and chunk boundaries."""
    import hsx.extraction.chunk_extraction

    row_bytes = K * H * 4  # float32 rows
    monkeypatch.setattr(
        hsx.extraction.chunk_extraction, "_HASH_BLOCK_BYTES", 5 * row_bytes
    )  # 5 rows, not 16
    plan = make_plan([7, 23, 3, 12], c=16, work=64)
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    chunk = plan.chunks[0]
    samples, _ = chunk_samples(store, chunk)
    writer = ChunkWriter(host, store, chunk)
    engine = StatesEngine()
    writer.append(samples[:2], engine.extract([s.input_ids for s in samples[:2]]))
    writer.append(samples[2:], engine.extract([s.input_ids for s in samples[2:]]))
    digests = writer.finish()["hidden_states"]
    stored = store.read_rows("hidden_states", chunk.row_start, chunk.row_end)
    expected = [digest(stored[row : row + 16]) for row in range(0, stored.shape[0], 16)]
    assert len(expected) == 3 and digests == expected
    assert not stored[45:].any()  # the padding rows hashed are the zero rows stored


@pytest.mark.parametrize(("aligned", "in_place"), [(True, 2), (False, 0)])
def test_whole_zarr_chunks_of_aligned_results_are_written_without_a_copy(
    host: HostPipeline, tmp_path: Path, aligned: bool, in_place: int
) -> None:
    """A sample covering whole Zarr chunks has them written straight from the engine's result
    when it is page-aligned (the connector's buffers are); otherwise through staging. Both
    store the same bytes under the same digests."""
    from hsx.store.local_io import aligned_cpu_tensor

    url = str(tmp_path / "store")
    plan = make_plan([40, 7], c=16, work=48)  # rows [0, 40) hold chunks 0 and 1 whole
    wide = {**meta(), "num_layers_captured": 4, "hidden_size": 64, "layer_ids": [1, 2, 3, 4]}
    ExtractionStore.open_or_create(url, plan, wide)  # 1 KiB rows: 16 KiB objects
    store = ExtractionStore.open(url, mode="r+", direct_io=True)
    samples, _ = chunk_samples(store, plan.chunks[0])
    states = []
    for sample in samples:
        values = torch.as_tensor(sample.input_ids, dtype=torch.float32)[
            :, None, None
        ] + torch.arange(256, dtype=torch.float32).reshape(1, 4, 64)
        buffer = aligned_cpu_tensor((sample.num_tokens + 1, 4, 64), torch.float32)
        target = buffer[:-1] if aligned else buffer[1:]  # 1 KiB off a page: not for O_DIRECT
        target.copy_(values)
        states.append(target)
    writer = ChunkWriter(host, store, plan.chunks[0])
    writer.append(samples, states)
    digests = writer.finish()["hidden_states"]
    assert writer.chunks_in_place == in_place
    stored = store.read_rows("hidden_states", 0, 48)
    assert torch.equal(torch.from_numpy(stored[:40]), states[0])
    assert torch.equal(torch.from_numpy(stored[40:47]), states[1])
    assert digests == [digest(stored[row : row + 16]) for row in (0, 16, 32)]


def test_verify_tells_an_unfinished_store_from_a_corrupt_one(
    host: HostPipeline, tmp_path: Path
) -> None:
    """A store with chunks not extracted yet is INCOMPLETE (exit 3: a resume finishes it), not
    FAILED; a flipped byte makes it CORRUPT (exit 1) whatever is missing."""
    from typer.testing import CliRunner

    from flows.cli import app

    url = str(tmp_path / "store")
    plan = make_plan([40, 40, 40], work=48)
    store = ExtractionStore.open_or_create(url, plan, meta())
    extract_chunk(host, store, plan.chunks[0], StatesEngine(), 100, RunContext("r"))
    report = verify_store(ExtractionStore.open(url))
    assert report.state == "INCOMPLETE" and report.intact and not report.ok
    assert report.summary().startswith(
        f"INCOMPLETE: 1/{len(plan.chunks)} chunks verified, {len(plan.chunks) - 1} not extracted "
        "yet (nothing corrupt: a resume finishes it)"
    )
    runner = CliRunner()
    assert runner.invoke(app, ["verify", url]).exit_code == 3
    (victim,) = sorted((tmp_path / "store" / "hidden_states").glob("c.*"))[:1]
    victim.write_bytes(bytes([victim.read_bytes()[0] ^ 1]) + victim.read_bytes()[1:])
    corrupt = verify_store(ExtractionStore.open(url))
    assert corrupt.state == "CORRUPT" and corrupt.summary().startswith("CORRUPT: 0/")
    assert runner.invoke(app, ["verify", url]).exit_code == 1


def test_a_store_of_an_older_hsx_gets_its_layout_copy_once_checked(
    host: HostPipeline, tmp_path: Path
) -> None:
    """A store without hsx-layout.json (written before hsx kept it): verify says its documents
    are not checked; --repair checks them against the store's record and writes the copy, then
    a changed document is found; a document that disagrees with the record is refused."""
    from typer.testing import CliRunner

    from flows.cli import app
    from hsx.store.layout_copy import COPY_NAME

    runner = CliRunner()
    url = str(tmp_path / "old.zarr")
    committed_store(host, url)
    copy = tmp_path / "old.zarr" / COPY_NAME
    copy.unlink()
    plain = runner.invoke(app, ["verify", url])
    assert plain.exit_code == 0 and f"no {COPY_NAME} (a store of an older hsx)" in plain.output
    upgraded = runner.invoke(app, ["verify", url, "--repair"])
    assert upgraded.exit_code == 0, upgraded.output
    assert f"wrote {COPY_NAME}" in " ".join(upgraded.output.split()) and copy.is_file()
    document = tmp_path / "old.zarr" / "loss_mask" / "zarr.json"
    document.write_text(document.read_text().replace('"uint8"', '"int8"'))
    assert runner.invoke(app, ["verify", url]).exit_code == 1  # found against the copy now

    other = str(tmp_path / "bad.zarr")
    committed_store(host, other)
    (tmp_path / "bad.zarr" / COPY_NAME).unlink()
    shape = tmp_path / "bad.zarr" / "input_ids" / "zarr.json"
    meta = json.loads(shape.read_text())
    meta["shape"] = [meta["shape"][0] + 1]
    shape.write_text(json.dumps(meta))
    refused = runner.invoke(app, ["verify", other, "--repair"])
    assert refused.exit_code == 2 and "input_ids/zarr.json: shape" in refused.output
    assert not (tmp_path / "bad.zarr" / COPY_NAME).exists()


class ShiftedEngine(StatesEngine):
    """Other states for the same tokens: a second attempt whose bytes differ (another batch
    cut on a GPU rounds differently)."""

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        return [states + 0.5 for states in super().extract(prompts)]


def test_a_chunk_computed_twice_is_committed_once_and_the_collision_recorded(
    host: HostPipeline, store_url: str
) -> None:
    """Two attempts at one chunk (a retry beside a run thought dead, two nodes): the first
    commit stays, the second neither overwrites it nor fails; each collision is recorded with
    both attempts and whether their objects' digests agree."""
    plan = make_plan([30, 30], work=32)
    store = ExtractionStore.open_or_create(store_url, plan, meta())
    chunk = plan.chunks[0]
    first = extract_chunk(host, store, chunk, StatesEngine(), 100, RunContext("run-a"))
    again = extract_chunk(host, store, chunk, StatesEngine(), 100, RunContext("run-b"))
    other = extract_chunk(host, store, chunk, ShiftedEngine(), 100, RunContext("run-c", attempt=2))
    committed = store.read_commit(chunk.index)
    assert committed == first and "collision" not in first.extra
    assert again.extra["collision"]["winner"]["run_id"] == "run-a"
    collisions = store.collisions()
    assert [(c["loser"]["run_id"], c["loser"]["attempt"]) for c in collisions] == [
        ("run-b", 1),
        ("run-c", 2),
    ]
    assert [c["same_checksums"] for c in collisions] == [True, False]
    assert {c["winner"]["run_id"] for c in collisions} == {"run-a"}
    assert other.extra["collision"]["same_checksums"] is False
    # The third attempt's objects replaced the committed ones: verify names the chunk, the
    # repair drops its commit, and a new attempt commits it cleanly.
    from hsx.store.verify import repair_store

    report = verify_store(ExtractionStore.open(store_url))
    assert not report.ok and {p.chunk_index for p in report.problems} == {chunk.index}
    repair_store(store, report)
    assert [c.index for c in store.pending_chunks()] == [0, 1]
    redone = extract_chunk(host, store, chunk, ShiftedEngine(), 100, RunContext("run-d"))
    assert "collision" not in redone.extra and store.read_commit(0) == redone
    extract_chunk(host, store, plan.chunks[1], StatesEngine(), 100, RunContext("run-d"))
    assert verify_store(store).ok


def race_one_commit(
    store: ExtractionStore, base: CommitRecord, chunk: WorkChunk, racers: int
) -> CommitRecord:
    """``racers`` threads commit as many different records for ``chunk`` at once (copies of
    ``base``, another chunk's record, moved onto it): exactly one wins, every other is handed
    the winner's record, and the store holds it. Returns the winner."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    records = [
        replace(
            base,
            chunk_index=chunk.index,
            row_start=chunk.row_start,
            row_end=chunk.row_end,
            run_id=f"racer-{n}",
        )
        for n in range(racers)
    ]
    with ThreadPoolExecutor(racers) as pool:
        answers = list(pool.map(store.write_commit, records))
    winners = [r for r, answer in zip(records, answers, strict=True) if answer is None]
    assert len(winners) == 1, [a.run_id if a else None for a in answers]
    assert all(answer == winners[0] for answer in answers if answer is not None)
    assert store.read_commit(chunk.index) == winners[0]
    return winners[0]


def test_racing_commits_of_one_chunk_on_a_local_disk_leave_exactly_one_winner(
    host: HostPipeline, tmp_path: Path
) -> None:
    """Sixteen threads commit sixteen different records for one chunk at once: one creates the
    record (link(2) of a whole temporary file), fifteen are handed that record back, and the
    file holds the winner's record whole."""
    url = str(tmp_path / "race")
    plan = make_plan([30, 30], work=32)
    store = ExtractionStore.open_or_create(url, plan, meta())
    base = extract_chunk(host, store, plan.chunks[1], StatesEngine(), 100, RunContext("base"))
    race_one_commit(store, base, plan.chunks[0], racers=16)
    assert sorted(p.name for p in (tmp_path / "race" / "commits").iterdir()) == [
        "chunk-000000.json",
        "chunk-000001.json",
    ]  # no temporary file left behind


def test_a_stopped_attempt_counts_the_commits_of_its_own_flow_attempt(
    host: HostPipeline, tmp_path: Path
) -> None:
    """A record's ``attempt`` is its chunk task's (2 after a task retry); a stopped flow run
    counts by the flow run's attempt (2 after a Retry from the UI), kept in the record's extra."""
    plan = make_plan([30, 30, 30, 30], work=32)
    store = ExtractionStore.open_or_create(str(tmp_path / "s"), plan, meta())
    contexts = [
        RunContext("run-a", attempt=1, extra={"flow_run_attempt": 1}),
        RunContext("run-a", attempt=2, extra={"flow_run_attempt": 1}),  # its task retried once
        RunContext("run-a", attempt=1, extra={"flow_run_attempt": 2}),  # after the UI's Retry
        RunContext("run-b", attempt=1, extra={"flow_run_attempt": 2}),
    ]
    for chunk, context in zip(plan.chunks, contexts, strict=True):
        extract_chunk(host, store, chunk, StatesEngine(), 100, context)
    assert sorted(r.chunk_index for r in store.committed_by("run-a", 1)) == [0, 1]
    assert [r.chunk_index for r in store.committed_by("run-a", 2)] == [2]
    assert [r.chunk_index for r in store.committed_by("run-b", 2)] == [3]
    assert store.committed_by("run-c", 1) == []
