"""Bad input through the real ``hsx`` CLI: a clear error naming the file, line or value, a
non-zero exit, and nothing committed to the store. These fail in seconds, before any model load
or Prefect server start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli import GOOD, assert_nothing_written, extract, hsx
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.timeout(300)]


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


def test_unknown_store_scheme(tiny_llama: Path, sample_dataset: Path, tmp_path: Path) -> None:
    url = f"nosuchscheme://{tmp_path}/store"
    before = sorted(p.name for p in REPO_ROOT.iterdir())
    result = extract(tiny_llama, sample_dataset, url)
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stdout.split())
    assert url in message and "scheme" in message, message
    # Nothing written: not at the path inside the URL, nor as a local folder named by the URL.
    assert_nothing_written(tmp_path / "store")
    assert not (tmp_path / "store").exists()
    assert sorted(p.name for p in REPO_ROOT.iterdir()) == before


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
    assert_nothing_written(tmp_path / "s")
    assert not (tmp_path / "s").exists()


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


def peak_rss_mib_of(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI under a fresh parent whose RUSAGE_CHILDREN is the CLI's alone."""
    wrapper = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(r.returncode)"
    )
    result = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    peak = [line for line in result.stdout.splitlines() if line.startswith("PEAK_RSS_KIB")]
    assert peak, result.stdout + result.stderr
    return result, int(peak[-1].split()[1]) / 1024


def test_a_100_mb_line_fails_at_once_with_flat_memory(tiny_llama: Path, tmp_path: Path) -> None:
    """One JSONL line of 100 MB (a user turn of 50M words) once grew `hsx extract` to the
    machine's whole memory; now it is refused by its line number, reading at most
    data.max_line_bytes of it, and peak memory is that of a run failing on a tiny bad line."""
    huge = tmp_path / "huge.jsonl"
    with huge.open("w") as out:
        out.write(json.dumps(GOOD) + "\n")
        out.write('{"messages": [{"role": "user", "content": "')
        out.write("w " * (50 * 2**20))  # 100 MiB of words
        out.write('"}, {"role": "assistant", "content": "ok"}]}\n')
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps(GOOD) + "\n{oops\n")
    store = tmp_path / "store"
    result, peak_huge = peak_rss_mib_of(
        "extract", "--model", str(tiny_llama), "--dataset", str(huge), "--store", str(store)
    )
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stdout.split())
    assert "huge.jsonl:2: expected a line of at most 8,388,608 bytes" in message, message
    assert "data.max_line_bytes" in message
    assert_nothing_written(store)
    _, peak_small = peak_rss_mib_of(
        "extract", "--model", str(tiny_llama), "--dataset", str(small), "--store", str(store)
    )
    print(f"peak RSS: 100 MB line {peak_huge:.0f} MiB, tiny bad line {peak_small:.0f} MiB")
    # Flat: at most a few copies of the 8 MiB read window above the baseline, not the 100 MiB.
    assert peak_huge < peak_small + 48, f"peak {peak_huge:.0f} MiB vs {peak_small:.0f} MiB"


def test_a_store_whose_group_metadata_is_damaged_is_named_and_repaired(
    host: Any, tmp_path: Path
) -> None:
    """The group's zarr.json cut short: zarr cannot open the store at all. `hsx verify` names
    the document (checked against the store's layout copy first), exit 1; `hsx verify
    --repair` rewrites it from the copy (no model needed), exit 0."""
    from tests.unit.test_plan_store import committed_store

    url = str(tmp_path / "store.zarr")
    committed_store(host, url)
    document = tmp_path / "store.zarr" / "zarr.json"
    original = document.read_bytes()
    document.write_bytes(original[: len(original) // 2])
    found = hsx("verify", url)
    assert found.returncode == 1, found.stdout + found.stderr
    text = " ".join(found.stdout.split())
    assert "metadata: zarr.json: stored and computed checksum do not match" in text, text
    repaired = hsx("verify", url, "--repair")
    text = " ".join(repaired.stdout.split())
    assert repaired.returncode == 0 and "rewrote zarr.json from hsx-layout.json" in text, text
    assert document.read_bytes() == original
