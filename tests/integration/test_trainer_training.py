"""Two EAGLE-3 training steps on CPU by each trainer's OWN training code (speculators 0.9.0,
specforge 0.2.0, nvidia-modelopt 0.47.0, from .venv/trainers), fed by hsx's export of a tiny Llama
store read with the trainer's own reader: both losses finite, gradients reach the draft.

What differs from a GPU run, all in tests/integration/trainer_training.py: a hand loop instead of
each trainer's Trainer class (CUDA-bound), speculators' "sdpa" draft attention and "eager" loss,
SpecForge's torch reference loss in place of its Triton kernel, and, for modelopt, its draft's
rotary embedding built beforehand (transformers 5.x dropped the ``device`` argument it passes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli import hsx, said
from tests.conftest import REPO_ROOT
from tests.integration.test_trainer_exports import _extracted

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
SAMPLES = 16
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def llama_store(
    tiny_llama: Path, sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """fp32 store of the tiny Llama."""
    root = tmp_path_factory.mktemp("training-store")
    return _extracted(tiny_llama, sample_dataset, str(root / "llama.zarr"), SAMPLES)


def _export(store: str, out: Path, format_name: str) -> None:
    from flows.export import export_flow

    summary = export_flow(store, str(out), format_name)  # type: ignore[arg-type]
    assert summary["samples"] == SAMPLES and summary["verification"].startswith("OK"), summary


def _train(site: Path, *args: str) -> dict[str, Any]:
    """tests/integration/trainer_training.py in a child process with the trainers' packages."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.trainer_training", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-4000:]
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def _assert_trained(result: dict[str, Any]) -> None:
    print(f"losses {result['losses']}, gradient norms {result['grad_norms']}")
    assert result["rows"] == SAMPLES
    assert len(result["losses"]) == len(result["grad_norms"]) == 2, result
    assert all(math.isfinite(loss) and loss > 0 for loss in result["losses"]), result
    assert all(math.isfinite(norm) and norm > 0 for norm in result["grad_norms"]), result


def test_speculators_trains_two_steps_from_the_export(
    prefect_harness: None,
    trainers_site: Path,
    tiny_llama: Path,
    llama_store: str,
    tmp_path: Path,
) -> None:
    out = tmp_path / "speculators"
    _export(llama_store, out, "speculators")
    result = _train(trainers_site, "speculators", str(out), str(tiny_llama))
    _assert_trained(result)
    manifest = json.loads((out / "hsx-export.json").read_text())
    assert result["aux_layers"] == manifest["aux_layer_ids_vllm"]
    hidden = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
    assert result["batch"]["hidden_states"][-1] == hidden * len(manifest["aux_layer_ids_vllm"])


def _sharded(model: Path, tmp_path: Path) -> Path:
    """SpecForge's TargetHead reads model.safetensors.index.json: the model itself if sharded,
    else a sharded copy saved by transformers."""
    if (model / "model.safetensors.index.json").exists():
        return model
    from transformers import AutoModelForCausalLM

    copy = tmp_path / "target-sharded"
    AutoModelForCausalLM.from_pretrained(model).save_pretrained(copy, max_shard_size="2MB")
    assert (copy / "model.safetensors.index.json").exists()
    return copy


def test_specforge_trains_two_steps_from_the_export(
    prefect_harness: None,
    trainers_site: Path,
    tiny_llama: Path,
    llama_store: str,
    tmp_path: Path,
) -> None:
    out = tmp_path / "specforge"
    _export(llama_store, out, "specforge")
    vocab = tmp_path / "vocab"
    done = hsx("vocab", llama_store, "--draft-vocab-size", str(DRAFT_VOCAB), "--out", str(vocab))
    assert done.returncode == 0, said(done)
    target = _sharded(tiny_llama, tmp_path)
    result = _train(trainers_site, "specforge", str(out), str(target), str(vocab))
    _assert_trained(result)


def test_modelopt_trains_two_steps_from_the_export(
    prefect_harness: None,
    trainers_site: Path,
    tiny_llama: Path,
    llama_store: str,
    tmp_path: Path,
) -> None:
    out = tmp_path / "modelopt"
    _export(llama_store, out, "modelopt")
    result = _train(trainers_site, "modelopt", str(out), str(tiny_llama))
    _assert_trained(result)
