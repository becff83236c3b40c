"""The architecture families hsx is asked to extract, and what is known of each: how config.json
names it, the text model a multimodal wrapper builds, where the final norm's weight lives, how
that norm scales, and whether hsx's states have been shown equal to Hugging Face's on vLLM's CPU
build (the tests and figures behind each entry are named in it).

A run on a family whose parity is not established says so in its run record and in ``hsx info``
(``parity_note``); preflight's probe establishes it for the run's own model where it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hsx.errors import ConfigError
from hsx.model.config import text_config

ParityStatus = Literal["established", "refused", "not established"]


@dataclass(frozen=True)
class CpuParity:
    """hsx's states against HF transformers' float32 states, on vLLM's CPU build."""

    status: ParityStatus
    detail: str  # the measured figure and its test, or why the family is refused


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json "architectures" naming this family
    model_types: tuple[str, ...]  # model_type of config.json (or of its text_config)
    final_norm_weight: str  # the final norm's weight in the HF checkpoint
    cpu_parity: CpuParity
    fixture: str  # the real config under tests/fixtures/configs/
    # The text model a multimodal wrapper builds (HF and vLLM name it alike); None: not a wrapper.
    text_architecture: str | None = None
    norm_plus_one: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    logit_softcapping: str | None = None  # the config key capping the LM head's logits


