"""The model's own length as vLLM derives it, the settings' defaults resolved against it, and
the attention backend hsx asks for on each kind of machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx.engine.options import (
    AMX_MLA,
    CPU_MLA,
    choose_attention_backend,
    kv_bytes_per_token,
    kv_cache_bytes,
)
from hsx.errors import ConfigError
from hsx.model.limits import model_max_len, resolve_lengths
from settings import EngineSettings, HsxSettings
from tests.conftest import REPO_ROOT

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "configs"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize(
    ("name", "tokens"),
    [("llama-3.1-8b", 131072), ("kimi-k2", 131072), ("deepseek-v3", 163840)],
)
def test_public_configs_limits(name: str, tokens: int) -> None:
    # llama3 and yarn RoPE leave max_position_embeddings already scaled (vLLM 0.32).
    limit = model_max_len(fixture(name))
    assert limit.tokens == tokens and "max_position_embeddings" in limit.source


def test_linear_rope_scales_and_smallest_key_wins() -> None:
    scaled = model_max_len(
        {
            "hidden_size": 8,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert scaled.tokens == 8192 and "rope factor 2" in scaled.source
    smallest = model_max_len(
        {"hidden_size": 8, "max_position_embeddings": 4096, "n_positions": 1024}
    )
    assert smallest.tokens == 1024 and smallest.source == "n_positions=1024"
    assert model_max_len({"hidden_size": 8}).tokens == 2048  # vLLM's assumption


def test_tokenizer_model_max_length_caps_the_limit(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1000}))
    limit = model_max_len({"hidden_size": 8, "max_position_embeddings": 4096}, tmp_path)
    assert limit.tokens == 1000 and "tokenizer_config.json" in limit.source
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1e30}))
    assert (
        model_max_len({"hidden_size": 8, "max_position_embeddings": 4096}, tmp_path).tokens == 4096
    )


def settings(**sections: Any) -> HsxSettings:
    return HsxSettings(model="m", dataset="d", store="s", **sections)


def test_defaults_are_the_models_limits() -> None:
    config = {"hidden_size": 8, "max_position_embeddings": 1024}
    unset = settings()
    assert (unset.engine.max_model_len, unset.data.max_length) == (None, None)
    resolved = resolve_lengths(unset, config)
    assert (resolved.engine.max_model_len, resolved.data.max_length) == (1024, 1023)
    assert resolve_lengths(resolved, config) is resolved  # idempotent
    shorter = resolve_lengths(settings(engine={"max_model_len": 512}), config)
    assert (shorter.engine.max_model_len, shorter.data.max_length) == (512, 511)


def test_a_length_above_the_models_limit_names_both_numbers() -> None:
    config = {"hidden_size": 8, "max_position_embeddings": 2048}
    with pytest.raises(ConfigError, match=r"at most the model's limit 2048 .*found 4096"):
        resolve_lengths(settings(engine={"max_model_len": 4096}), config)
    with pytest.raises(ConfigError, match=r"below engine.max_model_len 2048.*found 2048"):
        resolve_lengths(settings(data={"max_length": 2048}), config)


MLA = {"hidden_size": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 2}
DENSE = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("config", "dtype", "gpu", "amx", "expected"),
    [
        (MLA, "float32", False, True, CPU_MLA),  # AMX_MLA refuses float32
        (MLA, "bfloat16", False, True, None),  # vLLM picks AMX_MLA
        (MLA, "float32", False, False, None),  # vLLM picks CPU_MLA
        (MLA, "bfloat16", True, False, None),  # GPU: vLLM's choice
        (DENSE, "float32", False, True, None),
    ],
)
def test_backend_choice_supports_the_dtype(
    config: dict[str, Any], dtype: str, gpu: bool, amx: bool, expected: str | None
) -> None:
    choice = choose_attention_backend(EngineSettings(), config, dtype, on_gpu=gpu, amx=amx)
    assert choice.name == expected and choice.reason


def test_forced_backends_that_cannot_run_are_refused() -> None:
    amx = EngineSettings(attention_backend=AMX_MLA)
    with pytest.raises(ConfigError, match=r"AMX_MLA expects dtype in .*found float32"):
        choose_attention_backend(amx, MLA, "float32", on_gpu=False, amx=True)
    with pytest.raises(ConfigError, match=r"AMX_MLA expects a CPU with AMX.*found none"):
        choose_attention_backend(amx, MLA, "bfloat16", on_gpu=False, amx=False)
    with pytest.raises(ConfigError, match=r"expected a GPU backend.*found the CPU backend CPU_MLA"):
        choose_attention_backend(
            EngineSettings(attention_backend=CPU_MLA), MLA, "bfloat16", on_gpu=True, amx=False
        )
    forced = choose_attention_backend(
        EngineSettings(attention_backend=CPU_MLA), MLA, "bfloat16", on_gpu=False, amx=True
    )
    assert forced.name == CPU_MLA
    with pytest.raises(ValueError, match="attention_backend"):
        EngineSettings(attention_backend="cpu mla")


def test_kv_cache_default_holds_two_sequences() -> None:
    llama = fixture("llama-3.1-8b")
    per_token = kv_bytes_per_token(llama, "bfloat16", 4)
    # 32 layers x 2 x 8 KV heads x 128 + the [4, 4096] hidden-state cache row, in bf16
    assert per_token == (32 * 2 * 8 * 128 + 4 * 4096) * 2
    cpu = kv_cache_bytes(EngineSettings(), llama, "bfloat16", 4, 8192, on_gpu=False)
    assert cpu == 2 * 8192 * per_token
    assert kv_cache_bytes(EngineSettings(), llama, "bfloat16", 4, 8192, on_gpu=True) is None
    small = kv_cache_bytes(EngineSettings(), llama, "bfloat16", 4, 16, on_gpu=False)
    assert small == 1 << 30
    assert (
        kv_cache_bytes(EngineSettings(kv_cache_memory_gib=2), llama, "bfloat16", 4, 16) == 2 << 30
    )
