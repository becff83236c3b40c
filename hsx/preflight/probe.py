"""Model-load probe: the same architecture, reduced, through the exact extraction path.

A reduced config (few layers, few experts, a narrower residual stream, the same attention head
shapes and rope) is given seeded random weights. Where transformers implements the architecture
the weights are real safetensors and HF runs the same reduced model as the numeric reference; that
catches engine kernel bugs such as vLLM's CPU rotary op, which is wrong for MLA's 3-D queries
(2.5e-2 error against HF with it on, 1e-7 off). Otherwise vLLM runs it on dummy weights and only
shapes, dtypes and finiteness are checked. The probe then runs one small dataset through the same
engine, connector, writer and reader as a real extraction, into a memory:// store.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hsx.data.tiny_models import seeded_init
from hsx.preflight.reduction import PROBE_LAYERS, reduce_model
from hsx.preflight.report import CheckResult, Status
from settings import EngineSettings
from settings.models import SettingsWithoutEnvironment

logger = logging.getLogger(__name__)

NUMERIC_TOLERANCE = 1e-3  # fp32; measured 1e-7..1e-5 when correct, 2.5e-2 for the rotary bug


# bfloat16 probes: the engine's error against HF float32 may be this many times HF's own
# bfloat16 error (different kernels round differently; a wrong kernel is off by the values'
# own size).
BF16_SPREAD_FACTOR = 3.0


def _probe_dtype(cfg: Mapping[str, Any]) -> str:
    """float32, except MLA on GPUs: vLLM has no float32 MLA backend for CUDA (measured on the
    H200 with vLLM 0.26: "No valid attention backend found ... dtype=torch.float32, use_mla=True")."""
    import os

    import torch

    if not torch.cuda.is_available():
        return "float32"
    # Triton's float32 dots default to TF32 (vLLM's Triton attention: 5.7e-3..2.1e-2 against HF
    # on the reduced Llama, measured on the H200); "ieee" makes them exact.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    return "bfloat16" if cfg.get("kv_lora_rank") else "float32"


def _hf_spread(
    hf_model: Any,
    samples: Sequence[Any],
    layer_ids: Sequence[int],
    references: Sequence[Any],
    dtype: str,
) -> list[float]:
    """Per captured layer: max abs difference between HF in ``dtype`` and in float32 (MoE
    layers flip experts in bfloat16, so layers after the first MoE layer spread far more)."""
    import copy

    import torch

    from hsx.preflight.hf_reference import hf_hidden_states

    low = copy.deepcopy(hf_model).to(getattr(torch, dtype))
    lowered = hf_hidden_states(low, [s.input_ids.numpy() for s in samples], layer_ids)
    return [
        max(float((a - b)[:, j].abs().max()) for a, b in zip(lowered, references, strict=True))
        for j in range(len(layer_ids))
    ]


def _hf_model_class(config: Mapping[str, Any]) -> Any:
    import transformers

    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return None


def _write_weights(cfg: dict[str, Any], target: Path) -> Any:
    """Seeded random weights through HF (returns the HF model), or None when HF lacks the class."""
    import torch

    cls = _hf_model_class(cfg)
    if cls is None:
        return None
    fields = {
        k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")
    }
    config = cls.config_class(**fields)
    config.architectures = list(cfg["architectures"])
    torch.manual_seed(0)
    model = seeded_init(cls(config).to(torch.float32).eval())
    model.save_pretrained(str(target), safe_serialization=True)
    return model


def run_probe(
    config: Mapping[str, Any],
    text: Mapping[str, Any],
    layer_ids: Sequence[int],
    lowest_layer_id: int,
    engine: EngineSettings,
    reduced_layers: int = PROBE_LAYERS,
    dtype: str | None = None,
    language_architecture: str | None = None,
) -> CheckResult:
    """Build the reduced model, extract a small batch through hsx's path, check it.

    ``dtype`` None: float32 on CPUs (compared with HF within NUMERIC_TOLERANCE); bfloat16 on
    GPUs, compared with HF float32 within BF16_SPREAD_FACTOR x HF's own bfloat16 spread. On
    GPUs vLLM has no float32 MLA backend, and its Triton attention kernels compute float32 dots
    in TF32 (measured on the H200, reduced Llama: 5.7e-3..2.1e-2 against HF float32).

    ``language_architecture``: the text model a multimodal wrapper builds (preflight's
    resolution), which the probe runs in its place: the same decoder, without a vision tower."""
    from hsx.data.sample_data import write_jsonl
    from hsx.data.tiny_models import train_tokenizer
    from hsx.data.tokenization import TokenizedSample  # noqa: F401  (import check: the path loads)
    from hsx.engine.vllm_engine import drop_engine
    from hsx.extraction.chunk_extraction import RunContext
    from hsx.extraction.run import ExtractionRun
    from hsx.extraction.steps import plan_and_create_store
    from hsx.preflight.hf_reference import hf_hidden_states
    from hsx.store.reader import HiddenStatesReader

    started = time.perf_counter()
    reduced = reduce_model(text, layer_ids, lowest_layer_id, reduced_layers)
    mapped, layers, cfg = reduced.layer_ids, reduced.layers, reduced.config
    notes = list(reduced.notes)
    architectures = list(config.get("architectures") or [])
    if language_architecture and architectures[:1] != [language_architecture]:
        notes.append(f"runs {language_architecture}, the text model {architectures} wraps")
        architectures = [language_architecture]
    cfg["architectures"] = architectures
    workdir = Path(tempfile.mkdtemp(prefix="hsx-probe-"))
    url = f"memory://hsx-probe-{uuid.uuid4().hex}"
    try:
        model_dir = workdir / "model"
        model_dir.mkdir()
        hf_model = _write_weights(cfg, model_dir)
        written = (
            json.loads((model_dir / "config.json").read_text()) if hf_model is not None else {}
        )
        (model_dir / "config.json").write_text(
            json.dumps({**cfg, **written, "architectures": cfg["architectures"]}, indent=1)
        )
        train_tokenizer(model_dir)
        dataset = write_jsonl(workdir / "probe.jsonl", 3, seed=7)
        probe_dtype = dtype or _probe_dtype(cfg)
        probe_engine = engine.model_copy(
            update={
                "dtype": probe_dtype,
                "max_model_len": 512,
                "kv_cache_memory_gib": 0.25,
                "load_format": "auto" if hf_model is not None else "dummy",
                "tensor_parallel_size": 1,
                # The probe compares with HF in float32, which AMX's MLA backend refuses.
                "attention_backend": "CPU_MLA"
                if engine.attention_backend == "AMX_MLA"
                else engine.attention_backend,
            }
        )
        settings = SettingsWithoutEnvironment(
            model=model_dir,
            dataset=dataset,
            store=url,
            engine=probe_engine,
            capture={"layer_ids": list(mapped)},
            data={"max_length": 256},
            layout={"rows_per_chunk": 64, "work_chunk_tokens": 64},
            run={"preflight": False},
        )
        summary = plan_and_create_store(settings)
        try:
            with ExtractionRun.open(settings) as run:
                for index in summary.pending:
                    run.extract(index, RunContext("preflight-probe"))
        finally:
            drop_engine(model_dir, probe_engine, mapped)  # never kept beside the real one
        reader = HiddenStatesReader(url)
        samples = [reader.sample(i) for i in range(reader.num_samples)]
        problems: list[str] = []
        hidden = int(cfg["hidden_size"])
        for sample in samples:
            shape = tuple(sample.hidden_states.shape)
            if shape != (sample.input_ids.shape[0], len(mapped), hidden):
                problems.append(
                    f"sample {sample.index}: expected states {(sample.input_ids.shape[0], len(mapped), hidden)}, found {shape}"
                )
            if not bool(np.isfinite(sample.hidden_states.float().numpy()).all()):
                problems.append(f"sample {sample.index}: non-finite hidden states")
        worst = None
        spread_ratio: float | None = None
        measured: list[str] = []
        if hf_model is not None:
            references = hf_hidden_states(hf_model, [s.input_ids.numpy() for s in samples], mapped)
            errors = [
                float((s.hidden_states.float() - r).abs().amax(dim=(0, 2)).max())
                for s, r in zip(samples, references, strict=True)
            ]
            per_layer = np.max(
                [
                    [
                        (s.hidden_states.float() - r)[:, j].abs().max().item()
                        for j in range(len(mapped))
                    ]
                    for s, r in zip(samples, references, strict=True)
                ],
                axis=0,
            )
            worst = max(errors)
            measured.append(
                "max abs diff against HF float32 per id: "
                + ", ".join(f"{i}: {e:.2e}" for i, e in zip(mapped, per_layer, strict=True))
            )
            tolerances = [NUMERIC_TOLERANCE] * len(mapped)
            if probe_dtype != "float32":
                spread = _hf_spread(hf_model, samples, mapped, references, probe_dtype)
                tolerances = [max(NUMERIC_TOLERANCE, BF16_SPREAD_FACTOR * x) for x in spread]
                # What a reader needs of a low-precision run: how far each layer is from HF
                # against HF's own spread in that dtype (an absolute error reads as a failure).
                spread_ratio = max(
                    float(e) / max(float(x), 1e-30) for e, x in zip(per_layer, spread, strict=True)
                )
                measured.append(
                    f"{probe_dtype}: error vs HF's own {probe_dtype} spread per id: "
                    + ", ".join(
                        f"{i}: {e:.2e}/{x:.2e}"
                        for i, e, x in zip(mapped, per_layer, spread, strict=True)
                    )
                )
            tolerance = max(tolerances)
            if any(e > t for e, t in zip(per_layer, tolerances, strict=True)):
                bad = ", ".join(f"id {i}: {e:.2e}" for i, e in zip(mapped, per_layer, strict=True))
                problems.append(
                    f"engine states differ from HF transformers: expected max abs error <= {tolerance:.2e} ({probe_dtype}), "
                    f"found {worst:.2e} ({bad}); an engine kernel is wrong for this architecture "
                    "(for MLA on CPU: keep mla_rotary_custom_op='auto' or 'off')"
                )
        seconds = time.perf_counter() - started
        details = (
            f"reduced model: {layers} layers, hidden {hidden}, ids "
            + reduced.describe_ids(layer_ids),
            *notes,
            *measured,
        )
        if problems:
            return CheckResult("probe", Status.FAIL, problems[0], tuple(problems[1:]) + details)
        if worst is None:
            return CheckResult(
                "probe",
                Status.WARN,
                f"dummy-weight run OK in {seconds:.1f} s ({len(samples)} samples); transformers lacks {cfg['architectures']}, so no numeric cross-check",
                details,
            )
        status = Status.WARN if notes else Status.PASS
        matched = (
            f"matches HF within {worst:.1e} ({probe_dtype})"
            if spread_ratio is None
            else f"every layer within {spread_ratio:.2f}x HF's own {probe_dtype} spread "
            f"(allowed {BF16_SPREAD_FACTOR:g}x)"
        )
        return CheckResult(
            "probe",
            status,
            f"extraction path OK in {seconds:.1f} s; {matched} on {len(samples)} samples",
            details,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            import fsspec

            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
        except FileNotFoundError:
            pass
