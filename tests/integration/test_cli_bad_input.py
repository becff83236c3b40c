"""Bad input through the real ``hsx`` CLI: a clear error naming the file, line or value, a
non-zero exit, and nothing committed to the store. These fail in seconds, before any model load
or Prefect server start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.timeout(300)]

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def hsx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )


def extract(
    model: Path, dataset: Path, store: str, *options: str
) -> subprocess.CompletedProcess[str]:
    return hsx(
        "extract", "--model", str(model), "--dataset", str(dataset), "--store", store, *options
    )


def assert_nothing_written(store: Path) -> None:
    assert not (store / "commits").exists()
    assert not (store / "zarr.json").exists()


@pytest.mark.parametrize(
    ("case", "lines", "expected"),
    [
        ("not-json", [json.dumps(GOOD), "{oops"], r"data.jsonl:2: expected a JSON object"),
        (
            "no-messages",
            [json.dumps(GOOD), json.dumps({"conversation": []})],
            r"data.jsonl:2: .*messages",
        ),
        (
            "no-assistant",
            [json.dumps({"messages": [{"role": "user", "content": "x"}]})],
            r"data.jsonl:1: .*assistant",
        ),
        ("empty", [], r"data.jsonl: expected at least one conversation"),
    ],
)
def test_bad_dataset(
    case: str, lines: list[str], expected: str, tiny_llama: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(line + "\n" for line in lines))
    store = tmp_path / "store"
    result = extract(tiny_llama, dataset, str(store))
    assert result.returncode == 2, result.stdout + result.stderr
    import re

    assert re.search(expected, " ".join(result.stdout.split())), result.stdout
    assert_nothing_written(store)


def test_missing_dataset(tiny_llama: Path, tmp_path: Path) -> None:
    result = extract(tiny_llama, tmp_path / "nope.jsonl", str(tmp_path / "store"))
    assert (
        result.returncode == 2
        and "nope.jsonl" in result.stdout
        and "found nothing" in result.stdout
    )
    assert_nothing_written(tmp_path / "store")


def test_missing_model_folder(sample_dataset: Path, tmp_path: Path) -> None:
    result = extract(tmp_path / "no-model", sample_dataset, str(tmp_path / "store"))
    assert result.returncode == 2 and "no-model" in result.stdout and "config.json" in result.stdout
    assert_nothing_written(tmp_path / "store")


def test_unknown_store_scheme(tiny_llama: Path, sample_dataset: Path) -> None:
    result = extract(tiny_llama, sample_dataset, "nosuchscheme://bucket/store")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "nosuchscheme://bucket/store" in result.stdout and "scheme" in result.stdout


def test_bad_layer_ids_name_the_value(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    result = extract(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "s"),
        "--layer-ids",
        "2,x",
    )
    assert result.returncode == 2 and "'2,x'" in result.stdout


def test_verify_of_a_missing_store(tmp_path: Path) -> None:
    result = hsx("verify", str(tmp_path / "absent"))
    assert result.returncode == 2 and "absent" in result.stdout and "found nothing" in result.stdout


def test_layer_ids_out_of_range(tiny_llama: Path, sample_dataset: Path, tmp_path: Path) -> None:
    result = extract(
        tiny_llama,
        sample_dataset,
        str(tmp_path / "s"),
        "--layer-ids",
        "2,4,99",
    )
    assert result.returncode == 2 and "[99]" in result.stdout and "0..8" in result.stdout, (
        result.stdout
    )
    assert_nothing_written(tmp_path / "s")


def test_sample_length_must_leave_room_for_the_sampled_token(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    store = tmp_path / "s.zarr"
    out = extract(
        tiny_llama,
        sample_dataset,
        str(store),
        "--max-model-len",
        "2048",
        "--max-length",
        "2048",
    )
    assert out.returncode != 0
    assert "data.max_length 2048 must be below engine.max_model_len 2048" in out.stdout + out.stderr
    assert_nothing_written(store)
