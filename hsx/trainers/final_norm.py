"""The model's final norm, applied in float32 for trainers that want post-norm states.

hsx stores the final state *before* the last norm (vLLM's numbering, id L). SpecForge's trainer
applies lm_head directly to ``hidden_state``, so its export needs the state *after* the norm:
RMSNorm with the checkpoint's own weight and ``rms_norm_eps``, computed in float32.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx.errors import ConfigError
from hsx.model.config import read_config, text_config
from hsx.plan.building import config_hash

# The decoder's final norm: "model.norm.weight" (Llama, Qwen, DeepSeek-V3, gpt-oss), nested under
# a multimodal wrapper's language model (Kimi-K2.5, Llama-4: "language_model.model.norm.weight";
# Gemma-3 as transformers 5 writes it: "model.language_model.norm.weight").
_FINAL_NORM = re.compile(r"^(?:[\w.]*\.)?(?:model|language_model)\.norm\.weight$")
# Models whose norm multiplies by (1 + weight) in float32: Gemma's RMSNorm, and the zero-centred
# RMSNorm of Qwen3-Next and Qwen3.5 (their HF modeling files, transformers 5.19).
_OFFSET_NORM_TYPES = (
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)


@dataclass(frozen=True)
class FinalNorm:
    """RMSNorm of the model's last layer: ``x * rsqrt(mean(x^2) + eps) * weight`` in float32,
    or ``* (1 + weight)`` for Gemma's and Qwen3-Next's (``plus_one``)."""

    weight: torch.Tensor  # [H] float32
    eps: float
    source: str  # "<file>:<tensor name>", for the export's manifest
    plus_one: bool = False

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """[..., H] any float dtype -> [..., H] float32."""
        x = states.float()
        if x.shape[-1] != self.weight.shape[0]:
            raise ConfigError(
                f"final norm {self.source}: expected states of hidden size "
                f"{self.weight.shape[0]}, found {x.shape[-1]}"
            )
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        scale = 1.0 + self.weight if self.plus_one else self.weight
        return x * torch.rsqrt(variance + self.eps) * scale


def weight_files(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or from each file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {str(name): str(file) for name, file in weight_map.items()}
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file.name for name in handle.keys()})  # noqa: SIM118
    return names


def load_final_norm(model_dir: Path, config: dict[str, Any] | None = None) -> FinalNorm:
    """The final norm of the model in ``model_dir``; ConfigError naming what was expected and
    found when its weight or epsilon cannot be found (before any state is written)."""
    config = config if config is not None else read_config(model_dir)
    text = text_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    eps = text.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConfigError(
            f"{model_dir}/config.json: expected 'rms_norm_eps' a positive number for the final "
            f"norm, found {eps!r}"
        )
    files = weight_files(model_dir)
    if not files:
        raise ConfigError(
            f"{model_dir}: expected safetensors weights holding the final norm, found none "
            "(a store made with load_format=dummy has no weights to export post-norm states from)"
        )
    candidates = sorted(name for name in files if _FINAL_NORM.match(name) and "layers." not in name)
    if len(candidates) > 1:
        # A multimodal wrapper: its text model's norm, not a vision tower's.
        candidates = [name for name in candidates if "language_model." in name] or candidates
    if len(candidates) != 1:
        raise ConfigError(
            f"{model_dir}: expected exactly one final norm weight (e.g. 'model.norm.weight'), "
            f"found {candidates or 'none'} among {len(files)} tensors"
        )
    name = candidates[0]
    from safetensors import safe_open

    with safe_open(str(model_dir / files[name]), framework="pt") as handle:
        weight = handle.get_tensor(name).float()
    hidden = int(text["hidden_size"])
    if tuple(weight.shape) != (hidden,):
        raise ConfigError(
            f"{model_dir}/{files[name]}:{name}: expected shape ({hidden},), found "
            f"{tuple(weight.shape)}"
        )
    return FinalNorm(
        weight, float(eps), f"{files[name]}:{name}", plus_one=model_type in _OFFSET_NORM_TYPES
    )


def store_model_folder(
    model: str | Path | None, meta: dict[str, Any], what: str
) -> tuple[Path, dict[str, Any]]:
    """The folder and config of the model a store was extracted with: ``model``, or the folder
    the store names. ``what`` names the caller in errors ("export", "audit"). ConfigError when
    there is no config.json there, or its digest is not the one the store recorded (another
    model's head or norm would make every figure meaningless)."""
    folder = Path(model or str(meta["model"]["path"]))
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{what}: expected the model folder (config.json, safetensors) the store was "
            f"extracted with at {folder}, found none: pass --model MODEL_DIR"
        )
    config = read_config(folder)
    stored, found = meta["model"].get("config_hash"), config_hash(config)
    if stored != found:
        raise ConfigError(
            f"{what}: expected the model the store was extracted with (config digest {stored}), "
            f"found {found} at {folder}"
        )
    return folder, config
