"""Rough resource arithmetic from config.json: parameter count, weight bytes, memory and disk.

These are estimates for a preflight verdict ("will it fit at all?"), not an allocator: they count
the large matrices (embeddings, attention incl. MLA, dense and MoE MLPs, MTP layers) and ignore
biases and small buffers, which are well under 1% for the models hsx targets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hsx.model.config import text_config
from hsx.preflight.report import CheckResult, Status
from hsx.store.storage_io import free_bytes_at

GIB = 1024**3
# why: vLLM's default gpu_memory_utilization is 0.9, and the KV cache needs room beyond weights.
_FAIL_FRACTION = 0.9
_WARN_FRACTION = 0.75
_DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "bfloat16": 2.0, "float16": 2.0, "half": 2.0}


def _int(cfg: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _attention_params(cfg: Mapping[str, Any], hidden: int) -> int:
    heads = _int(cfg, "num_attention_heads", "n_head", default=1)
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi-K2)
        kv_rank = _int(cfg, "kv_lora_rank")
        q_rank = _int(cfg, "q_lora_rank")
        nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
        v_dim = _int(cfg, "v_head_dim", default=nope)
        q_dim = heads * (nope + rope)
        q = hidden * q_rank + q_rank + q_rank * q_dim if q_rank else hidden * q_dim
        kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden
    head_dim = _int(cfg, "head_dim", default=hidden // max(heads, 1))
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    return hidden * head_dim * (2 * heads + 2 * kv_heads)


def _is_moe_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    if experts == 0:
        return False
    first_dense = _int(cfg, "first_k_dense_replace")
    freq = max(_int(cfg, "moe_layer_freq", default=1), 1)
    return layer >= first_dense and layer % freq == 0


def _mlp_params(cfg: Mapping[str, Any], hidden: int, moe: bool) -> int:
    dense_inter = _int(cfg, "intermediate_size", "ffn_dim", default=4 * hidden)
    if not moe:
        return 3 * hidden * dense_inter
    experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    inter = _int(cfg, "moe_intermediate_size", default=dense_inter)
    shared = _int(cfg, "n_shared_experts") * 3 * hidden * inter
    shared += 3 * hidden * _int(cfg, "shared_expert_intermediate_size")
    return experts * 3 * hidden * inter + shared + experts * hidden  # + router


def estimate_param_count(config: Mapping[str, Any]) -> int:
    """Parameters config.json implies, including MTP layers shipped in the checkpoint."""
    cfg = text_config(config)
    hidden = _int(cfg, "hidden_size", "d_model", "n_embd")
    layers = _int(cfg, "num_hidden_layers", "n_layer")
    vocab = _int(cfg, "vocab_size")
    if hidden <= 0 or layers <= 0:
        raise ValueError(
            "config.json must give hidden_size and num_hidden_layers to estimate weights; "
            f"found hidden_size={cfg.get('hidden_size')!r}, "
            f"num_hidden_layers={cfg.get('num_hidden_layers')!r}"
        )
    attention = _attention_params(cfg, hidden)
    total = 0
    for layer in range(layers):
        total += attention + _mlp_params(cfg, hidden, _is_moe_layer(cfg, layer)) + 2 * hidden
    # why: DeepSeek-V3 ships its multi-token-prediction layer in the same shards (~11.5B params).
    mtp = _int(cfg, "num_nextn_predict_layers")
    total += mtp * (attention + _mlp_params(cfg, hidden, True) + 2 * hidden * hidden + 4 * hidden)
    embeddings = vocab * hidden
    tied = bool(cfg.get("tie_word_embeddings", False))
    return total + hidden + embeddings * (1 if tied else 2)


def bytes_per_param(config: Mapping[str, Any]) -> float:
    """Bytes per weight the checkpoint stores: quantization bits if quantized, else the dtype."""
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        bits = _find_bits(quant)
        if bits:
            return bits / 8
        if "fp8" in method or "fp8" in str(quant.get("fmt", "")).lower():
            return 1.0
        if "fp4" in method or "mxfp4" in method:
            return 0.5
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").lower()
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2.0)


def _find_bits(quant: Mapping[str, Any]) -> int | None:
    """Weight bit width from a quantization_config (compressed-tensors nests it in groups)."""
    for key in ("bits", "num_bits", "weight_bits", "w_bit"):
        value = quant.get(key)
        if isinstance(value, int):
            return value
    groups = quant.get("config_groups")
    if isinstance(groups, Mapping):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and isinstance(weights.get("num_bits"), int):
                return int(weights["num_bits"])
    return None


def estimate_weight_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of weights config.json implies (parameter count x stored bytes per parameter)."""
    return int(estimate_param_count(config) * bytes_per_param(config))


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def check_resources(
    config: Mapping[str, Any],
    tensor_parallel_size: int,
    device_memory_bytes: int | None,
    bytes_per_token: int,
    dataset_tokens: int | None,
    store_url: str,
) -> CheckResult:
    """Weights per device vs device memory; captured bytes vs free space at a local store."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; found {tensor_parallel_size}")
    statuses: list[Status] = []
    parts: list[str] = []
    details: list[str] = []

    weights = estimate_weight_bytes(config)
    per_device = weights / tensor_parallel_size
    details.append(
        f"weights: ~{estimate_param_count(config) / 1e9:,.1f}B params x "
        f"{bytes_per_param(config):g} B = {_gib(weights)}; {_gib(per_device)} per device at "
        f"TP={tensor_parallel_size}"
    )
    if device_memory_bytes is None:
        parts.append(f"weights {_gib(per_device)}/device (device memory unknown)")
    else:
        share = per_device / device_memory_bytes
        parts.append(f"weights {_gib(per_device)}/device of {_gib(device_memory_bytes)}")
        if share > _FAIL_FRACTION:
            need = math.ceil(weights / (_FAIL_FRACTION * device_memory_bytes))
            statuses.append(Status.FAIL)
            details.append(
                f"weights do not fit: expected <= {_FAIL_FRACTION:.0%} of device memory per "
                f"device (vLLM's default gpu_memory_utilization); found {share:.0%} at "
                f"TP={tensor_parallel_size} (needs TP >= {need})"
            )
        elif share > _WARN_FRACTION:
            statuses.append(Status.WARN)
            details.append(f"weights take {share:.0%} of device memory: little room for KV cache")

    free_space = free_bytes_at(store_url)
    if dataset_tokens is None:
        parts.append("store size unknown (dataset tokens not counted)")
    else:
        needed = bytes_per_token * dataset_tokens
        details.append(
            f"store: {bytes_per_token:,} B/token x {dataset_tokens:,} tokens = {_gib(needed)}"
        )
        if free_space is None:
            parts.append(f"store needs {_gib(needed)} (free space at {store_url} unknown)")
        else:
            probe, free = free_space
            parts.append(f"store needs {_gib(needed)} of {_gib(free)} free")
            details.append(f"free space measured at {probe}")
            if needed > free:
                statuses.append(Status.FAIL)
                details.append(
                    f"store does not fit: expected <= {_gib(free)} free at {probe}; "
                    f"found {_gib(needed)} needed"
                )
            elif needed > 0.9 * free:
                statuses.append(Status.WARN)
                details.append(f"store would use {needed / free:.0%} of free space at {probe}")

    status = max(statuses, key=[Status.PASS, Status.WARN, Status.FAIL].index, default=Status.PASS)
    return CheckResult("resources", status, "; ".join(parts), tuple(details))
