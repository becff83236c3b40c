"""The probe's reduced model: the same architecture with few layers, few experts and a narrow
residual stream, its config consistent with itself.

Attention head shapes, rope, norms, biases and every per-layer pattern stay those of the real
model (kernels are chosen by them); what scales with size is cut: layers, heads (at most 4, the
KV ratio kept), experts (at most 8, 2 per token), MLP widths, the vocabulary. Per-layer lists
(``layer_types``, ``no_rope_layers``, ``attn_type_list``, ``mlp_only_layers``, ...) are cut with
the layers (``hsx.model.layer_structure``): the reduced model repeats the real one's pattern, so
a hybrid keeps its linear-attention layers and a sliding-window model its global layers.
Sliding windows shrink to ``PROBE_WINDOW`` tokens so the probe's prompts (about 100 tokens) cross
them (a window longer than every prompt tests nothing), attention chunks to ``PROBE_CHUNK``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hsx.model.layer_structure import LayerStructure, layer_structure

PROBE_VOCAB = 4096
PROBE_WINDOW = 32  # tokens: the reduced model's sliding windows
# Attention chunks (Llama-4): vLLM's CPU build needs a multiple of its 128-token KV block
# ("attn_chunk_size 32 is not divisible by block_size 128").
PROBE_CHUNK = 128
PROBE_LAYERS = 4  # the fewest layers a reduced model has
_MAX_HEADS = 4
_MAX_LINEAR_KEY_HEADS = 2
_MAX_EXPERTS = 8
_MAX_EXPERTS_PER_TOKEN = 2
_MAX_INTERMEDIATE = 1024
_MAX_MOE_INTERMEDIATE = 256
_MAX_MLA_HIDDEN = 512
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token")
# One MoE layer every N layers: N above half the reduced layers would leave no MoE layer.
_MOE_FREQUENCY_KEYS = ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step")
_WINDOW_KEYS = {"sliding_window": PROBE_WINDOW, "attention_chunk_size": PROBE_CHUNK}


@dataclass(frozen=True)
class ReducedModel:
    """A reduced copy of a model: its config, its capture ids and which original layer each of
    its layers stands for."""

    config: dict[str, Any]  # the text config to write (architectures set by the caller)
    layers: int
    layer_ids: tuple[int, ...]  # the capture ids, mapped (vLLM convention)
    picks: tuple[int, ...]  # reduced layer r stands for original layer picks[r]
    structure: LayerStructure  # the original's per-layer fields
    notes: tuple[str, ...]

    def describe_ids(self, original_ids: Sequence[int]) -> str:
        """Which layer kind produced each captured state (id k: the output of layer k-1)."""
        parts = []
        for original, mapped in zip(sorted(set(original_ids)), self.layer_ids, strict=False):
            if mapped == 0:
                parts.append(f"{original}->{mapped} (embeddings)")
            else:
                kind = self.structure.kind(self.picks[mapped - 1])
                parts.append(f"{original}->{mapped} (after {kind})")
        return ", ".join(parts)


def map_layer_ids(
    ids: Sequence[int], num_layers: int, reduced_layers: int, lowest: int
) -> tuple[tuple[int, ...], int]:
    """Map capture ids of an L-layer model onto a reduced model, keeping each id's role: 0 stays
    the embeddings, L the final state, and ids in between keep their order and relative depth.
    Returns (mapped ids, reduced layer count, grown if needed to keep ids distinct)."""
    interior = sorted(i for i in set(ids) if 0 < i < num_layers)
    reduced = max(reduced_layers, len(interior) + 2)
    mapped: list[int] = []
    for layer_id in interior:
        candidate = min(max(round(layer_id * reduced / num_layers), max(lowest, 1)), reduced - 1)
        if mapped and candidate <= mapped[-1]:
            candidate = mapped[-1] + 1
        mapped.append(candidate)
    if mapped and mapped[-1] >= reduced:
        reduced = mapped[-1] + 1
    out = ([0] if 0 in ids else []) + mapped + ([reduced] if num_layers in ids else [])
    return tuple(out), reduced


def _int(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cap(cfg: dict[str, Any], key: str, most: int) -> None:
    value = _int(cfg, key)
    if value is not None:
        cfg[key] = min(value, most)


def reduce_model(
    text: Mapping[str, Any],
    layer_ids: Sequence[int],
    lowest_layer_id: int,
    wanted_layers: int = PROBE_LAYERS,
) -> ReducedModel:
    """The reduced copy of the model whose text config is ``text``, capturing ``layer_ids``."""
    num_layers = int(text["num_hidden_layers"])
    structure = layer_structure(text)
    wanted = max(wanted_layers, structure.minimum_reduced_layers())
    mapped, layers = map_layer_ids(layer_ids, num_layers, wanted, lowest_layer_id)
    picks = structure.pick_layers(layers)
    cfg = dict(text)
    notes: list[str] = []
    heads = int(cfg.get("num_attention_heads", _MAX_HEADS))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    new_heads = min(heads, _MAX_HEADS)
    cfg["num_attention_heads"] = new_heads
    cfg["num_key_value_heads"] = max(1, new_heads * kv_heads // heads)
    if "kv_lora_rank" not in cfg:
        # Keep the head shape the attention kernels see; narrow the residual stream.
        cfg["head_dim"] = head_dim
        cfg["hidden_size"] = new_heads * head_dim
    else:
        cfg["hidden_size"] = min(int(cfg["hidden_size"]), _MAX_MLA_HIDDEN)
        _cap(cfg, "q_lora_rank", 256)
    cfg["num_hidden_layers"] = layers
    cfg["vocab_size"] = PROBE_VOCAB
    for key in ("intermediate_size", "intermediate_size_mlp"):
        _cap(cfg, key, _MAX_INTERMEDIATE)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        _cap(cfg, key, _MAX_MOE_INTERMEDIATE)
    if any(_int(cfg, key) for key in _EXPERT_COUNT_KEYS):
        for key in _EXPERT_COUNT_KEYS:
            _cap(cfg, key, _MAX_EXPERTS)
        for key in _EXPERTS_PER_TOKEN_KEYS:
            _cap(cfg, key, _MAX_EXPERTS_PER_TOKEN)
    if cfg.get("n_routed_experts"):
        # Grouped routing picks groups of the real expert count: one group of the reduced one.
        cfg["n_group"], cfg["topk_group"] = 1, 1
        cfg["first_k_dense_replace"] = min(int(cfg.get("first_k_dense_replace") or 0), 1)
    for key in _MOE_FREQUENCY_KEYS:
        _cap(cfg, key, max(1, layers // 2))
    _cap(cfg, "max_window_layers", layers)
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): fewer key heads, the value/key head ratio kept.
    key_heads, value_heads = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
    if key_heads and value_heads:
        cfg["linear_num_key_heads"] = min(key_heads, _MAX_LINEAR_KEY_HEADS)
        cfg["linear_num_value_heads"] = cfg["linear_num_key_heads"] * max(
            1, value_heads // key_heads
        )
    for key, shortest in _WINDOW_KEYS.items():
        window = _int(cfg, key)
        if window is not None and window > shortest:
            cfg[key] = shortest
            notes.append(f"{key} {window} -> {shortest} tokens, so long prompts cross it")
    cfg.update(structure.reduced_fields(picks))
    if "num_nextn_predict_layers" in cfg:
        cfg["num_nextn_predict_layers"] = 0
    for key in ("quantization_config", "auto_map"):
        if cfg.pop(key, None) is not None:
            notes.append(
                f"{key} left out of the probe: "
                + (
                    "it runs dense fp32 on this machine"
                    if key == "quantization_config"
                    else "no remote code"
                )
            )
    cfg.update({"torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    cfg.pop("dtype", None)
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 512), 512)
    return ReducedModel(cfg, layers, mapped, picks, structure, tuple(notes))
