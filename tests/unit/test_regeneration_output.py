"""A regenerated dataset's folder (hsx.regeneration.output, read through hsx.data.sources): the
manifest frozen once, parts committed once, read as a dataset only when complete, verified
against each commit's digest. On a local folder and on fsspec's memory:// store."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from hsx.data.sources import dataset_files, iter_rows
from hsx.errors import DatasetError
from hsx.regeneration.output import (
    PartCommit,
    RegeneratedOutput,
    RegenerationMismatchError,
    part_digest,
)

pytestmark = pytest.mark.timeout(60)

FROZEN = {"sampling": {"temperature": 0.7}, "seed": 0, "max_tokens": 16}


def commit_of(
    index: int, payload: bytes, attempt: int = 1, run_id: str = "r", flow_run_attempt: int = 1
) -> PartCommit:
    return PartCommit(
        index=index,
        conversations=1,
        rows=1,
        generated_tokens=3,
        xxh3=part_digest(payload),
        nbytes=len(payload),
        seconds=0.1,
        failed=[],
        dropped=[],
        finish_reasons={"stop": 1},
        run_id=run_id,
        attempt=attempt,
        finished_at=0.0,
        flow_run_attempt=flow_run_attempt,
    )


def row(index: int) -> bytes:
    record = {"id": f"s{index}", "input_ids": [1, 5, 6, 2], "loss_mask": [0, 0, 1, 1]}
    return (json.dumps(record) + "\n").encode()


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "regenerated")
    return f"memory://hsx-test-{uuid.uuid4().hex}/regenerated"


def test_parts_commit_once_and_read_as_a_dataset_only_when_complete(url: str) -> None:
    output = RegeneratedOutput(url)
    output.open_or_create(FROZEN, chunks=2, conversations=2)
    assert output.write_part(0, row(0), commit_of(0, row(0)))
    with pytest.raises(DatasetError, match=r"found 1 of 2 chunks committed \(missing: 1\)"):
        dataset_files(url)
    # A second attempt at a committed chunk writes nothing and keeps the first record.
    assert not output.write_part(0, row(5), commit_of(0, row(5), attempt=2))
    assert output.committed()[0]["attempt"] == 1
    assert output.write_part(1, row(1), commit_of(1, row(1)))
    assert output.committed_indices() == {0, 1} and output.verify() == []
    files = dataset_files(url)
    assert [f.format for f in files] == ["jsonl", "jsonl"]
    ids = [r.record["id"] for r in iter_rows(files, 1 << 20)]
    assert ids == ["s0", "s1"]  # in chunk order


def test_a_resume_with_other_inputs_is_refused_naming_both_values(url: str) -> None:
    RegeneratedOutput(url).open_or_create(FROZEN, chunks=2, conversations=2)
    RegeneratedOutput(url).open_or_create(dict(FROZEN), chunks=2, conversations=2)  # the same
    changed = {**FROZEN, "sampling": {"temperature": 0.5}}
    with pytest.raises(
        RegenerationMismatchError,
        match=r"sampling: stored \{'temperature': 0.7\}, this run \{'temperature': 0.5\}",
    ):
        RegeneratedOutput(url).open_or_create(changed, chunks=2, conversations=2)
    with pytest.raises(RegenerationMismatchError, match="chunks: stored 2, this run 3"):
        RegeneratedOutput(url).open_or_create(FROZEN, chunks=3, conversations=3)


def test_verify_finds_a_part_changed_after_its_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "regenerated")
    output = RegeneratedOutput(url)
    output.open_or_create(FROZEN, chunks=1, conversations=1)
    output.write_part(0, row(0), commit_of(0, row(0)))
    part = Path(output.part_path(0))
    assert part.name.startswith("part-000000.") and part.parent == tmp_path / "regenerated" / "data"
    part.write_bytes(part.read_bytes().replace(b"s0", b"s9"))
    (problem,) = output.verify()
    assert problem.startswith("part-000000: expected xxh3 " + part_digest(row(0)))


def test_an_attempt_that_loses_the_commit_race_leaves_the_winners_part_alone(url: str) -> None:
    """Two attempts at one chunk both past the committed check (two workers, or a retry beside a
    late first attempt): the first to create the record wins; the loser's rows, other bytes
    here (sampling on another batch), go to its own file, which it removes. The winner's part
    still verifies and is what the dataset reads."""
    output = RegeneratedOutput(url)
    output.open_or_create(FROZEN, chunks=1, conversations=1)
    assert output.write_and_commit(0, row(0), commit_of(0, row(0)))
    assert not output.write_and_commit(0, row(7), commit_of(0, row(7), attempt=2))
    assert output.committed()[0]["attempt"] == 1 and output.verify() == []
    assert output.fs.cat_file(output.part_path(0)) == row(0)
    assert output.fs.ls(f"{output.root}/data", detail=False) == [output.part_path(0)]
    assert [r.record["id"] for r in iter_rows(dataset_files(url), 1 << 20)] == ["s0"]


def test_an_output_of_an_older_hsx_reads_its_unnamed_parts(tmp_path: Path) -> None:
    """Commit records written before parts were named per attempt name no part file: the part
    is data/part-NNNNNN.jsonl."""
    url = str(tmp_path / "regenerated")
    output = RegeneratedOutput(url)
    output.open_or_create(FROZEN, chunks=1, conversations=1)
    (tmp_path / "regenerated" / "data").mkdir()
    (tmp_path / "regenerated" / "commits").mkdir()
    (tmp_path / "regenerated" / "data" / "part-000000.jsonl").write_bytes(row(0))
    record = json.loads(commit_of(0, row(0)).to_json())
    del record["part"]
    (tmp_path / "regenerated" / "commits" / "part-000000.json").write_text(json.dumps(record))
    assert output.verify() == []
    assert [r.record["id"] for r in iter_rows(dataset_files(url), 1 << 20)] == ["s0"]


def test_a_stopped_attempt_counts_the_parts_of_its_own_flow_attempt(url: str) -> None:
    """What a stopped run reports committed comes from the records of its flow run's attempt
    (a part's ``attempt`` is its task's), not from the futures it stopped waiting for."""
    output = RegeneratedOutput(url)
    output.open_or_create(FROZEN, chunks=4, conversations=4)
    made = [("a", 1, 1), ("a", 2, 1), ("a", 1, 2), ("b", 1, 1)]  # run, task attempt, flow attempt
    for index, (run_id, attempt, flow_attempt) in enumerate(made):
        commit = commit_of(index, row(index), attempt, run_id, flow_attempt)
        assert output.write_part(index, row(index), commit)
    assert sorted(r["index"] for r in output.committed_by("a", 1)) == [0, 1]
    assert [r["index"] for r in output.committed_by("a", 2)] == [2]
    assert [r["index"] for r in output.committed_by("b", 1)] == [3]
