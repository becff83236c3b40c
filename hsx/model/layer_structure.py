"""One entry per decoder layer: the per-layer fields of a model's config, read once.

Many architectures describe their layers one by one: ``layer_types`` (gpt-oss, Gemma-3, Qwen3-Next,
Qwen3.5: full, sliding, chunked or linear attention), ``no_rope_layers`` (Llama-4),
``attn_type_list`` (MiniMax), ``hybrid_override_pattern`` (Nemotron-H, a string), or name a set of
layers by index (``mlp_only_layers``, Llama-4's ``moe_layers``). Where config.json leaves such a
list out, the HF config class computes it from a period (``sliding_window_pattern``,
``full_attention_interval``): that class is asked too, so the lists here are what HF runs.

A copy of the model with fewer layers must cut every one of these lists the same way, or HF's
config refuses itself ("num_hidden_layers (5) must be equal to the number of layer_types (8)"):
``pick_layers`` chooses which original layers a reduced model keeps (the pattern's period,
repeated, so every kind of layer is present), and ``reduced_fields`` writes the lists for them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Lists of layer indices (not one value per layer).
INDEX_LIST_KEYS = ("mlp_only_layers", "moe_layers")
# Strings of one character per layer.
PATTERN_STRING_KEYS = ("hybrid_override_pattern",)
# Lists that can have a layer count's length by coincidence, never per layer.
_NOT_PER_LAYER = frozenset(
    {"architectures", "eos_token_id", "bos_token_id", "pad_token_id", "mrope_section"}
)
# A reduced model repeats the per-layer pattern whole when its period is at most this many
# layers; longer or irregular patterns keep their first layers plus one of each missing kind.
MAX_PATTERN_PERIOD = 8
# Layer kinds whose state is not a per-token KV cache (Gated DeltaNet, lightning attention).
LINEAR_ATTENTION_KINDS = ("linear_attention",)
# MiniMax's attn_type_list: 0 lightning (linear) attention, 1 softmax attention.
_MINIMAX_ATTN_TYPES = {0: "linear_attention", 1: "full_attention"}


def _hf_text_config(text: Mapping[str, Any]) -> Any:
    """The HF config object of this text config (None where transformers lacks its model_type
    or refuses the values): the per-layer lists it computes are the ones HF runs."""
    model_type = text.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            return None
        fields = {k: v for k, v in text.items() if k not in ("model_type", "auto_map")}
        return CONFIG_MAPPING[model_type](**fields)
    except Exception as exc:  # why: any refusal means "no HF view"; the dict's lists remain.
        logger.debug("HF config %s refused the text config: %r", model_type, exc)
        return None


@dataclass(frozen=True)
class LayerStructure:
    """The per-layer fields of a model with ``num_layers`` decoder layers."""

    num_layers: int
    lists: Mapping[str, tuple[Any, ...]]  # key -> one value per layer
    index_sets: Mapping[str, frozenset[int]]  # key -> the layers it names
    strings: Mapping[str, str]  # key -> one character per layer

    def signature(self, layer: int) -> tuple[Any, ...]:
        """Everything the per-layer fields say about one layer."""
        return (
            tuple(values[layer] for values in self.lists.values())
            + tuple(layer in indices for indices in self.index_sets.values())
            + tuple(text[layer] for text in self.strings.values())
        )

    def period(self) -> int:
        """The smallest p with every layer described as layer i % p."""
        signatures = [self.signature(i) for i in range(self.num_layers)]
        for p in range(1, self.num_layers + 1):
            if all(signatures[i] == signatures[i % p] for i in range(self.num_layers)):
                return p
        return self.num_layers

    def kind(self, layer: int) -> str:
        """The layer's attention kind: ``layer_types``' entry, MiniMax's attn_type_list, or
        "attention" where the config says nothing per layer."""
        types = self.lists.get("layer_types")
        if types is not None:
            return str(types[layer])
        minimax = self.lists.get("attn_type_list")
        if minimax is not None:
            return _MINIMAX_ATTN_TYPES.get(int(minimax[layer]), f"attn_type {minimax[layer]}")
        return "attention"

    def kinds(self) -> tuple[str, ...]:
        return tuple(self.kind(i) for i in range(self.num_layers))

    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.kind(i) in LINEAR_ATTENTION_KINDS)

    def minimum_reduced_layers(self) -> int:
        """Layers a reduced copy needs to hold the per-layer pattern whole (1 without one)."""
        period = self.period()
        if period <= MAX_PATTERN_PERIOD:
            return period
        return len({self.signature(i) for i in range(self.num_layers)})

    def pick_layers(self, reduced: int) -> tuple[int, ...]:
        """The original layer each of ``reduced`` layers stands for: the pattern's period
        repeated where it is short, else the first layer of each kind plus the model's first
        layers, in order."""
        if reduced < 1:
            raise ValueError(f"reduced layer count: expected >= 1, found {reduced}")
        period = self.period()
        if period <= MAX_PATTERN_PERIOD:
            # Layer i itself where the model has it: every layer of one period is alike.
            return tuple(i if i < self.num_layers else i % period for i in range(reduced))
        first_of_kind: dict[tuple[Any, ...], int] = {}
        for i in range(self.num_layers):
            first_of_kind.setdefault(self.signature(i), i)
        if reduced < len(first_of_kind):
            raise ValueError(
                f"reduced layer count: expected at least {len(first_of_kind)} layers to keep "
                f"every kind of layer, found {reduced}"
            )
        picks = set(first_of_kind.values())
        # The rest of the slots: the model's first layers, in order.
        for i in range(self.num_layers):
            if len(picks) >= min(reduced, self.num_layers):
                break
            picks.add(i)
        return tuple(sorted(picks))

    def reduced_fields(self, picks: Sequence[int]) -> dict[str, Any]:
        """The per-layer fields of a model whose layer r is this model's layer ``picks[r]``."""
        fields: dict[str, Any] = {
            key: [values[i] for i in picks] for key, values in self.lists.items()
        }
        for key, indices in self.index_sets.items():
            fields[key] = [r for r, i in enumerate(picks) if i in indices]
        for key, text in self.strings.items():
            fields[key] = "".join(text[i] for i in picks)
        return fields


