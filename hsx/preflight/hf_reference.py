"""Reference capture with HF transformers (``output_hidden_states=True``): the ground truth.

In vLLM's numbering, id k < L is the residual stream entering decoder layer k, which is HF's
``hidden_states[k]``; id L is the final state *before* the last norm, while HF's last entry is
after it, so it is taken from the norm's input with a forward pre-hook (a hook that only reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx.errors import ConfigError


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    return model


def text_decoder(model: Any) -> Any:
    """The module holding the decoder layers and the final norm: ``get_decoder()`` for most
    classes; Llama-4's ForCausalLM returns itself there, so its ``model`` is tried, and a
    multimodal wrapper's ``language_model``."""
    inner = getattr(model, "model", None)
    for candidate in (
        model.get_decoder(),
        inner,
        getattr(inner, "language_model", None),
        getattr(model, "language_model", None),
    ):
        if candidate is not None and hasattr(candidate, "norm") and hasattr(candidate, "layers"):
            return candidate
    raise ConfigError(
        f"HF reference: expected a decoder with 'layers' and a final 'norm' in "
        f"{type(model).__name__}, found none (get_decoder() is {type(model.get_decoder()).__name__})"
    )


def hf_hidden_states(
    model: Any, prompts: Sequence[np.ndarray], layer_ids: Sequence[int]
) -> list[torch.Tensor]:
    """Each prompt's states at ``layer_ids`` (vLLM numbering): ``[tokens, K, H]`` float32."""
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    final_norm = text_decoder(model).norm
    captured: list[torch.Tensor] = []
    handle = final_norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    results: list[torch.Tensor] = []
    try:
        for prompt in prompts:
            captured.clear()
            ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64))[None, :]
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
            states = []
            for layer_id in layer_ids:
                if layer_id == num_layers:
                    states.append(captured[-1][0])
                else:
                    states.append(out.hidden_states[layer_id][0])
            results.append(torch.stack(states, dim=1).float())  # [tokens, K, H]
    finally:
        handle.remove()
    return results
