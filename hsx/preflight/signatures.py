"""Signature validation: compare how hsx calls vLLM internals with the real signatures.

The failure that started hsx (DESIGN.md section 3): a patched forward called
``layer(hidden_states=..., positions=..., residual=...)`` while vLLM's
``DeepseekV2DecoderLayer.forward(positions, hidden_states, residual, llama_4_scaling=None)`` expects
``llama_4_scaling`` too, which ``DeepseekV2Model.forward`` computes and passes. The call type-checks
and runs; it silently drops the scaling. We catch that generically: read the backbone's forward with
``ast``, find its ``layer(...)`` call, and treat every argument it passes as one a call site must
pass too. Every mismatch is one line naming class, file:line, parameter, expected and found.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hsx.preflight.report import CheckResult, Status
from hsx.preflight.resolve import (
    LayerLoop,
    ResolvedArchitecture,
    decoder_layer_of,
    layer_loop_call,
)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True)
class CallSite:
    """How hsx (or user code) calls a callable."""

    # What each positional argument *is*, in order, named by the parameter the caller means
    # (e.g. ("hidden_states", "positions", "residual")).
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()  # keyword names passed
    relies_on_defaults: tuple[str, ...] = ()  # parameters deliberately left to their defaults
    where: str = ""  # the calling code, e.g. "hsx/engine/hooks.py:42", for messages


@dataclass(frozen=True)
class ModelCall:
    """Arguments the model's own code passes to a callable (e.g. the backbone to its layers)."""

    passes: tuple[str, ...]  # callee parameter names bound by the model's call
    where: str  # e.g. "DeepseekV2Model.forward (.../deepseek_v2.py:1569)"
    extra: tuple[str, ...] = ()  # notes: ``**kwargs`` forwarded, unmapped ``*args``


def _location(obj: Any) -> str:
    try:
        file = inspect.getsourcefile(obj) or "?"
        line = inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return getattr(obj, "__module__", "?")
    return f"{file}:{line}"


def _params(callee: Callable[..., Any]) -> list[inspect.Parameter]:
    """Parameters a caller supplies: without ``self``/``cls`` of a function defined in a class."""
    params = list(inspect.signature(callee).parameters.values())
    bound_already = inspect.ismethod(callee)
    if (
        not bound_already
        and params
        and params[0].name in ("self", "cls")
        and "." in getattr(callee, "__qualname__", "")
    ):
        params = params[1:]
    return params


def model_call_of(loop: LayerLoop, callee: Callable[..., Any]) -> ModelCall:
    """Map the backbone's ``layer(...)`` call onto the callee's parameter names."""
    params = _params(callee)
    positional = [p for p in params if p.kind in _POSITIONAL]
    passes: list[str] = []
    extra: list[str] = []
    for i, arg in enumerate(loop.call.args):
        if isinstance(arg, ast.Starred):
            extra.append(f"*{ast.unparse(arg.value)} forwarded (not checked)")
            break
        if i < len(positional):
            passes.append(positional[i].name)
    for kw in loop.call.keywords:
        if kw.arg is None:
            extra.append(f"**{ast.unparse(kw.value)} forwarded (not checked)")
        else:
            passes.append(kw.arg)
    file = inspect.getsourcefile(loop.owner) or "?"
    where = f"{loop.owner.__name__}.forward ({file}:{loop.call.lineno})"
    return ModelCall(tuple(passes), where, tuple(extra))


def _defining_class(callee: Callable[..., Any]) -> type | None:
    """The class whose body defines ``callee`` (from its qualname)."""
    parts = getattr(callee, "__qualname__", "").split(".")
    module = sys.modules.get(getattr(callee, "__module__", ""))
    if module is None or len(parts) < 2 or "<locals>" in parts:
        return None
    obj: Any = module
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
    return obj if inspect.isclass(obj) else None


