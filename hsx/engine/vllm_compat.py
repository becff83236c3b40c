"""The vLLM contracts hsx's connector relies on, detected from what the installed vLLM offers
(not from version strings), and checked by preflight without building an engine.

Seen between vLLM 0.26 (the H200's) and 0.32 (CPU here):
- KV cache layout names: 0.26 knows "NHD"/"HND" (``KVCacheLayoutType``); 0.32 has the
  ``KVCacheLayout`` enum (LBNHC, LBHNC, ...) and keeps "NHD"/"HND" as aliases. A name the
  installed vLLM does not know fails engine start after the model load (0.26: "Unknown cache
  layout format LBNHC."), so the connector asks for "NHD", valid in both, and preflight checks.
- The cache-only hidden-state layer's cache: 0.26's backend declares ``get_kv_cache_shape`` =
  ``[blocks, block_size, K, H]``; 0.32 allocates logical ``[blocks, K, block_size, H]`` views
  (no such method). Reading one as the other swaps tokens and layers silently.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

# What hsx's connector asks for: token-major in both versions (0.32 maps it to LBNHC).
HIDDEN_STATE_LAYOUT = "NHD"

# The cache's axis orders hsx can read: blocks first, then tokens/layers in either order.
TOKENS_FIRST = "blocks, block_size, K, H"
LAYERS_FIRST = "blocks, K, block_size, H"


def known_layout_names() -> tuple[str, ...]:
    """KV cache layout names the installed vLLM accepts from a connector."""
    names: list[str] = []
    try:  # vLLM 0.3x
        from vllm.v1.kv_cache_layout import KVCacheLayout

        names += [member.name for member in KVCacheLayout]
        try:
            from vllm.config.cache import _LAYOUT_COMPAT_ALIASES

            names += list(_LAYOUT_COMPAT_ALIASES)
        except ImportError:
            pass
    except ImportError:
        pass
    # vLLM 0.26: a Literal of the names, in the attention backends' utils
    import importlib

    for module in (
        "vllm.v1.attention.backends.utils",
        "vllm.distributed.kv_transfer.kv_connector.utils",
    ):
        try:
            literal = getattr(importlib.import_module(module), "KVCacheLayoutType", None)
        except ImportError:
            continue
        if literal is not None:
            names += [str(arg) for arg in typing.get_args(literal)]
    return tuple(dict.fromkeys(names))


def _cache_only_shape_fn() -> Callable[..., tuple[int, ...]] | None:
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend

    fn = getattr(CacheOnlyAttentionBackend, "get_kv_cache_shape", None)
    return typing.cast(Callable[..., tuple[int, ...]] | None, fn)


def hidden_state_cache_order(
    shape_fn: Callable[..., tuple[int, ...]] | str | None = "installed",
) -> str:
    """The axis order of the cache-only layer's cache in the installed vLLM (TOKENS_FIRST or
    LAYERS_FIRST); ValueError naming what was found when it is neither."""
    fn = _cache_only_shape_fn() if isinstance(shape_fn, str) else shape_fn
    if fn is None:
        return LAYERS_FIRST  # 0.3x: logical [blocks, K(heads), block_size, H] views
    blocks, block_size, layers, hidden = 7, 16, 3, 40  # distinct sizes: the order is readable
    found = tuple(fn(blocks, block_size, layers, hidden))
    if found == (blocks, block_size, layers, hidden):
        return TOKENS_FIRST
    if found == (blocks, layers, block_size, hidden):
        return LAYERS_FIRST
    raise ValueError(
        f"the hidden-state cache's shape: expected [{TOKENS_FIRST}] = "
        f"{(blocks, block_size, layers, hidden)} or [{LAYERS_FIRST}] = "
        f"{(blocks, layers, block_size, hidden)}, found {found}"
    )


def connector_contract_problems(
    connector: type[Any], shape_fn: Callable[..., tuple[int, ...]] | str | None = "installed"
) -> list[str]:
    """What the installed vLLM would refuse or misread of ``connector``, one line each."""
    problems: list[str] = []
    layout = connector.get_required_kvcache_layout(None)
    if layout is not None:
        known = known_layout_names()
        if not known:
            problems.append(
                f"{connector.__name__}.get_required_kvcache_layout: asks for {layout!r}; found "
                "no KV cache layout names in this vLLM to check it against (KVCacheLayout or "
                "KVCacheLayoutType moved?)"
            )
        elif layout not in known:
            problems.append(
                f"{connector.__name__}.get_required_kvcache_layout: asks for KV cache layout "
                f"{layout!r}, which this vLLM does not know: expected one of {list(known)}, "
                f"found {layout!r} (engine start would fail after the model load)"
            )
    try:
        hidden_state_cache_order(shape_fn)
    except ValueError as exc:
        problems.append(f"{connector.__name__}: {exc}")
    problems += request_output_problems()
    problems += engine_core_watch_problems()
    return problems


def engine_core_watch_problems() -> list[str]:
    """hsx wakes a driver whose engine core process died (VllmHiddenStateEngine's watcher): it
    reads the client's ``resources.engine_dead`` and puts an exception into ``outputs_queue``,
    which ``get_output`` raises. Where this vLLM lacks any of it, a core killed mid-chunk would
    hang the run (vLLM's sync client waits forever), so preflight names what moved."""
    import dataclasses
    import inspect

    try:
        from vllm.v1.engine import core_client
    except ImportError as exc:
        return [
            f"vllm.v1.engine.core_client: expected the engine-core client module, found {exc!r}"
        ]
    problems = []
    resources = getattr(core_client, "BackgroundResources", None)
    fields = (
        {f.name for f in dataclasses.fields(resources)}
        if resources is not None and dataclasses.is_dataclass(resources)
        else set(vars(resources or object))
    )
    if "engine_dead" not in fields:
        problems.append(
            "vllm.v1.engine.core_client.BackgroundResources: expected an engine_dead flag (how "
            f"hsx sees an engine core die), found {sorted(fields)[:12] or 'no such class'}"
        )
    client = getattr(core_client, "SyncMPClient", None)
    get_output = inspect.getsource(client.get_output) if client is not None else ""
    if "outputs_queue" not in get_output or "Exception" not in get_output:
        problems.append(
            "vllm.v1.engine.core_client.SyncMPClient.get_output: expected it to raise an "
            "exception found in outputs_queue (how hsx wakes a driver whose engine core died), "
            f"found {'no SyncMPClient' if client is None else 'another implementation'}"
        )
    return problems


def request_output_problems() -> list[str]:
    """The engine's finished outputs must carry the prompt's token ids: hsx checks them against
    the planned ids before it keeps a request's states (hsx.engine.capture_checks)."""
    import inspect

    from vllm.outputs import RequestOutput

    fields = inspect.signature(RequestOutput.__init__).parameters
    if "prompt_token_ids" not in fields:
        return [
            "vllm.outputs.RequestOutput: expected a prompt_token_ids field (the token ids the "
            f"engine ran, checked against the plan), found fields {sorted(fields)[:12]}"
        ]
    return []


# Where vLLM defines the completion API's request and response (0.26 and 0.32 alike).
COMPLETION_PROTOCOL_MODULES = ("vllm.entrypoints.openai.completion.protocol",)


def serving_contract_problems(modules: tuple[str, ...] = COMPLETION_PROTOCOL_MODULES) -> list[str]:
    """What `hsx serve` relies on of vLLM's server, one line each: a completion request takes
    ``kv_transfer_params`` and hands them to the engine's request (the client's channel reaches
    hsx's connector that way), and the response carries the connector's reply back (which
    server instance computed the batch). Where this moved, every request would be computed and
    none extracted, so `hsx serve`'s preflight names it before the load."""
    import importlib
    import inspect

    protocol = None
    for name in modules:
        try:
            protocol = importlib.import_module(name)
            break
        except ImportError:
            continue
    if protocol is None:
        return [f"vLLM's completion API: expected one of {list(modules)}, found none"]
    problems = []
    for cls_name in ("CompletionRequest", "CompletionResponse"):
        cls = getattr(protocol, cls_name, None)
        fields = getattr(cls, "model_fields", {}) if cls is not None else {}
        if "kv_transfer_params" not in fields:
            problems.append(
                f"{protocol.__name__}.{cls_name}: expected a kv_transfer_params field (how a "
                f"client's channel reaches hsx's connector and its reply comes back), found "
                f"{'no such class' if cls is None else sorted(fields)[:12]}"
            )
    request = getattr(protocol, "CompletionRequest", None)
    to_params = getattr(request, "to_sampling_params", None)
    if to_params is not None and "kv_transfer_params" not in inspect.getsource(to_params):
        problems.append(
            "CompletionRequest.to_sampling_params: expected it to pass kv_transfer_params to the "
            "engine (extra_args), found another implementation"
        )
    from vllm.v1.request import Request

    if "kv_transfer_params" not in inspect.getsource(Request.__init__):
        problems.append(
            "vllm.v1.request.Request: expected it to take kv_transfer_params from the sampling "
            "parameters' extra_args, found another implementation"
        )
    import vllm.envs

    known = getattr(vllm.envs, "environment_variables", {})
    if "VLLM_API_KEY" not in known:
        problems.append(
            "vllm.envs: expected VLLM_API_KEY (how hsx serve gives vLLM's server its "
            "server.api_key, off the command line), found no such variable"
        )
    return problems


def _unscannable(value: object) -> bool:
    """A value whose ``vars()`` is not a mapping: llvmlite's ``binding.ffi.lib`` (numba's
    backend) answers every attribute, ``__dict__`` included, with a function wrapper."""
    try:
        return hasattr(value, "__dict__") and not hasattr(vars(value), "get")
    except TypeError:
        return False


class unscannable_module_attributes_hidden:  # noqa: N801 (a context manager, used like a function)
    """Module attributes vLLM's CPU build cannot scan, taken out of their modules while an
    engine is built, then put back.

    vLLM 0.32 without Triton (its CPU build) rebinds its kernel overrides at worker start by
    scanning every module in ``sys.modules`` and calling ``vars(value).get("kernel")`` on each
    attribute; once numba's llvmlite is imported (vLLM's kimi_k25 module imports numba, and
    preflight imports that module to resolve Kimi-K2.5), the scan raises "'_lib_fn_wrapper'
    object has no attribute 'get'" and no engine can be built in the process. Measured: after
    preflight resolved Kimi-K2.5, every later probe of the process failed so."""

    def __init__(self) -> None:
        self._hidden: list[tuple[dict[str, Any], str, object]] = []

    def __enter__(self) -> None:
        import sys

        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if _unscannable(value):
                    self._hidden.append((namespace, attr, value))
                    del namespace[attr]

    def __exit__(self, *_exc: object) -> None:
        for namespace, attr, value in self._hidden:
            namespace[attr] = value
        self._hidden.clear()
