"""A resumed run may not change what the store froze: each input that changes the data is named
with both values, in seconds (no engine), and settings that do not change the data are accepted.
Real stores planned from the tiny Llama; no engine is built."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx.errors import StoreError
from hsx.extraction.steps import check_resume, plan_and_create_store
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.timeout(300)]

MAX_SAMPLES = 24


def _settings(model: Path, dataset: Path, store: Path, **sections: Any) -> Any:
    data = {"max_samples": MAX_SAMPLES, **sections.pop("data", {})}
    return make_settings(model, dataset, str(store), data=data, **sections)


@pytest.fixture(scope="module")
def planned(
    tiny_llama: Path, sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A model folder laid out as a Hugging Face cache snapshot, a dataset copy, and a store
    planned from them (each test changes copies of these)."""
    root = tmp_path_factory.mktemp("frozen")
    model = root / "models--tiny--llama" / "snapshots" / "a1b2c3"
    shutil.copytree(tiny_llama, model)
    dataset = root / "data.jsonl"
    shutil.copy(sample_dataset, dataset)
    store = root / "store.zarr"
    plan_and_create_store(_settings(model, dataset, store))
    return {"model": model, "dataset": dataset, "store": store, "root": root}


def _copy_model(planned: dict[str, Path], tmp_path: Path, name: str = "a1b2c3") -> Path:
    model = tmp_path / "models--tiny--llama" / "snapshots" / name
    shutil.copytree(planned["model"], model)
    return model


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def _reseed_weights(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + 0.5  # same shapes and names, other values
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def _add_token(model: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens(["<hsx-added-token>"])
    tokenizer.save(str(model / "tokenizer.json"))


def _change_template(model: Path) -> None:
    jinja = model / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(jinja.read_text() + "{# changed #}")
        return
    _edit_json(
        model / "tokenizer_config.json",
        lambda config: config.__setitem__("chat_template", config["chat_template"] + "{# x #}"),
    )


def _changed_dataset(planned: dict[str, Path], tmp_path: Path) -> Path:
    lines = planned["dataset"].read_text().splitlines()
    first = json.loads(lines[0])
    first["messages"][-1]["content"] += " (edited)"
    lines[0] = json.dumps(first)
    target = tmp_path / "data.jsonl"
    target.write_text("\n".join(lines) + "\n")
    return target


# (case, how this run differs, the frozen input the refusal must name, both values' pattern)
CHANGES: list[tuple[str, Callable[[dict[str, Path], Path], dict[str, Any]], str, str]] = [
    (
        "config",
        lambda p, t: {
            "model": (m := _copy_model(p, t)),
            "_": _edit_json(m / "config.json", lambda c: c.__setitem__("rms_norm_eps", 1e-3)),
        },
        "model_config_hash",
        r"stored '\w+', this run '\w+'",
    ),
    (
        "weights",
        lambda p, t: {"model": (m := _copy_model(p, t)), "_": _reseed_weights(m)},
        "weights_fingerprint",
        r"stored '1 files, xxh3 \w+', this run '1 files, xxh3 \w+'",
    ),
    (
        "revision",
        lambda p, t: {"model": _copy_model(p, t, "d4e5f6")},
        "model_revision",
        r"stored 'a1b2c3', this run 'd4e5f6'",
    ),
    (
        "layer ids",
        lambda p, t: {"capture": {"layer_ids": [1, 3]}},
        "layer_ids",
        r"stored \[\d+(, \d+)*\], this run \[1, 3\]",
    ),
    (
        "layer convention",
        # Numbered in SpecForge's convention: vLLM ids one higher.
        lambda p, t: {"capture": {"layer_ids": [2, 4, 5], "layer_convention": "specforge"}},
        "layer_ids",
        r"stored \[2, 4, 5, 8\], this run \[3, 5, 6\]",
    ),
    (
        "max length",
        lambda p, t: {"data": {"max_length": 100}},
        "max_length",
        r"stored 2047, this run 100",
    ),
    (
        "max samples",
        lambda p, t: {"data": {"max_samples": 10}},
        "max_samples",
        r"stored 24, this run 10",
    ),
    (
        "dataset content",
        lambda p, t: {"dataset": _changed_dataset(p, t)},
        "dataset_fingerprint",
        r"stored '\w+', this run '\w+'",
    ),
    (
        "tokenizer",
        lambda p, t: {"model": (m := _copy_model(p, t)), "_": _add_token(m)},
        "vocabulary_fingerprint",
        r"stored '\w+', this run '\w+'",
    ),
    (
        "chat template",
        lambda p, t: {"model": (m := _copy_model(p, t)), "_": _change_template(m)},
        "chat_template_fingerprint",
        r"stored '\w+', this run '\w+'",
    ),
    (
        "engine dtype",
        lambda p, t: {"engine": {"dtype": "bfloat16"}},
        "engine_dtype",
        r"stored 'float32', this run 'bfloat16'",
    ),
    (
        "stored dtype",
        lambda p, t: {"capture": {"store_dtype": "bfloat16"}},
        "logical_dtype",
        r"stored 'float32', this run 'bfloat16'",
    ),
    (
        "dummy weights",
        lambda p, t: {"engine": {"load_format": "dummy"}},
        "weights_fingerprint",
        r"this run 'dummy weights, seed 0'",
    ),
    (
        "layout",
        lambda p, t: {"layout": {"rows_per_chunk": 128}},
        "layout.rows_per_chunk",
        r"stored 256, this run 128",
    ),
]


def _run_settings(planned: dict[str, Path], change: dict[str, Any]) -> Any:
    change = dict(change)
    change.pop("_", None)
    model = change.pop("model", planned["model"])
    dataset = change.pop("dataset", planned["dataset"])
    return _settings(model, dataset, planned["store"], **change)


@pytest.mark.parametrize(
    ("case", "change", "key", "values"), CHANGES, ids=[case for case, *_ in CHANGES]
)
def test_a_changed_input_is_refused_naming_both_values(
    planned: dict[str, Path],
    tmp_path: Path,
    case: str,
    change: Callable[[dict[str, Path], Path], dict[str, Any]],
    key: str,
    values: str,
) -> None:
    before = sorted(p.name for p in planned["store"].iterdir())
    settings = _run_settings(planned, change(planned, tmp_path))
    with pytest.raises(StoreError) as refused:
        check_resume(settings)
    message = str(refused.value)
    assert f"Changed: {key}" in message, message
    assert re.search(re.escape(key) + r"[^;]*" + values, message), message
    # Planning refuses it too (a script that skips the early check), and writes nothing.
    with pytest.raises(StoreError, match="Changed:"):
        plan_and_create_store(settings)
    assert sorted(p.name for p in planned["store"].iterdir()) == before
    assert not (planned["store"] / "commits").exists()


ACCEPTED: list[tuple[str, Callable[[dict[str, Path], Path], dict[str, Any]]]] = [
    ("retries", lambda p, t: {"run": {"retries": 7, "retry_delay_seconds": 3.0}}),
    ("batch sizes", lambda p, t: {"engine": {"batch_tokens": 999, "max_num_batched_tokens": 512}}),
    ("concurrency", lambda p, t: {"pipeline": {"chunks_in_flight": 5, "io_threads": 2}}),
    ("engine memory", lambda p, t: {"engine": {"kv_cache_memory_gib": 0.5, "max_model_len": 2048}}),
    ("tensor parallel", lambda p, t: {"engine": {"tensor_parallel_size": 2}}),
    # The stored default ids [2, 4, 5, 8], numbered in SpecForge's convention.
    (
        "same layers, other convention",
        lambda p, t: {"capture": {"layer_ids": [1, 3, 4, 7], "layer_convention": "specforge"}},
    ),
    ("same layout, stated", lambda p, t: {"layout": {"rows_per_chunk": 256}}),
    ("moved model folder", lambda p, t: {"model": _copy_model(p, t)}),
]


@pytest.mark.parametrize(("case", "change"), ACCEPTED, ids=[case for case, _ in ACCEPTED])
def test_a_setting_that_does_not_change_the_data_is_accepted(
    planned: dict[str, Path],
    tmp_path: Path,
    case: str,
    change: Callable[[dict[str, Path], Path], dict[str, Any]],
) -> None:
    settings = _run_settings(planned, change(planned, tmp_path))
    assert check_resume(settings) is True
    summary = plan_and_create_store(settings)  # planning resumes the same plan
    assert len(summary.pending) == summary.chunks > 0


def test_a_new_store_is_not_a_resume(planned: dict[str, Path], tmp_path: Path) -> None:
    settings = _settings(planned["model"], planned["dataset"], tmp_path / "new.zarr")
    assert check_resume(settings) is False


@pytest.mark.slow
def test_the_cli_refuses_before_prefect_or_any_engine(planned: dict[str, Path]) -> None:
    started = time.monotonic()
    run = subprocess.run(
        [
            *(sys.executable, "-m", "flows.cli", "extract"),
            *("--model", str(planned["model"]), "--dataset", str(planned["dataset"])),
            *("--store", str(planned["store"]), "--max-samples", str(MAX_SAMPLES)),
            *("--max-length", "2047", "--dtype", "float32", "--layer-ids", "1,3"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=240,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert "Changed: layer_ids" in output and "this run [1, 3]" in output, output
    # Refused before the flow: no Prefect server, no engine, no probe ran.
    assert "probe" not in output.lower() and "vLLM engine" not in output, output
    assert "Starting temporary server" not in output, output
    print(f"refused in {time.monotonic() - started:.1f} s")


def test_inputs_edited_in_place_are_seen_by_a_long_lived_process(
    planned: dict[str, Path], tmp_path: Path
) -> None:
    """A worker runs many flows in one process: digests and the tokenizer are computed once per
    version of their files, not once per path (an edit in place must be seen)."""
    import shutil

    model = _copy_model(planned, tmp_path)
    dataset = tmp_path / "same.jsonl"
    shutil.copy(planned["dataset"], dataset)
    settings = _settings(model, dataset, planned["store"])
    assert check_resume(settings) is True  # same content at other paths
    assert check_resume(settings) is True  # and again, from this process's caches

    text = dataset.read_text()
    swapped = text.replace("a", "\0", 1).replace("e", "a", 1).replace("\0", "e", 1)
    assert len(swapped) == len(text) and swapped != text
    dataset.write_text(swapped)  # same size, other bytes
    with pytest.raises(StoreError, match="Changed: dataset_fingerprint"):
        check_resume(settings)
    shutil.copy(planned["dataset"], dataset)
    assert check_resume(settings) is True

    _add_token(model)
    with pytest.raises(StoreError, match="Changed: vocabulary_fingerprint"):
        check_resume(settings)