def find_model_call(callee: Callable[..., Any]) -> ModelCall | None:
    """How the model's own backbone calls ``callee`` when it is a decoder layer's forward.

    Searches the layer class's module for a backbone whose forward loop calls layers built from
    that class (DeepseekV2DecoderLayer.forward -> DeepseekV2Model.forward's ``layer(...)``).
    """
    layer_cls = _defining_class(callee)
    if layer_cls is None or callee.__name__ != "forward":
        return None
    module = sys.modules[layer_cls.__module__]
    for candidate in vars(module).values():
        if not inspect.isclass(candidate) or candidate.__module__ != module.__name__:
            continue
        loop = layer_loop_call(candidate)
        if loop is not None and decoder_layer_of(candidate) is layer_cls:
            return model_call_of(loop, callee)
    return None


def compare_call(
    callee: Callable[..., Any],
    call: CallSite,
    owner: str,
    model_call: ModelCall | None = None,
) -> list[str]:
    """One line per way ``call`` disagrees with ``callee``'s real signature.

    ``owner`` names the class (or module) for messages. ``model_call`` says what the model's own
    code passes; when None and ``callee`` is a decoder layer's forward, it is found from source.
    """
    head = f"{owner}.{callee.__name__} ({_location(callee)})"
    params = _params(callee)
    by_name = {p.name: p for p in params}
    positional = [p for p in params if p.kind in _POSITIONAL]
    var_pos = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    where = f" [{call.where}]" if call.where else ""
    out: list[str] = []
    bound: set[str] = set()

    for i, meant in enumerate(call.positional):
        if i >= len(positional):
            if not var_pos:
                out.append(
                    f"{head}: positional argument {i + 1} ({meant!r}): expected at most "
                    f"{len(positional)} positional arguments {[p.name for p in positional]}; "
                    f"found {len(call.positional)}{where}"
                )
            continue
        real = positional[i]
        bound.add(real.name)
        if real.name != meant:
            out.append(
                f"{head}: positional argument {i + 1}: expected {real.name!r} "
                f"(real order {[p.name for p in positional]}); found {meant!r}{where}"
            )

    for name in call.keywords:
        param = by_name.get(name)
        if param is None or param.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            if not var_kw:
                out.append(
                    f"{head}: keyword {name!r}: expected one of "
                    f"{[p.name for p in params if p.kind not in _VARIADIC]}; found no such "
                    f"parameter{where}"
                )
            continue
        if param.kind == inspect.Parameter.POSITIONAL_ONLY:
            out.append(f"{head}: keyword {name!r}: expected positional-only; found keyword{where}")
        elif name in bound:
            out.append(f"{head}: parameter {name!r}: expected once; found positional and keyword")
        bound.add(name)

    for p in params:
        if p.kind in _VARIADIC or p.default is not inspect.Parameter.empty or p.name in bound:
            continue
        out.append(
            f"{head}: required parameter {p.name!r}: expected supplied; found missing{where}"
        )

    for name in call.relies_on_defaults:
        param = by_name.get(name)
        if param is None:
            out.append(
                f"{head}: parameter {name!r}: call site relies on its default; found no such "
                f"parameter{where}"
            )
        elif param.default is inspect.Parameter.empty:
            out.append(
                f"{head}: parameter {name!r}: call site relies on a default; found it required"
                f"{where}"
            )

    if model_call is None:
        model_call = find_model_call(callee)
    if model_call is not None:
        for name in model_call.passes:
            if name in bound or name not in by_name:
                continue
            default = by_name[name].default
            shown = "none" if default is inspect.Parameter.empty else repr(default)
            out.append(
                f"{head}: parameter {name!r}: expected passed, as {model_call.where} computes and "
                f"passes it; found omitted (gets default {shown}){where}"
            )
    return out


# --------------------------------------------------------------------------- overrides


def _kind(static: Any) -> str:
    if isinstance(static, staticmethod):
        return "staticmethod"
    if isinstance(static, classmethod):
        return "classmethod"
    return "method"


def _override_params(cls: type, name: str) -> list[inspect.Parameter]:
    static = inspect.getattr_static(cls, name)
    func = static.__func__ if isinstance(static, staticmethod | classmethod) else static
    params = list(inspect.signature(func).parameters.values())
    return params if isinstance(static, staticmethod) else params[1:]


