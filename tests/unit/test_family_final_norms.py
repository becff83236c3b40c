"""The exports' final norm for each family's checkpoint layout: hsx's float32 norm, read from
the safetensors by name, equals the model's own final norm (HF transformers) on the same states:
plain RMSNorm (gpt-oss, Llama-4's text model), the (1 + weight) of Gemma and Qwen3-Next, and a
multimodal wrapper's text model among its vision tower's norms (Gemma-3's
``language_model.model.norm.weight``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.data.tiny_models import seeded_init
from hsx.model.config import read_config
from hsx.preflight.hf_reference import text_decoder
from hsx.trainers.final_norm import load_final_norm

pytestmark = pytest.mark.timeout(120)

_TEXT: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 64,
    "rms_norm_eps": 1e-5,
}


def _save(model: Any, target: Path) -> Path:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.uniform_(-0.5, 0.5)  # a weight far from 1 (or 0): the form matters
    model.save_pretrained(str(target), safe_serialization=True)
    return target


def _gemma3_wrapper(target: Path) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={**_TEXT, "model_type": "gemma3_text", "sliding_window": 32},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(config)


def _text_model(class_name: str, **fields: Any) -> Any:
    import transformers

    cls = getattr(transformers, class_name)
    return cls(cls.config_class(**_TEXT, **fields))


CASES = {
    "gemma3-wrapper": lambda target: _gemma3_wrapper(target),
    "gemma3-text": lambda _: _text_model("Gemma3ForCausalLM", sliding_window=32),
    "gpt-oss": lambda _: _text_model("GptOssForCausalLM", num_local_experts=4),
    "llama4-text": lambda _: _text_model(
        "Llama4ForCausalLM", num_local_experts=2, intermediate_size_mlp=64
    ),
    "qwen3-next": lambda _: _text_model(
        "Qwen3NextForCausalLM",
        num_experts=2,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_exported_final_norm_is_the_models_own(case: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = seeded_init(CASES[case](tmp_path).float().eval())
    folder = _save(model, tmp_path / case)
    norm = load_final_norm(folder, read_config(folder))
    assert norm.plus_one == (case.startswith("gemma3") or case == "qwen3-next")
    if case == "gemma3-wrapper":
        # The Hub's layout, which transformers 5 writes back; its vision tower's norms beside.
        assert norm.source.endswith(":language_model.model.norm.weight"), norm.source
    states = torch.randn(5, 64) * 3
    with torch.no_grad():
        expected = text_decoder(model).norm(states)
    assert torch.allclose(norm(states), expected.float(), atol=1e-5), (
        (norm(states) - expected).abs().max()
    )
