"""Tiny models of every architecture family hsx is asked to extract, built locally with each
family's real HF class (never downloaded): float32 safetensors, seeded weights, the bundled
tokenizer and chat template.

Each config keeps the family's own fields (attention sinks, sliding windows, layer patterns,
MoE routing, Gated DeltaNet) with sizes cut down: hidden 256, 4 attention heads of head_dim 64
(vLLM's CPU attention takes 32, 64, 80, ...), 8 experts of which 2 per token, 4-6 layers holding
one whole period of the family's layer pattern, a vocabulary of 2048. Sliding windows are 32 tokens and
Llama-4's attention chunks 128 (vLLM's CPU block), so the bundled conversations cross them.
Weights stay float32: bfloat16 flips MoE expert choices, for HF as for vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hsx.data.tiny_models import TINY_BASE_CONFIG, seeded_init, train_tokenizer

_SEED = 1234
_VOCAB = 2048
_RECIPE_VERSION = 1
_RECIPE_FILE = "hsx_tiny_recipe.json"
_WINDOW = 32

_BASE: dict[str, Any] = {  # four layers, grouped-query attention
    **TINY_BASE_CONFIG,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 128}

# family -> (HF config fields, fields vLLM reads that transformers does not write)
TINY_FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mistral": (
        {
            **_BASE,
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "intermediate_size": 512,
            "sliding_window": None,
        },
        {},
    ),
    "qwen3": (
        {
            **_BASE,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "intermediate_size": 512,
        },
        {},
    ),
    "qwen3-moe": (
        {
            **_BASE,
            **_MOE,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "intermediate_size": 512,
            "num_experts": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],  # one dense layer: the per-layer index list is exercised
        },
        {},
    ),
    "gpt-oss": (
        {
            **_BASE,
            "model_type": "gpt_oss",
            "architectures": ["GptOssForCausalLM"],
            "intermediate_size": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": _WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rms_norm_eps": 1e-5,
        },
        {},
    ),
    "minimax-m2": (
        {
            **_BASE,
            "model_type": "minimax_m2",
            "architectures": ["MiniMaxM2ForCausalLM"],
            "intermediate_size": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rotary_dim": 32,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "attn_type_list": [1, 1, 1, 1],
        },
        {},
    ),
    "llama4": (
        {
            **_BASE,
            "model_type": "llama4_text",
            "architectures": ["Llama4ForCausalLM"],
            "intermediate_size": 128,
            "intermediate_size_mlp": 512,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            # vLLM's CPU build: a multiple of its 128-token KV block; prompts of 130+ tokens
            # of the bundled data cross it.
            "attention_chunk_size": 128,
            "use_qk_norm": True,
        },
        {},
    ),
    "qwen3-next": (
        {
            **_BASE,
            **_MOE,
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            "intermediate_size": 512,
            "num_experts": 8,
            "shared_expert_intermediate_size": 128,
            "norm_topk_prob": True,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
        {},
    ),
    "gemma3": (
        {
            **_BASE,
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 6,
            "intermediate_size": 512,
            "sliding_window": _WINDOW,
            "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
        {},
    ),
    "mixtral": (
        {
            **_BASE,
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "intermediate_size": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
        {},
    ),
    "glm4-moe": (
        {
            **_BASE,
            **_MOE,
            "model_type": "glm4_moe",
            "architectures": ["Glm4MoeForCausalLM"],
            "intermediate_size": 512,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": True,
            "attention_bias": True,
        },
        {"num_nextn_predict_layers": 0},
    ),
}
TINY_FAMILY_NAMES = tuple(TINY_FAMILIES)


def build_tiny_family(family: str, target: Path) -> Path:
    """Write one family's tiny model (config, float32 safetensors, tokenizer) to ``target``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny family: expected one of {TINY_FAMILY_NAMES}, found {family!r}")
    fields, extra = TINY_FAMILIES[family]
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "architectures"})
    config.architectures = list(fields["architectures"])
    torch.manual_seed(_SEED)
    model = seeded_init(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(str(partial), safe_serialization=True)
    config_path = partial / "config.json"
    written = json.loads(config_path.read_text())
    written.update(extra)
    written["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(written, indent=2, sort_keys=True))
    train_tokenizer(partial)
    (partial / _RECIPE_FILE).write_text(
        json.dumps({"recipe_version": _RECIPE_VERSION, "family": family})
    )
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def ensure_tiny_family(root: Path, family: str) -> Path:
    """``root/tiny-<family>``, built unless a current build is there."""
    target = root / f"tiny-{family}"
    recipe = target / _RECIPE_FILE
    if recipe.is_file():
        current = json.loads(recipe.read_text())
        if current == {"recipe_version": _RECIPE_VERSION, "family": family}:
            return target
    return build_tiny_family(family, target)