def check_override_signatures(subclass: type, base: type) -> list[str]:
    """For each method ``subclass`` overrides from ``base``: the override accepts base's calls.

    vLLM calls connector methods positionally and by keyword, so an override must keep the base's
    parameter names in order (or take ``*args``/``**kwargs``), keep optional what the base makes
    optional, and give a default to anything it adds.
    """
    out: list[str] = []
    for name in sorted(dir(base)):
        if name.startswith("__") and name != "__init__":
            continue
        base_static = inspect.getattr_static(base, name)
        if not (
            inspect.isfunction(base_static) or isinstance(base_static, staticmethod | classmethod)
        ):
            continue
        definer = next((k for k in subclass.__mro__ if name in vars(k)), None)
        if definer is None or definer in base.__mro__:
            continue  # not overridden below base
        sub_static = vars(definer)[name]
        head = f"{definer.__name__}.{name} ({_location(getattr(definer, name))})"
        if _kind(sub_static) != _kind(base_static):
            out.append(
                f"{head}: expected a {_kind(base_static)} like {base.__name__}.{name}; "
                f"found a {_kind(sub_static)}"
            )
            continue
        if not callable(getattr(definer, name, None)):
            out.append(f"{head}: expected a callable; found {type(sub_static).__name__}")
            continue
        out += _compare_override(
            head, base.__name__, _override_params(base, name), _override_params(definer, name)
        )
    return out


def _compare_override(
    head: str, base_name: str, base: list[inspect.Parameter], sub: list[inspect.Parameter]
) -> list[str]:
    out: list[str] = []
    sub_var_pos = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in sub)
    sub_var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in sub)
    sub_pos = [p for p in sub if p.kind in _POSITIONAL]
    sub_named = {p.name: p for p in sub if p.kind != inspect.Parameter.POSITIONAL_ONLY}
    matched: set[str] = set()
    base_pos = [p for p in base if p.kind in _POSITIONAL]
    for i, bp in enumerate(base_pos):
        if i < len(sub_pos):
            sp = sub_pos[i]
            matched.add(sp.name)
            if (
                sp.name != bp.name
                and bp.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
                and not sub_var_kw
            ):
                out.append(
                    f"{head}: parameter {i + 1}: expected {bp.name!r} as in {base_name}; "
                    f"found {sp.name!r}"
                )
            elif (
                bp.default is not inspect.Parameter.empty and sp.default is inspect.Parameter.empty
            ):
                out.append(
                    f"{head}: parameter {bp.name!r}: expected optional as in {base_name}; "
                    "found required"
                )
        elif not sub_var_pos:
            out.append(
                f"{head}: parameter {bp.name!r}: expected (position {i + 1}, as in "
                f"{base_name}); found missing"
            )
    for bp in base:
        if (
            bp.kind == inspect.Parameter.KEYWORD_ONLY
            and bp.name not in sub_named
            and not sub_var_kw
        ):
            out.append(f"{head}: keyword {bp.name!r}: expected as in {base_name}; found missing")
        matched.add(bp.name)
        if bp.kind in _VARIADIC and not any(sp.kind == bp.kind for sp in sub):
            star = "*" if bp.kind == inspect.Parameter.VAR_POSITIONAL else "**"
            out.append(f"{head}: expected {star}{bp.name} as in {base_name}; found none")
    for sp in sub:
        if sp.kind in _VARIADIC or sp.default is not inspect.Parameter.empty or sp.name in matched:
            continue
        out.append(
            f"{head}: parameter {sp.name!r}: expected a default ({base_name} callers never "
            "pass it); found required"
        )
    return out


def check_set_aux_layers(model_cls: type) -> list[str]:
    """``set_aux_hidden_state_layers`` must accept one positional ``layers`` argument."""
    method = getattr(model_cls, "set_aux_hidden_state_layers", None)
    head = f"{model_cls.__name__}.set_aux_hidden_state_layers"
    if method is None:
        return [f"{head}: expected a method (vLLM's SupportsEagle3); found none"]
    site = CallSite(positional=("layers",), where="vLLM extract_hidden_states")
    lines = compare_call(method, site, model_cls.__name__, model_call=ModelCall((), ""))
    # why: the name does not matter here, vLLM passes it positionally; only arity does.
    return [line for line in lines if "positional argument 1: expected" not in line]


