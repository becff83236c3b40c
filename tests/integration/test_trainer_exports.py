"""hsx's exports read by the trainers' OWN reader code (speculators 0.9.0, specforge 0.2.0,
nvidia-modelopt 0.47.0, installed --no-deps in .venv/trainers with hs-connectors for
speculators and omegaconf, pulp and scipy for modelopt's import chain): every tensor equals
hsx's reader, for stores of the tiny Llama and the tiny DeepSeek-V3; SpecForge's post-norm
``hidden_state`` equals HF transformers' last hidden state within 1e-4 (fp32). A killed export
resumes without rewriting a whole file; a flipped byte is found by ``hsx verify``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import ExtractionRun
from hsx.extraction.steps import plan_and_create_store
from hsx.store.reader import HiddenStatesReader
from tests.cli import HSX, hsx, said
from tests.conftest import REPO_ROOT, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
FORMATS = ("speculators", "specforge", "modelopt")


def _extracted(
    model: Path, dataset: Path, url: str, samples: int, store_dtype: str = "auto"
) -> str:
    settings = make_settings(
        model, dataset, url, data={"max_samples": samples}, capture={"store_dtype": store_dtype}
    )
    summary = plan_and_create_store(settings)
    with ExtractionRun.open(settings) as run:
        for index in summary.pending:
            run.extract(index, RunContext("exports"))
    return url


@pytest.fixture(scope="module")
def stores(
    tiny_llama: Path,
    tiny_deepseek: Path,
    sample_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """fp32 stores of both tiny models (several work chunks each), and an fp8 store of the
    tiny Llama (exports write its states dequantized: no trainer here reads fp8)."""
    root = tmp_path_factory.mktemp("stores")
    return {
        "llama": _extracted(tiny_llama, sample_dataset, str(root / "llama.zarr"), 24),
        "deepseek": _extracted(tiny_deepseek, sample_dataset, str(root / "deepseek.zarr"), 16),
        "llama-fp8": _extracted(
            tiny_llama, sample_dataset, str(root / "llama-fp8.zarr"), 12, "fp8_e4m3"
        ),
    }


def _trainer_check(site: Path, *args: str) -> dict[str, Any]:
    """tests/integration/trainer_readers.py in a child process with the trainers' packages."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.trainer_readers", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-4000:]
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def _export(store: str, out: Path, format_name: str) -> dict[str, Any]:
    from flows.export import export_flow

    return export_flow(store, str(out), format_name, writers=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["llama", "deepseek", "llama-fp8"])
@pytest.mark.parametrize("format_name", FORMATS)
def test_each_trainer_reads_the_export_as_hsx_does(
    prefect_harness: None,
    trainers_site: Path,
    stores: dict[str, str],
    tmp_path: Path,
    model: str,
    format_name: str,
) -> None:
    out = tmp_path / f"{model}-{format_name}"
    summary = _export(stores[model], out, format_name)
    reader = HiddenStatesReader(stores[model])
    assert summary["samples"] == len(reader.available_samples) > 0
    assert summary["verification"].startswith("OK"), summary
    manifest = json.loads((out / "hsx-export.json").read_text())
    assert manifest["layer_ids_vllm"] == list(reader.layer_ids)
    assert manifest["aux_layer_ids_layer_outputs"] == [i - 1 for i in reader.layer_ids[:-1]]
    assert manifest["final_state"] == ("post-norm" if format_name == "specforge" else "pre-norm")
    result = _trainer_check(trainers_site, format_name, str(out), stores[model])
    assert result["problems"] == [], result["problems"][:10]
    assert result["compared"] == summary["samples"]
    if format_name == "specforge" and model != "llama-fp8":  # fp8 is 2**-4 off by design
        _assert_post_norm_matches_hf(stores[model], out)


def _assert_post_norm_matches_hf(store: str, out: Path) -> None:
    """SpecForge's target (read by its own reader) against HF's last hidden state, which is
    after the final norm, in fp32."""
    from hsx.preflight.hf_reference import load_hf_model

    reader = HiddenStatesReader(store)
    targets: dict[int, torch.Tensor] = torch.load(out.parent / f"{out.name}-targets.pt")
    model = load_hf_model(Path(reader.store.meta["model"]["path"]))
    worst = 0.0
    for index, target in targets.items():
        ids = reader.sample(index).input_ids[None]
        with torch.no_grad():
            hf = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        worst = max(worst, float((target.float() - hf.float()).abs().max()))
    assert worst <= 1e-4, f"post-norm states differ from HF's by up to {worst:.2e}"


def test_vocab_files_are_what_both_trainers_build(
    trainers_site: Path, stores: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "vocab"
    done = hsx("vocab", stores["llama"], "--draft-vocab-size", "64", "--out", str(out))
    assert done.returncode == 0, said(done)
    assert "loss-masked tokens" in said(done)
    result = _trainer_check(trainers_site, "vocab", str(out), "64")
    assert result["problems"] == [], result
    reader = HiddenStatesReader(stores["llama"])
    masked = sum(int(reader.sample(int(i)).loss_mask.sum()) for i in reader.available_samples)
    assert result["counted"] == masked


def test_a_killed_export_resumes_without_rewriting_whole_files(
    stores: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    command = [*HSX, "export", stores["llama"], "--format", "modelopt", "--out", str(out)]
    child = subprocess.Popen(
        [*command, "--writers", "1", "--unit-samples", "1"],
        cwd=REPO_ROOT,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    parts = out / ".hsx-export" / "parts"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(parts.glob("unit-*.json"))) < 3:
        time.sleep(0.005)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(30)
    assert not (out / "hsx-export.json").exists(), "the export finished before the kill"
    before = {p: p.stat().st_ino for p in (out / "data").glob("*.pt")}
    assert before, "nothing written before the kill"
    unfinished = hsx("verify", str(out))
    assert unfinished.returncode == 3 and "INCOMPLETE" in said(unfinished), said(unfinished)

    resumed = hsx(
        "export", stores["llama"], "--format", "modelopt", "--out", str(out), "--unit-samples", "1"
    )
    assert resumed.returncode == 0, said(resumed)
    rewritten = [p.name for p, inode in before.items() if p.stat().st_ino != inode]
    assert rewritten == [], f"whole files written again: {rewritten}"
    manifest = json.loads((out / "hsx-export.json").read_text())
    assert len(manifest["files"]) == len(HiddenStatesReader(stores["llama"]).available_samples)
    assert hsx("verify", str(out)).returncode == 0

    victim = sorted(before)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    flipped = hsx("verify", str(out))
    assert flipped.returncode == 1, said(flipped)
    assert f"data/{victim.name}" in said(flipped) and "expected xxh3_128" in said(flipped)
    repaired = hsx(
        "export", stores["llama"], "--format", "modelopt", "--out", str(out), "--unit-samples", "1"
    )
    assert repaired.returncode == 0, said(repaired)
    assert hsx("verify", str(out)).returncode == 0  # the re-run wrote exactly that file again

    changed = hsx(
        "export", stores["llama"], "--format", "modelopt", "--out", str(out), "--samples", "0:5"
    )
    assert changed.returncode == 2 and "was made with other inputs" in said(changed), said(changed)
