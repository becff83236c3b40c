"""The model's own context length, derived from config.json as vLLM derives it, and the
settings' lengths resolved against it.

``engine.max_model_len`` and ``data.max_length`` default to None: the model's limit and one
token less (vLLM samples one token after each prompt). A value above the model's limit fails
here, in seconds, naming both numbers, instead of failing every chunk after the model load
("User-specified max_model_len (4096) is greater than the derived max_model_len ...").
Computed without importing vLLM (its import alone takes seconds); tests/integration/
test_model_limits.py compares it with vLLM's own derivation on the fixture configs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.errors import ConfigError
from hsx.model.config import text_config
from settings import HsxSettings

# The keys vLLM reads for the model's length, smallest wins (vLLM 0.26-0.32:
# ModelArchConfigConvertor.derive_max_model_len_and_key); model_max_length overrides them.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length (vLLM 0.32's list).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# What vLLM assumes when config.json names no length.
_VLLM_DEFAULT_LENGTH = 2048


@dataclass(frozen=True)
class ModelLimit:
    """The longest sequence the model takes, and where that number came from."""

    tokens: int
    source: str  # e.g. "max_position_embeddings=2048", "tokenizer model_max_length=1024"


def _rope_parameters(text: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """RoPE settings as transformers 4.x (rope_scaling) or 5.x (rope_parameters) write them."""
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if isinstance(value, dict):
            if value and all(isinstance(v, dict) for v in value.values()):
                yield from value.values()  # per layer type (full_attention, sliding, ...)
            else:
                yield value
            return


def model_max_len(config: dict[str, Any], model_dir: Path | None = None) -> ModelLimit:
    """The model's max length as vLLM derives it when max_model_len is not given."""
    text = text_config(config)
    derived: float = math.inf
    source = ""
    for key in _LENGTH_KEYS:
        value = text.get(key)
        if isinstance(value, int | float) and value < derived:
            derived, source = value, f"{key}={value}"
    if isinstance(text.get("model_max_length"), int | float) and text["model_max_length"]:
        derived, source = text["model_max_length"], f"model_max_length={text['model_max_length']}"
    tokenizer_limit = _tokenizer_max_length(model_dir)
    if tokenizer_limit is not None and tokenizer_limit < derived:
        derived, source = (
            tokenizer_limit,
            f"tokenizer_config.json model_max_length={tokenizer_limit}",
        )
    if derived == math.inf:
        derived, source = (
            _VLLM_DEFAULT_LENGTH,
            f"no length key in config.json (vLLM assumes {_VLLM_DEFAULT_LENGTH})",
        )
    factor = 1.0
    for rope in _rope_parameters(text):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in _PRESCALED_ROPE and rope.get("factor") is not None:
            factor = float(rope["factor"])
    if factor != 1.0:
        source += f" x rope factor {factor:g}"
    return ModelLimit(int(derived * factor), source)


def _tokenizer_max_length(model_dir: Path | None) -> int | None:
    if model_dir is None:
        return None
    path = model_dir / "tokenizer_config.json"
    try:
        value = json.loads(path.read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    # transformers writes 1e30 for "no limit"
    return int(value) if isinstance(value, int | float) and value < 1e12 else None


def resolve_lengths(settings: HsxSettings, config: dict[str, Any]) -> HsxSettings:
    """``settings`` with engine.max_model_len and data.max_length filled in from the model's
    limit; raises ConfigError, naming both numbers, for a value the model cannot take.
    Idempotent: resolved settings come back unchanged."""
    limit = model_max_len(config, settings.model)
    max_model_len = settings.engine.max_model_len
    if max_model_len is None:
        max_model_len = limit.tokens
    elif max_model_len > limit.tokens:
        raise ConfigError(
            f"engine.max_model_len: expected at most the model's limit {limit.tokens} "
            f"({limit.source} in {settings.model}), found {max_model_len}; leave it unset to "
            f"use the model's limit"
        )
    max_length = settings.data.max_length
    if max_length is None:
        max_length = max_model_len - 1
    elif max_length >= max_model_len:
        raise ConfigError(
            f"data.max_length: expected below engine.max_model_len {max_model_len} (vLLM "
            f"samples one token after each prompt), found {max_length}"
        )
    if (max_model_len, max_length) == (settings.engine.max_model_len, settings.data.max_length):
        return settings
    return settings.model_copy(
        update={
            "engine": settings.engine.model_copy(update={"max_model_len": max_model_len}),
            "data": settings.data.model_copy(update={"max_length": max_length}),
        }
    )
