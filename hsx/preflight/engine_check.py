"""Preflight's engine check: the options the engine will be built with (dtype, attention backend,
max_model_len, KV cache), each decided from config.json and the machine, in milliseconds.

It catches, before the model load, what otherwise fails at engine start or in every chunk: a
max_model_len above the model's limit, AMX's MLA backend given float32 weights, and a KV cache
too small to hold one sequence of max_model_len tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx.engine.options import (
    choose_attention_backend,
    kv_bytes_per_token,
    linear_state_bytes,
    resolve_dtype,
)
from hsx.errors import ConfigError
from hsx.model.limits import model_max_len
from hsx.preflight.report import CheckResult, Status
from settings import EngineSettings


def check_engine_options(
    model_dir: Path,
    config: dict[str, Any],
    engine: EngineSettings,
    captured_layers: int,
    max_length: int | None = None,
) -> CheckResult:
    """What the engine will be built with, and whether that can run here."""
    limit = model_max_len(config, model_dir)
    dtype = resolve_dtype(engine, config)
    problems: list[str] = []
    max_model_len = engine.max_model_len or limit.tokens
    if engine.max_model_len is not None and engine.max_model_len > limit.tokens:
        problems.append(
            f"engine.max_model_len: expected at most the model's limit {limit.tokens} "
            f"({limit.source}), found {engine.max_model_len}"
        )
    if max_length is not None and max_length >= max_model_len:
        problems.append(
            f"data.max_length: expected below engine.max_model_len {max_model_len}, found {max_length}"
        )
    try:
        backend = choose_attention_backend(engine, config, dtype)
        backend_text = f"{backend.name or 'vLLM default'} ({backend.reason})"
    except ConfigError as exc:
        problems.append(str(exc))
        backend_text = f"{engine.attention_backend} (refused)"
    details = [
        f"dtype {dtype}; attention backend {backend_text}",
        f"max_model_len {max_model_len} (model limit {limit.tokens}: {limit.source})",
    ]
    state = linear_state_bytes(config, dtype)
    if state:
        details.append(
            f"linear-attention state {state / (1 << 20):,.1f} MiB per sequence (beside the "
            f"{kv_bytes_per_token(config, dtype, captured_layers):,} B/token of attention KV "
            "and captured states)"
        )
    if engine.kv_cache_memory_gib is not None:
        capacity = int(engine.kv_cache_memory_gib * (1 << 30))
        per_token = kv_bytes_per_token(config, dtype, captured_layers)
        per_token_device = max(1, per_token // engine.tensor_parallel_size)
        needed = per_token_device * max_model_len
        details.append(
            f"KV cache {engine.kv_cache_memory_gib:g} GiB holds ~{capacity // per_token_device:,} "
            f"tokens at {per_token_device:,} B/token/device"
        )
        if needed > capacity:
            problems.append(
                f"engine.kv_cache_memory_gib: expected room for one sequence of max_model_len "
                f"{max_model_len} tokens (~{needed / (1 << 30):.2f} GiB at {per_token_device:,} "
                f"B/token/device), found {engine.kv_cache_memory_gib:g} GiB: raise it or lower "
                f"engine.max_model_len"
            )
    summary = f"dtype {dtype}, backend {backend_text.split(' (')[0]}, max_model_len {max_model_len}"
    if problems:
        return CheckResult("engine", Status.FAIL, problems[0], tuple(problems[1:]) + tuple(details))
    return CheckResult("engine", Status.PASS, summary, tuple(details))
