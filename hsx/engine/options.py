"""vLLM engine options for extraction, computed without importing vLLM (preflight shows them,
planning needs the dtype) — vLLM's import alone takes seconds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsx.plan import read_config, text_config
from settings import EngineSettings

# Where vLLM finds hsx's connector (hsx.engine.connector imports vLLM, so the names live here).
CONNECTOR_NAME = "HsxHiddenStatesConnector"
CONNECTOR_MODULE = "hsx.engine.connector"


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


_MLA_MARKERS = ("kv_lora_rank",)


def is_mla(config: dict[str, Any]) -> bool:
    return any(text_config(config).get(marker) for marker in _MLA_MARKERS)


def resolve_dtype(engine: EngineSettings, config: dict[str, Any]) -> str:
    """The engine's compute dtype as a torch name ('float32', 'bfloat16', 'float16')."""
    if engine.dtype != "auto":
        return engine.dtype
    declared = (
        text_config(config).get("torch_dtype") or text_config(config).get("dtype") or "float32"
    )
    return str(declared).replace("torch.", "")


def engine_kwargs(
    model_dir: Path, engine: EngineSettings, layer_ids: Sequence[int], sink_id: str, spool_dir: str
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for extraction (also shown by preflight)."""
    config = read_config(model_dir)
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": resolve_dtype(engine, config),
        "max_model_len": engine.max_model_len,
        # A prefix-cache hit skips the forward of repeated tokens: their states would be missing.
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": int(engine.kv_cache_memory_gib * (1 << 30)),
        "max_num_batched_tokens": max(engine.max_num_batched_tokens, engine.max_model_len),
        "max_num_seqs": engine.max_num_seqs,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed,
        "load_format": engine.load_format,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
            },
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"sink_id": sink_id, "spool_dir": spool_dir},
        },
    }
    rotary = engine.mla_rotary_custom_op
    if rotary == "off" or (rotary == "auto" and is_mla(config) and not _cuda_available()):
        # vLLM's CPU rotary kernel is wrong for MLA's 3-D queries (2.5e-2 error against HF).
        kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return kwargs
