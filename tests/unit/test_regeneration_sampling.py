"""What a regeneration sends with every request: the model's generation_config.json sampling
defaults under the run's own parameters (as `vllm serve` applies them), and which of those an
extraction engine may generate with (greedy only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx.errors import ConfigError
from hsx.regeneration.generators import (
    check_capture_engine_sampling,
    effective_sampling,
    is_greedy,
    model_sampling_defaults,
)

pytestmark = pytest.mark.timeout(30)


def model_with(tmp_path: Path, generation_config: str | None) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    if generation_config is not None:
        (model / "generation_config.json").write_text(generation_config)
    return model


def test_the_models_sampling_defaults_lie_under_the_runs_own(tmp_path: Path) -> None:
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": None,  # unset in the file: not a default
        "max_new_tokens": 100,  # hsx sets max_tokens per turn itself
        "do_sample": True,  # transformers' switch, which vLLM does not read
        "eos_token_id": 2,
    }
    model = model_with(tmp_path, json.dumps(config))
    assert model_sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9}
    assert effective_sampling(model, {"temperature": 0}) == {"temperature": 0, "top_p": 0.9}
    assert effective_sampling(model, {}) == {"temperature": 0.6, "top_p": 0.9}


def test_a_model_without_a_generation_config_adds_nothing(tmp_path: Path) -> None:
    assert effective_sampling(model_with(tmp_path, None), {"top_p": 0.5}) == {"top_p": 0.5}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_unreadable_generation_config_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    model = model_with(tmp_path, text)
    with pytest.raises(ConfigError, match=r"generation_config.json: expected a JSON object"):
        model_sampling_defaults(model)


def test_an_extraction_engine_generates_greedily_only() -> None:
    assert is_greedy({"temperature": 0}) and is_greedy({"temperature": 0.0, "top_p": 0.9})
    assert not is_greedy({}) and not is_greedy({"temperature": 0.7})  # vLLM's default is 1.0
    check_capture_engine_sampling({"temperature": 0}, "http://127.0.0.1:8100")
    with pytest.raises(ConfigError) as refused:
        check_capture_engine_sampling({"temperature": 0.7}, "http://127.0.0.1:8100")
    message = str(refused.value)
    assert "expected greedy" in message and "http://127.0.0.1:8100" in message
    assert "{'temperature': 0.7}" in message and "then `hsx extract`" in message
