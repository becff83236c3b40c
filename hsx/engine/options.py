"""vLLM engine options for extraction, computed without importing vLLM (preflight shows them,
planning needs the dtype) — vLLM's import alone takes seconds."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.engine.capture_models import needs_hsx_capture
from hsx.errors import ConfigError
from hsx.model.config import read_config, text_config
from hsx.model.layer_structure import layer_structure
from hsx.model.limits import model_max_len
from settings import EngineSettings

# Where vLLM finds hsx's connector (hsx.engine.connector imports vLLM, so the names live here).
CONNECTOR_NAME = "HsxHiddenStatesConnector"
CONNECTOR_MODULE = "hsx.engine.connector"


def cuda_available() -> bool:
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


# vLLM's CPU MLA backends (vllm/platforms/cpu.py): AMX_MLA is picked whenever the CPU has AMX
# tiles and refuses float32 weights ("expect weight to be bfloat16, float16, int8, ..."), CPU_MLA
# is the reference implementation and takes every dtype.
AMX_MLA = "AMX_MLA"
CPU_MLA = "CPU_MLA"
_AMX_MLA_DTYPES = ("bfloat16", "float16")


def cpu_has_amx_tiles() -> bool:
    """AMX as vLLM's CPU platform detects it (torch), falling back to /proc/cpuinfo."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        return bool(probe())
    from hsx.engine.platform import cpu_has_amx

    return cpu_has_amx()


@dataclass(frozen=True)
class BackendChoice:
    """The attention backend hsx asks vLLM for (None: vLLM's own choice) and why."""

    name: str | None
    reason: str


def choose_attention_backend(
    engine: EngineSettings,
    config: dict[str, Any],
    dtype: str,
    on_gpu: bool | None = None,
    amx: bool | None = None,
) -> BackendChoice:
    """A backend that supports ``dtype`` on this machine (``on_gpu``/``amx`` None: this
    machine's); ConfigError for a forced one that cannot run here, naming what it needs and
    what was found."""
    gpu = cuda_available() if on_gpu is None else on_gpu
    mla = is_mla(config)
    forced = None if engine.attention_backend == "auto" else engine.attention_backend
    if gpu:
        if forced in (AMX_MLA, CPU_MLA):
            raise ConfigError(
                f"engine.attention_backend: expected a GPU backend on this CUDA machine, "
                f"found the CPU backend {forced}"
            )
        return BackendChoice(
            forced, "forced by engine.attention_backend" if forced else "vLLM's choice for the GPU"
        )
    if not mla:
        return BackendChoice(
            forced, "forced by engine.attention_backend" if forced else "vLLM's CPU attention"
        )
    amx = cpu_has_amx_tiles() if amx is None else amx
    if forced == AMX_MLA:
        if not amx:
            raise ConfigError(
                "engine.attention_backend: AMX_MLA expects a CPU with AMX tiles (amx_tile); "
                "found none on this CPU: use auto or CPU_MLA"
            )
        if dtype not in _AMX_MLA_DTYPES:
            raise ConfigError(
                f"engine.attention_backend: AMX_MLA expects dtype in {list(_AMX_MLA_DTYPES)}, "
                f"found {dtype}: use auto or CPU_MLA for {dtype}"
            )
        return BackendChoice(AMX_MLA, "forced by engine.attention_backend (CPU has AMX)")
    if forced is not None:
        return BackendChoice(forced, "forced by engine.attention_backend")
    if amx and dtype not in _AMX_MLA_DTYPES:
        return BackendChoice(
            CPU_MLA, f"CPU has AMX, whose MLA backend refuses {dtype}: reference CPU_MLA"
        )
    if amx:
        return BackendChoice(None, f"vLLM's choice: AMX_MLA (CPU has AMX, dtype {dtype})")
    return BackendChoice(None, "vLLM's choice: CPU_MLA (CPU without AMX)")


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict[str, Any], dtype: str, captured_layers: int) -> int:
    """KV cache bytes one token takes at TP=1: every attention layer (a hybrid's linear-attention
    layers keep a state per sequence instead: ``linear_state_bytes``), plus the cache-only layer
    in which extract_hidden_states keeps the token's [K, H] states."""
    text = text_config(config)
    item = _DTYPE_BYTES.get(dtype, 2)
    layers = int(text["num_hidden_layers"]) - len(layer_structure(text).linear_attention_layers())
    hidden = int(text["hidden_size"])
    if is_mla(config):  # MLA caches the compressed latent and the rope key, shared by heads
        per_layer = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 64))
    else:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        per_layer = 2 * kv_heads * head_dim
    return (layers * per_layer + captured_layers * hidden) * item


