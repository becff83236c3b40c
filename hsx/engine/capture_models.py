"""hsx's own EAGLE-3 capture for vLLM model classes that lack the interface.

vLLM 0.32's Gemma3ForCausalLM, MixtralForCausalLM and Glm4MoeForCausalLM do not implement
``SupportsEagle3``: extract_hidden_states refuses them ("Model does not support EAGLE3 interface
but aux_hidden_state_outputs was requested"). Their backbones are built alike: a loop of
``layer(positions, hidden_states, residual)`` and a final ``self.norm(hidden_states, residual)``,
where the residual stream entering layer k is ``hidden_states + residual`` (``hidden_states``
alone before layer 0), exactly what vLLM's own ``EagleModelMixin._maybe_add_hidden_state``
collects for the classes that have it. hsx collects the same sums with forward pre-hooks (hooks
read, they change nothing the model computes) on the decoder layers of the requested ids and,
for id L, on the final norm, and returns them as the interface does: ``(hidden_states, aux)``.

The subclass is registered under the architecture's own name in the process that builds the
engine, before it is built (``register_capture_classes``). Every class listed here is proven
equal to HF transformers on its tiny model (tests/integration/test_families.py). Hooks run in
eager mode: the engine is built with ``enforce_eager`` for these architectures
(``needs_hsx_capture``), as torch.compile would trace the hooks' appends.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# vLLM architectures whose class lacks SupportsEagle3 and whose backbone has the shape above.
HSX_CAPTURE_ARCHITECTURES = ("Gemma3ForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM")
_REGISTERED: dict[str, type] = {}
_LOCK = threading.Lock()


def needs_hsx_capture(architectures: Sequence[str]) -> bool:
    """True when the model's architecture is captured by hsx's hooks, not vLLM's interface."""
    return bool(architectures) and architectures[0] in HSX_CAPTURE_ARCHITECTURES


def _residual_stream(hidden_states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    # A new tensor either way: the layer's fused add-norm updates its inputs in place.
    return hidden_states.clone() if residual is None else hidden_states + residual


def _capture_class(base: type) -> type:
    """``base`` with vLLM's EAGLE-3 interface, collecting aux states with pre-hooks."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    class HsxCapture(base, SupportsEagle3):  # type: ignore[misc, valid-type]
        hsx_capture = True

        def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
            backbone = self.model
            for handle in getattr(self, "_hsx_hooks", ()):
                handle.remove()
            self._hsx_layers = tuple(sorted(set(int(i) for i in layers)))
            self._hsx_aux: list[torch.Tensor] = []
            hooks = []
            count = len(backbone.layers)
            for layer_id in self._hsx_layers:
                if not 0 <= layer_id <= count:
                    raise ValueError(
                        f"aux hidden-state layer {layer_id}: expected 0..{count} for "
                        f"{type(self).__name__}, found {layer_id}"
                    )
                if layer_id == count:
                    hooks.append(backbone.norm.register_forward_pre_hook(self._hsx_norm_hook))
                else:
                    layer = backbone.layers[layer_id]
                    signature = inspect.signature(layer.forward)
                    hooks.append(
                        layer.register_forward_pre_hook(
                            self._hsx_layer_hook(signature), with_kwargs=True
                        )
                    )
            self._hsx_hooks = hooks

        def _hsx_layer_hook(self, signature: inspect.Signature) -> Any:
            def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                bound = signature.bind_partial(*args, **kwargs).arguments
                self._hsx_aux.append(
                    _residual_stream(bound["hidden_states"], bound.get("residual"))
                )

            return hook

        def _hsx_norm_hook(self, _module: Any, args: tuple[Any, ...]) -> None:
            residual = args[1] if len(args) > 1 else None
            self._hsx_aux.append(_residual_stream(args[0], residual))

        def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
            count = len(self.model.layers)
            return (2, count // 2, count - 3)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self, "_hsx_layers", ()):
                return super().forward(*args, **kwargs)
            self._hsx_aux = []
            hidden_states = super().forward(*args, **kwargs)
            aux, self._hsx_aux = self._hsx_aux, []
            if len(aux) != len(self._hsx_layers):
                raise RuntimeError(
                    f"hsx capture of {base.__name__}: expected {len(self._hsx_layers)} aux "
                    f"states (layers {self._hsx_layers}), found {len(aux)}"
                )
            return hidden_states, aux

    HsxCapture.__name__ = base.__name__
    HsxCapture.__qualname__ = base.__qualname__
    HsxCapture.__module__ = base.__module__
    return HsxCapture


def register_capture_classes(architectures: Sequence[str]) -> None:
    """Register hsx's capture subclass for the model's architecture with vLLM's model registry,
    in this process (the one that builds the engine), once; nothing for other architectures."""
    if not needs_hsx_capture(architectures):
        return
    arch = architectures[0]
    with _LOCK:
        if arch in _REGISTERED:
            return
        from vllm.model_executor.models.registry import ModelRegistry

        base = ModelRegistry.models[arch].load_model_cls()
        captured = _capture_class(base)
        ModelRegistry.register_model(arch, captured)
        _REGISTERED[arch] = captured
        logger.info("hsx captures %s's hidden states with its own hooks", arch)
