"""Tiny models built locally (never downloaded): a Llama and a DeepSeek-V3 (MLA + MoE).

Seeded random weights saved as safetensors, a byte-level BPE tokenizer trained locally with
``tokenizers`` on the bundled sample conversations, and a ChatML-style chat template.

Shapes respect measured constraints of vLLM's CPU build: attention head_dim in {32, 64, 80, ...};
for MLA, kv_lora_rank 512 and qk_rope_head_dim 64; DeepSeek configs carry
``topk_method: noaux_tc`` and ``scoring_func: sigmoid`` (real checkpoints have them, transformers
does not write them).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from hsx.data.sample_data import generate_conversations

logger = logging.getLogger(__name__)

TINY_LLAMA = "tiny-llama"
TINY_DEEPSEEK = "tiny-deepseek-v3"
TINY_MODEL_NAMES = (TINY_LLAMA, TINY_DEEPSEEK)
_SEED = 1234
_VOCAB_SIZE = 2048
# Bumped when the recipe changes, so a stale bundled model is rebuilt rather than reused.
_RECIPE_VERSION = 1
_RECIPE_FILE = "hsx_tiny_recipe.json"

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The fields every tiny model shares (hsx.data.tiny_families starts from them too).
TINY_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": _VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA_CONFIG: dict[str, Any] = {
    **TINY_BASE_CONFIG,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}
DEEPSEEK_CONFIG: dict[str, Any] = {
    **TINY_BASE_CONFIG,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "hidden_act": "silu",
}
# Fields real DeepSeek-V3 checkpoints carry and vLLM reads, which transformers does not write.
_DEEPSEEK_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def train_tokenizer(target: Path) -> None:
    """Train a byte-level BPE tokenizer on the sample conversations and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [
        message["content"]
        for conversation in generate_conversations(2000, seed=_SEED)
        for message in conversation["messages"]
    ]
    texts += ["system", "user", "assistant", "tool"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(target))


def seeded_init(model: Any) -> Any:
    """Norms 1, MoE score biases 0, everything else N(0, 0.05): a small std keeps activations in
    a sane range over a few layers (the caller seeds torch first)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.05)
    return model


def _build_weights(config_dict: dict[str, Any], target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(_SEED)
    model = seeded_init(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(target), safe_serialization=True)


def build_tiny_model(name: str, target: Path) -> Path:
    """Write one tiny model (config, bf16 safetensors, tokenizer) to ``target``; returns it."""
    if name == TINY_LLAMA:
        config_dict, extra = LLAMA_CONFIG, {}
    elif name == TINY_DEEPSEEK:
        config_dict, extra = DEEPSEEK_CONFIG, _DEEPSEEK_EXTRA
    else:
        raise ValueError(f"unknown tiny model {name!r}: expected one of {TINY_MODEL_NAMES}")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _build_weights(dict(config_dict), partial)
    config_path = partial / "config.json"
    written = json.loads(config_path.read_text())
    written.update(extra)
    written["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(written, indent=2, sort_keys=True))
    train_tokenizer(partial)
    (partial / _RECIPE_FILE).write_text(json.dumps({"recipe_version": _RECIPE_VERSION}))
    # Rename last: a half-built model folder is never mistaken for a finished one.
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def is_current(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished tiny model of the current recipe."""
    recipe = model_dir / _RECIPE_FILE
    if not recipe.is_file():
        return False
    return bool(json.loads(recipe.read_text()).get("recipe_version") == _RECIPE_VERSION)


def ensure_tiny_models(root: Path, names: tuple[str, ...] = TINY_MODEL_NAMES) -> dict[str, Path]:
    """Build the tiny models under ``root`` unless a current build is already there. Processes
    that ask at once (a demo and a stack's setup, two test workers) take turns on a lock file:
    the second finds the first one's build instead of removing its half-built folder."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    with (root / ".hsx-tiny-models.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        for name in names:
            target = root / name
            if not is_current(target):
                logger.info("building tiny model %s in %s", name, target)
                build_tiny_model(name, target)
            built[name] = target
    return built
