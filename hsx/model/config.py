"""The model's config.json, read once: the object every layer of hsx derives the model from.

``text_config`` is the one place that decides where a multimodal wrapper (Kimi-K2.5, Llama-4)
keeps its language model's settings; preflight, planning and the engine all ask it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from hsx.errors import ConfigError


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ConfigError(
            f"model folder: expected a directory with config.json, found nothing at {model_dir}"
        )
    if not path.is_file():
        raise ConfigError(
            f"model folder {model_dir}: expected config.json, found {sorted(p.name for p in model_dir.iterdir())[:10]}"
        )
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: expected JSON, found a parse error: {exc}") from exc
    check_config(config, path)
    return cast(dict[str, Any], config)


def check_config(config: object, path: Path | str = "config.json") -> None:
    """What hsx reads of config.json before any load, checked in milliseconds: an object naming
    its model class in ``architectures``, and the language model's layer count and hidden size
    as positive integers. Raises ConfigError naming the key, what was expected and found."""
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path}: expected a JSON object of model settings, found {type(config).__name__}"
        )
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        found = "no 'architectures' key" if "architectures" not in config else repr(archs)
        raise ConfigError(
            f"{path}: expected 'architectures' to list the model class (e.g. "
            f"['LlamaForCausalLM']), found {found}"
        )
    text = text_config(config)
    where = "text_config." if text is not config else ""
    for key in ("num_hidden_layers", "hidden_size"):
        value = text.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            found = f"no '{key}' key" if key not in text else repr(value)
            raise ConfigError(f"{path}: expected '{where}{key}' a positive integer, found {found}")


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config (multimodal wrappers such as Kimi-K2.5 nest it under
    ``text_config``): the nested object when it holds a decoder's sizes, else the config."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping) and ("hidden_size" in inner or "num_hidden_layers" in inner):
        return cast(dict[str, Any], inner)
    return cast(dict[str, Any], config)