def layer_structure(text: Mapping[str, Any]) -> LayerStructure:
    """The per-layer fields of a text config (the language model's: see model.config)."""
    num_layers = int(text["num_hidden_layers"])
    hf = _hf_text_config(text)
    lists: dict[str, tuple[Any, ...]] = {}
    index_sets: dict[str, frozenset[int]] = {}
    strings: dict[str, str] = {}
    keys = list(text)
    # why: HF computes layer_types (and Llama-4's moe_layers, no_rope_layers) when config.json
    # leaves them out; a reduced copy must state them for its own layers.
    for key in ("layer_types", "no_rope_layers", *INDEX_LIST_KEYS):
        if key not in keys and hf is not None and getattr(hf, key, None) is not None:
            keys.append(key)
    for key in keys:
        if key in _NOT_PER_LAYER:
            continue
        value = text.get(key)
        if (value is None or value == []) and hf is not None:
            computed = getattr(hf, key, None)
            value = computed if computed not in (None, []) else value
        if key in PATTERN_STRING_KEYS and isinstance(value, str) and len(value) == num_layers:
            strings[key] = value
        elif (
            isinstance(value, list | tuple)
            and len(value) == num_layers
            and key not in (INDEX_LIST_KEYS)
        ):
            lists[key] = tuple(value)
        elif (
            key in INDEX_LIST_KEYS
            and isinstance(value, list | tuple)
            and all(isinstance(i, int) for i in value)
        ):
            index_sets[key] = frozenset(int(i) for i in value)
    return LayerStructure(num_layers, lists, index_sets, strings)