def check_hsx_capture_sites(resolved: ResolvedArchitecture) -> list[str]:
    """hsx's own capture hooks (hsx.engine.capture_models) read the decoder layer's
    ``hidden_states`` and ``residual`` arguments by name: both must be parameters of its
    forward, or the hooks would fail at the first step after the load."""
    layer = resolved.decoder_layer_cls
    if layer is None:
        return [
            f"{resolved.backbone_cls.__name__}: hsx's capture hooks expected one decoder-layer "
            "class, found one chosen per layer at runtime"
        ]
    present = set(inspect.signature(getattr(layer, "forward")).parameters)  # noqa: B009
    missing = [name for name in ("hidden_states", "residual") if name not in present]
    if not missing:
        return []
    return [
        f"{layer.__name__}.forward: hsx's capture hooks read {missing}; found parameters "
        f"{sorted(present - {'self'})} ({inspect.getsourcefile(layer)})"
    ]


# --------------------------------------------------------------------------- the check


def _target(
    resolved: ResolvedArchitecture, key: str
) -> tuple[Callable[..., Any], str, ModelCall | None]:
    """Resolve a call-site key: ``role.method`` or a dotted import path ``pkg.mod.Class.method``."""
    roles: dict[str, type | None] = {
        "model": resolved.model_cls,
        "language_model": resolved.language_model_cls,
        "backbone": resolved.backbone_cls,
        "decoder_layer": resolved.decoder_layer_cls,
    }
    role, _, method = key.partition(".")
    if role in roles and method:
        cls = roles[role]
        if cls is None:
            raise LookupError(
                f"{key}: expected a static {role} class; found none for {resolved.architecture}"
            )
        func = getattr(cls, method, None)
        if not callable(func):
            raise LookupError(f"{key}: expected {cls.__name__}.{method}; found no such method")
        model_call = None
        if role == "decoder_layer" and method == "forward":
            loop = layer_loop_call(resolved.backbone_cls)
            model_call = model_call_of(loop, func) if loop is not None else None
        return func, cls.__name__, model_call
    parts = key.split(".")
    # why: the longest importable prefix is the module; the rest is attribute access.
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        owner = ".".join(parts[split:-1]) or parts[split - 1]
        return obj, owner, None
    raise LookupError(
        f"{key}: expected 'role.method' (roles {sorted(roles)}) or an importable dotted path; "
        "found neither"
    )


def check_signatures(
    resolved: ResolvedArchitecture,
    call_sites: Mapping[str, CallSite],
    kv_connector: type | None = None,
) -> CheckResult:
    """Every hsx call site against the real signatures; the KV connector against its base."""
    from hsx.engine.capture_models import needs_hsx_capture

    lines: list[str] = []
    if needs_hsx_capture([resolved.architecture]):
        lines += check_hsx_capture_sites(resolved)
        checked = ["hsx capture hooks"]
    else:
        lines += check_set_aux_layers(resolved.model_cls)
        checked = ["set_aux_hidden_state_layers"]
    for key, site in call_sites.items():
        try:
            func, owner, model_call = _target(resolved, key)
        except (LookupError, AttributeError) as exc:
            lines.append(str(exc))
            continue
        lines += compare_call(func, site, owner, model_call)
        checked.append(key)
    if kv_connector is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        if not issubclass(kv_connector, KVConnectorBase_V1):
            lines.append(
                f"{kv_connector.__name__}: expected a subclass of KVConnectorBase_V1; "
                f"found bases {[b.__name__ for b in kv_connector.__mro__[1:]]}"
            )
        else:
            lines += check_override_signatures(kv_connector, KVConnectorBase_V1)
        checked.append(kv_connector.__name__)
    if lines:
        return CheckResult(
            "signatures",
            Status.FAIL,
            f"{len(lines)} signature mismatch(es) in {len(checked)} checked call "
            f"site(s); first: {lines[0]}",
            tuple(lines),
        )
    return CheckResult(
        "signatures",
        Status.PASS,
        f"{len(checked)} call site(s) match vLLM's signatures: {', '.join(checked)}",
    )


def default_call_sites() -> dict[str, CallSite]:
    """The internals hsx's primary path calls: none besides set_aux_hidden_state_layers.

    Hooks or user code that call model internals add their own entries (e.g.
    ``{"decoder_layer.forward": CallSite(positional=("positions", "hidden_states", "residual"))}``).
    """
    return {}
