"""hsx with its defaults on every machine a user has (issue 9): the model's own length limit
(as vLLM derives it), MLA under both of vLLM's CPU backends (AMX and reference), an engine
built in a fresh process with nothing run before it (the SIGILL case), and the plain user
command with no options on the tiny Llama, the tiny DeepSeek-V3 and a 1024-position model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from hsx.engine.options import AMX_MLA, CPU_MLA, cpu_has_amx_tiles
from hsx.engine.platform import exit_description
from hsx.extraction.chunk_extraction import RunContext
from hsx.extraction.run import extract_work_chunk
from hsx.extraction.steps import plan_and_create_store
from hsx.model.config import read_config
from hsx.model.limits import model_max_len
from hsx.preflight.hf_reference import hf_hidden_states, load_hf_model
from hsx.preflight.probe import BF16_SPREAD_FACTOR, NUMERIC_TOLERANCE
from hsx.store.reader import HiddenStatesReader
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from tests.conftest import REPO_ROOT, SAMPLE_DATASET, make_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "configs"
HAS_AMX = cpu_has_amx_tiles()


@pytest.fixture(scope="module")
def llama_1024(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 1024-position config (RoPE weights are position-free)."""
    target = tmp_path_factory.mktemp("short") / "tiny-llama-1024"
    shutil.copytree(tiny_llama, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def small_dataset(folder: Path, lines: int = 24) -> Path:
    path = folder / "conversations.jsonl"
    with SAMPLE_DATASET.open() as source:
        path.write_text("".join(next(source) for _ in range(lines)))
    return path


def test_limits_match_vllms_own_derivation(
    tiny_llama: Path, tiny_deepseek: Path, llama_1024: Path
) -> None:
    """hsx derives max_model_len without importing vLLM; vLLM's ModelConfig must agree."""
    folders = [FIXTURES / n for n in ("llama-3.1-8b", "kimi-k2", "deepseek-v3")]
    folders += [tiny_llama, tiny_deepseek, llama_1024]
    script = textwrap.dedent(
        """
        import json, sys
        from vllm.config import ModelConfig
        for d in sys.argv[1:]:
            mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True)
            print(json.dumps([d, mc.max_model_len]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    derived = dict(json.loads(line) for line in out.stdout.splitlines() if line.startswith("["))
    assert len(derived) == len(folders)
    for folder in folders:
        ours = model_max_len(read_config(folder), folder).tokens
        assert ours == derived[str(folder)], f"{folder}: hsx {ours}, vLLM {derived[str(folder)]}"
    assert derived[str(llama_1024)] == 1024


@pytest.mark.parametrize("backend", [CPU_MLA, AMX_MLA])
def test_mla_under_each_cpu_backend(backend: str, tiny_deepseek: Path, tmp_path: Path) -> None:
    """Both of vLLM's CPU MLA backends, forced: CPU_MLA in fp32 equals HF within 1e-4 (on any
    CPU: with AMX vLLM would otherwise pick AMX_MLA, which refuses fp32); AMX_MLA in bf16, where
    the CPU has AMX, equals HF float32 within preflight's bound for bf16 probes: per captured
    layer, BF16_SPREAD_FACTOR x HF's own bf16 error on the same tokens."""
    if backend == AMX_MLA and not HAS_AMX:
        pytest.skip("this CPU has no AMX tiles (amx_tile): vLLM's AMX MLA backend cannot run")
    dtype = "float32" if backend == CPU_MLA else "bfloat16"
    url = f"memory://mla-{backend}-{uuid.uuid4().hex}"
    settings = make_settings(
        tiny_deepseek,
        SAMPLE_DATASET,
        url,
        engine={"dtype": dtype, "attention_backend": backend},
        data={"max_samples": 8},
        layout={"min_work_chunk_tokens": 512, "rows_per_chunk": 64},
    )
    summary = plan_and_create_store(settings)
    for index in summary.pending:
        extract_work_chunk(settings, index, RunContext(f"test-{backend}"))
    assert verify_store(ExtractionStore.open(url)).ok
    reader = HiddenStatesReader(url)
    samples = [reader.sample(i) for i in range(reader.num_samples)]
    prompts = [s.input_ids.numpy() for s in samples]
    refs = hf_hidden_states(load_hf_model(tiny_deepseek), prompts, reader.layer_ids)
    # [layers]: the engine's worst error per captured layer against HF float32
    errors = [
        max(
            float((s.hidden_states.float() - r)[:, j].abs().max())
            for s, r in zip(samples, refs, strict=True)
        )
        for j in range(len(reader.layer_ids))
    ]
    if backend == CPU_MLA:
        assert max(errors) < 1e-4, f"CPU_MLA fp32 against HF: {max(errors):.2e}"
        return
    hf_bf16 = hf_hidden_states(
        load_hf_model(tiny_deepseek, torch.bfloat16), prompts, reader.layer_ids
    )
    spread = [
        max(float((b.float() - r)[:, j].abs().max()) for b, r in zip(hf_bf16, refs, strict=True))
        for j in range(len(reader.layer_ids))
    ]
    for layer, error, own in zip(reader.layer_ids, errors, spread, strict=True):
        bound = max(NUMERIC_TOLERANCE, BF16_SPREAD_FACTOR * own)
        assert error <= bound, (
            f"AMX_MLA bf16, layer id {layer}: expected within {BF16_SPREAD_FACTOR} x HF's own "
            f"bf16 error {own:.3e}, found {error:.3e}"
        )
    for sample in samples:
        assert bool((sample.hidden_states.float().abs().amax(dim=2) > 0).all()), "all-zero row"


def test_engine_in_a_fresh_process(tiny_llama: Path, tmp_path: Path) -> None:
    """The SIGILL case: a fresh process whose first act is planning, then building the engine
    (in hsx's driver thread) and extracting; nothing else ran before it in that process."""
    store = tmp_path / "fresh.zarr"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from hsx.extraction.chunk_extraction import RunContext
        from hsx.extraction.steps import plan_and_create_store
        from hsx.extraction.run import extract_work_chunk
        from settings import HsxSettings
        settings = HsxSettings(
            model=Path({str(tiny_llama)!r}), dataset=Path({str(SAMPLE_DATASET)!r}),
            store={str(store)!r}, engine={{"dtype": "bfloat16"}}, data={{"max_samples": 16}},
            run={{"preflight": False}},
        )
        summary = plan_and_create_store(settings)
        for index in summary.pending:
            extract_work_chunk(settings, index, RunContext("fresh-process"))
        print("EXTRACTED", len(summary.pending))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, f"{exit_description(out.returncode)}:\n{out.stderr[-3000:]}"
    assert "EXTRACTED" in out.stdout
    assert verify_store(ExtractionStore.open(str(store))).ok


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_deepseek", "llama_1024"])
def test_the_plain_user_command_works_on_any_model(
    model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`hsx extract --model M --dataset D --store S`, no other option, then `hsx verify`."""
    model_dir: Path = request.getfixturevalue(model)
    dataset = small_dataset(tmp_path)
    store = tmp_path / "store.zarr"
    env = {**os.environ, "COLUMNS": "200"}
    run = [sys.executable, "-m", "flows.cli"]
    extract = subprocess.run(
        [
            *run,
            "extract",
            "--model",
            str(model_dir),
            "--dataset",
            str(dataset),
            "--store",
            str(store),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=env,
    )
    assert extract.returncode == 0, extract.stdout[-3000:] + extract.stderr[-3000:]
    assert "Failed to serialize" not in extract.stdout + extract.stderr
    verify = subprocess.run(
        [*run, "verify", str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
    )
    assert verify.returncode == 0, verify.stdout[-2000:]
    meta = ExtractionStore.open(str(store)).meta
    limit = model_max_len(read_config(model_dir), model_dir).tokens
    assert meta["settings"]["engine"]["max_model_len"] == limit
    assert meta["settings"]["data"]["max_length"] == limit - 1
