"""Layer-id conventions for captured hidden states.

hsx stores layer ids in vLLM's convention (DESIGN.md section 3):

    id k (0 <= k < L)  the residual stream entering decoder layer k
                       (= the output of layer k-1; id 0 = the token embeddings)
    id L               the final pre-norm state (output of the last layer, before the final norm)

where L = num_hidden_layers. This is what vLLM's ``set_aux_hidden_state_layers`` consumes: the
backbone appends ``hidden_states + residual`` when ``idx in aux_hidden_state_layers`` just before
running layer ``idx``, and once more after the loop for id ``L``.

SpecForge / ModelOpt number the same tensors as 0-based decoder-layer OUTPUTS: their j is the
output of layer j, i.e. the residual entering layer j+1, so ``vllm = specforge + 1``. Their EAGLE-3
default (1, L//2-1, L-4) is vLLM's (2, L//2, L-3): the same tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

LayerConvention = Literal["vllm", "specforge"]

LAYER_CONVENTIONS: tuple[LayerConvention, ...] = ("vllm", "specforge")


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three aux layers plus the final pre-norm state, in vLLM's convention.

    (2, L//2, L-3) is what vLLM's own ``get_eagle3_aux_hidden_state_layers`` returns; L is added
    because a draft trained for EAGLE-3 also needs the target's last hidden state.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1; found {num_layers}")
    # why the clamp: tiny probe models (L < 4) would otherwise produce negative ids.
    candidates = (2, num_layers // 2, num_layers - 3, num_layers)
    return tuple(sorted({min(max(c, 1), num_layers) for c in candidates}))


def convert_layer_ids(
    ids: Iterable[int],
    from_convention: LayerConvention,
    to_convention: LayerConvention = "vllm",
) -> tuple[int, ...]:
    """Convert layer ids between conventions, keeping their order.

    ``specforge`` j (output of layer j) is ``vllm`` j+1 (residual entering layer j+1).
    """
    for name in (from_convention, to_convention):
        if name not in LAYER_CONVENTIONS:
            raise ValueError(
                f"Unknown layer-id convention. Expected one of {LAYER_CONVENTIONS}; found {name!r}"
            )
    values = tuple(int(i) for i in ids)
    if from_convention == to_convention:
        return values
    # why: the offset is the only difference; both sides name the same residual-stream tensors.
    offset = 1 if from_convention == "specforge" else -1
    converted = tuple(i + offset for i in values)
    negative = [orig for orig, new in zip(values, converted, strict=True) if new < 0]
    if negative:
        raise ValueError(
            f"Layer ids {negative} ({from_convention}) have no {to_convention} equivalent: "
            f"expected ids >= {1 if from_convention == 'vllm' else 0}; found {list(values)}"
        )
    return converted