def kv_cache_bytes(
    engine: EngineSettings,
    config: dict[str, Any],
    dtype: str,
    captured_layers: int,
    max_model_len: int,
    on_gpu: bool | None = None,
) -> int | None:
    """The KV cache size hsx asks for; None leaves it to vLLM (GPUs, unset)."""
    if engine.kv_cache_memory_gib is not None:
        return int(engine.kv_cache_memory_gib * (1 << 30))
    if cuda_available() if on_gpu is None else on_gpu:
        return None
    per_token = kv_bytes_per_token(config, dtype, captured_layers)
    return max(1 << 30, 2 * max_model_len * per_token)


def engine_kwargs(
    model_dir: Path,
    engine: EngineSettings,
    layer_ids: Sequence[int],
    sink_id: str,
    spool_dir: str,
    config: dict[str, Any] | None = None,
    ring_granules: int = 0,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for extraction (also shown by preflight).

    ``attention_backend`` is hsx's key: hsx.engine.vllm_compat turns it into what the installed
    vLLM takes."""
    config = read_config(model_dir) if config is None else config
    dtype = resolve_dtype(engine, config)
    max_model_len = engine.max_model_len or model_max_len(config, model_dir).tokens
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        # A prefix-cache hit skips the forward of repeated tokens: their states would be missing.
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(engine.max_num_batched_tokens, max_model_len),
        "max_num_seqs": engine.max_num_seqs,
        "tensor_parallel_size": engine.tensor_parallel_size,
        # hsx's own capture hooks (hsx.engine.capture_models) run eagerly.
        "enforce_eager": engine.enforce_eager
        or needs_hsx_capture(config.get("architectures") or []),
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
            "kv_connector_extra_config": {
                "sink_id": sink_id,
                "spool_dir": spool_dir,
                "ring_granules": ring_granules,
            },
        },
    }
    if engine.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    kv_bytes = kv_cache_bytes(engine, config, dtype, len(layer_ids), max_model_len)
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    backend = choose_attention_backend(engine, config, dtype)
    if backend.name is not None:
        kwargs["attention_backend"] = backend.name
    rotary = engine.mla_rotary_custom_op
    if rotary == "off" or (rotary == "auto" and is_mla(config) and not cuda_available()):
        # vLLM's CPU rotary kernel is wrong for MLA's 3-D queries (2.5e-2 error against HF).
        kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return kwargs


def result_ring_bytes(engine: EngineSettings, spool_dir: str) -> int:
    """Size of the shared-memory result ring of an engine in a child process."""
    if engine.result_ring_gib is not None:
        return int(engine.result_ring_gib * (1 << 30))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    wanted = min(16 << 30, max(256 << 20, memory // 16))
    free = shutil.disk_usage(spool_dir).free
    return max(64 << 20, min(wanted, free // 4))


def linear_state_bytes(config: dict[str, Any], dtype: str) -> int:
    """State bytes one sequence takes in a hybrid's linear-attention layers at TP=1 (Gated
    DeltaNet: the convolution's last kernel-1 inputs of q, k, v and the recurrent state of each
    value head, key dim x value dim); 0 for a model without such layers."""
    text = text_config(config)
    linear = len(layer_structure(text).linear_attention_layers())
    if not linear:
        return 0
    item = _DTYPE_BYTES.get(dtype, 2)
    key_heads = int(text.get("linear_num_key_heads") or 0)
    value_heads = int(text.get("linear_num_value_heads") or 0)
    key_dim = int(text.get("linear_key_head_dim") or 0)
    value_dim = int(text.get("linear_value_head_dim") or 0)
    kernel = int(text.get("linear_conv_kernel_dim") or 4)
    conv = (kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim)
    recurrent = value_heads * key_dim * value_dim
    return linear * (conv + recurrent) * item