_TEST = "tests/integration/test_families.py"
_HOOKS = (
    "vLLM 0.32's {cls} lacks the EAGLE-3 interface; hsx captures it with its own hooks "
    "(hsx.engine.capture_models, engine in this process)"
)
_TORCHVISION = (
    "vLLM's {module} imports torchvision, which the CPU build does not carry (the CUDA-linked "
    "wheel breaks `from vllm import LLM`)"
)
_HYBRID = (
    "hybrid Gated DeltaNet + attention: vLLM 0.32 cannot join the capture layer's KV cache "
    'spec with the linear-attention state ("Failed to promote local KV cache specs to one '
    'unified type")'
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("LlamaForCausalLM",),
        ("llama",),
        "model.norm.weight",
        CpuParity(
            "established", "tiny Llama < 1e-4 (tests/integration/test_capture_matches_hf.py)"
        ),
        "llama-3.1-8b",
    ),
    Family(
        "deepseek-v3",
        ("DeepseekV3ForCausalLM",),
        ("deepseek_v3", "kimi_k2"),
        "model.norm.weight",
        CpuParity(
            "established",
            "tiny DeepSeek-V3 (MLA + MoE) < 1e-4 (tests/integration/test_capture_matches_hf.py)",
        ),
        "deepseek-v3",
    ),
    Family(
        "kimi-k2.5",
        ("KimiK25ForConditionalGeneration",),
        ("kimi_k25",),
        "language_model.model.norm.weight",
        CpuParity(
            "established",
            "its text model is DeepSeek-V3's decoder (vLLM builds DeepseekV2ForCausalLM inside "
            "the wrapper): tiny DeepSeek-V3 < 1e-4",
        ),
        "kimi-k2.5",
        text_architecture="DeepseekV3ForCausalLM",
    ),
    Family(
        "mistral",
        ("MistralForCausalLM",),
        ("mistral",),
        "model.norm.weight",
        CpuParity("established", f"tiny Mistral 5.1e-06 at batch 1 and 6 ({_TEST})"),
        "mistral-7b-v0.3",
    ),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        "model.norm.weight",
        CpuParity("established", f"tiny Qwen3 5.8e-06 at batch 1 and 6 ({_TEST})"),
        "qwen3-8b",
    ),
    Family(
        "qwen3-moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3_moe",),
        "model.norm.weight",
        CpuParity(
            "established",
            f"tiny Qwen3-MoE (a dense layer, 8 experts) 3.0e-06 at batch 1 and 6 ({_TEST})",
        ),
        "qwen3-30b-a3b",
    ),
    Family(
        "gpt-oss",
        ("GptOssForCausalLM",),
        ("gpt_oss",),
        "model.norm.weight",
        CpuParity(
            "established",
            f"tiny gpt-oss (sinks, alternating 32-token window, MoE) 3.1e-06 at batch 1 and 6 "
            f"({_TEST})",
        ),
        "gpt-oss-20b",
    ),
    Family(
        "minimax-m2",
        ("MiniMaxM2ForCausalLM",),
        ("minimax_m2",),
        "model.norm.weight",
        CpuParity(
            "refused",
            "vLLM 0.32's CPU MoE router takes sigmoid scoring only with grouped top-k "
            "(DeepSeek's); MiniMax-M2 routes by sigmoid without groups and its engine fails at "
            "the first step (cpu_router.py: assert scoring_func == 'softmax')",
        ),
        "minimax-m2",
    ),
    Family(
        "llama4",
        ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"),
        ("llama4", "llama4_text"),
        "language_model.model.norm.weight",
        CpuParity(
            "established",
            f"tiny Llama-4 text model (MoE, NoPE layers, 128-token attention chunks) 2.7e-06 at "
            f"batch 1 and 6 ({_TEST}); the wrapper Llama4ForConditionalGeneration does not "
            "resolve on the CPU build (its vision module imports torchvision)",
        ),
        "llama-4-scout",
        text_architecture="Llama4ForCausalLM",
    ),
    Family(
        "qwen3-next",
        ("Qwen3NextForCausalLM",),
        ("qwen3_next",),
        "model.norm.weight",
        CpuParity("refused", _HYBRID),
        "qwen3-next-80b-a3b",
    ),
    Family(
        "qwen3.5",
        (
            "Qwen3_5MoeForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5ForCausalLM",
        ),
        ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
        "model.language_model.norm.weight",
        CpuParity(
            "refused",
            f"{_HYBRID}; besides, vLLM's qwen3_5 module imports torchvision, which the CPU "
            "build does not carry",
        ),
        "qwen3.5-35b-a3b",
        text_architecture="Qwen3_5MoeForCausalLM",
        norm_plus_one=True,
    ),
    Family(
        "gemma3",
        ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"),
        ("gemma3", "gemma3_text"),
        "language_model.model.norm.weight",
        CpuParity(
            "established",
            f"{_HOOKS.format(cls='Gemma3ForCausalLM')}: tiny Gemma-3 (5 sliding + 1 global "
            f"layer) 2.6e-04 of values up to 33, within HF's own float32 rounding (3.8e-04 "
            f"against float64), at batch 1 and 6 ({_TEST}); the wrapper "
            "Gemma3ForConditionalGeneration lacks the interface and does not resolve on the "
            "CPU build (torchvision)",
        ),
        "gemma-3-27b",
        text_architecture="Gemma3ForCausalLM",
        norm_plus_one=True,
        logit_softcapping="final_logit_softcapping",
    ),
    Family(
        "glm4-moe",
        ("Glm4MoeForCausalLM",),
        ("glm4_moe",),
        "model.norm.weight",
        CpuParity(
            "established",
            f"{_HOOKS.format(cls='Glm4MoeForCausalLM')}: tiny GLM-4 MoE 3.5e-06 at batch 1 "
            f"and 6 ({_TEST})",
        ),
        "glm-4.5",
    ),
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        ("mixtral",),
        "model.norm.weight",
        CpuParity(
            "established",
            f"{_HOOKS.format(cls='MixtralForCausalLM')}: tiny Mixtral 1.9e-06 at batch 1 and 6 "
            f"({_TEST})",
        ),
        "mixtral-8x7b",
    ),
)


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family config.json names: by its first architecture, else by model_type (of the
    config or its text config); None for an architecture hsx knows nothing about."""
    archs = config.get("architectures") or []
    first = archs[0] if archs and isinstance(archs[0], str) else None
    for family in FAMILIES:
        if first in family.architectures:
            return family
    types = {config.get("model_type"), text_config(config).get("model_type")}
    for family in FAMILIES:
        if types & set(family.model_types):
            return family
    return None


def logit_softcap(config: Mapping[str, Any]) -> float | None:
    """The cap of the LM head's logits (``cap * tanh(logits / cap)``, Gemma's
    ``final_logit_softcapping``) where the model's config sets one; None where it does not."""
    family = family_of(config)
    key = family.logit_softcapping if family and family.logit_softcapping else None
    value = text_config(config).get(key or "final_logit_softcapping")
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: expected a positive logit soft-cap, found {value!r}")
    return float(value)


def parity_note(config: Mapping[str, Any], probe_ran: bool, on_gpu: bool) -> dict[str, Any]:
    """What a run's record says of its states' parity with HF: the family, its CPU status, and
    whether this run's own preflight probe compared a reduced copy with HF. ``warning`` is set
    when nothing established parity for this run."""
    family = family_of(config)
    note: dict[str, Any] = {
        "family": family.name if family else None,
        "cpu_parity": family.cpu_parity.status if family else "not established",
        "cpu_parity_detail": family.cpu_parity.detail
        if family
        else f"architecture {list(config.get('architectures') or [])} is not in hsx's families",
        "probe_ran": probe_ran,
    }
    established = probe_ran or (
        not on_gpu and family is not None and family.cpu_parity.status == "established"
    )
    if not established:
        where = "on GPUs" if on_gpu else "on vLLM's CPU build"
        name = family.name if family else f"{list(config.get('architectures') or [])}"
        note["warning"] = (
            f"parity with HF transformers is not established for {name} {where} "
            f"({note['cpu_parity_detail']}), and preflight's probe did not run: these states "
            "are unchecked against a reference"
        )
    return note
