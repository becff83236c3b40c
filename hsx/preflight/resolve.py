"""Resolve config.json's architecture through vLLM's model registry, without loading weights.

The registry maps an architecture name to a (module, class) pair and imports the module lazily;
importing a model module costs seconds and allocates nothing. From the class we derive, by reading
its source with ``ast`` (never by instantiating it):

- the *backbone*: the class whose ``forward`` loops over ``self.layers`` and calls each layer
  (DeepseekV3ForCausalLM -> DeepseekV2Model; there is no DeepseekV3Model);
- the *decoder-layer* class the backbone builds (``make_layers(n, lambda prefix: X(...))``).

Wrappers are followed the way their ``__init__`` builds the inner model: ``self.model_cls(...)``,
``SomeModel(...)``, ``self._init_model(...)`` (its ``return`` is read), or
``init_vllm_registered_model(..., architectures=["X"])`` (X is resolved through the registry again:
KimiK25ForConditionalGeneration -> DeepseekV2ForCausalLM -> DeepseekV2Model).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hsx.preflight.report import CheckResult, Status

# why: attribute names vLLM wrappers use for the inner language model, most likely first.
_INNER_ATTRS = (
    "model",
    "language_model",
    "transformer",
    "text_model",
    "llm",
    "lm",
    "decoder",
    "backbone",
    "encoder",  # ChatGLM's transformer keeps its layers in ``self.encoder``
)
# why: attribute names backbones keep their decoder layers in (GPT-2/Bloom/Falcon: "h").
_LAYER_CONTAINERS = ("layers", "h", "blocks", "layer", "decoder_layers")
# why: a wrapper chain deeper than this is a bug in the walk, not a real model.
_MAX_DEPTH = 6


class ArchitectureResolutionError(ValueError):
    """config.json names an architecture vLLM cannot resolve (a fatal configuration error)."""


@dataclass(frozen=True)
class ResolvedArchitecture:
    architecture: str  # config["architectures"][0]
    module_name: str  # e.g. "vllm.model_executor.models.deepseek_v2"
    class_name: str  # the registered class, e.g. "DeepseekV3ForCausalLM"
    model_cls: type  # the class vLLM instantiates for this architecture
    language_model_cls: type  # the class that owns the backbone (model_cls unless wrapped)
    backbone_cls: type  # runs the decoder layers, e.g. DeepseekV2Model
    # e.g. DeepseekV2DecoderLayer; None when the backbone picks a class per layer at runtime
    # (hybrid attention/mamba models), which only matters for hooks on model internals.
    decoder_layer_cls: type | None
    chain: list[str]  # for printing: arch, module, wrapped classes..., backbone
    # The architecture name of language_model_cls (a wrapper's text model, e.g. Gemma3ForCausalLM
    # inside Gemma3ForConditionalGeneration): what a text-only copy of the model is built as.
    language_architecture: str = ""

    def describe(self) -> str:
        layer = self.decoder_layer_cls.__name__ if self.decoder_layer_cls else "not static"
        return " -> ".join(self.chain) + f" (layers: {layer})"


# --------------------------------------------------------------------------- source reading


@lru_cache(maxsize=64)
def _module_tree(module_name: str) -> ast.Module | None:
    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        return ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return None


def class_def(cls: type) -> ast.ClassDef | None:
    """The ClassDef node of ``cls`` in its module's source (top-level classes only)."""
    tree = _module_tree(cls.__module__)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def own_method(klass: type, name: str) -> ast.FunctionDef | None:
    """Method ``name`` as written in ``klass``'s own class body (None if not defined there).

    Read from source, not from the live attribute: vLLM's ``@support_torch_compile`` replaces
    ``__init__`` with a generic wrapper, so ``inspect.getsource(cls.__init__)`` lies.
    """
    node = class_def(klass) if name in vars(klass) else None
    for item in node.body if node else []:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            return item
    return None


def method_def(cls: type, name: str) -> tuple[type, ast.FunctionDef] | None:
    """The first source definition of method ``name`` along the MRO, with its class."""
    for klass in cls.__mro__:
        fn = own_method(klass, name)
        if fn is not None:
            return klass, fn
    return None


def module_global(owner: type, node: ast.expr) -> Any:
    """Evaluate a Name / dotted Attribute in the module namespace of ``owner`` (None if unknown)."""
    module = sys.modules.get(owner.__module__)
    if module is None:
        return None
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute):
        base = module_global(owner, node.value)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _is_self_attr(node: ast.AST, attr: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (attr is None or node.attr == attr)
    )


def _self_attrs_in(node: ast.AST) -> list[str]:
    return [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and _is_self_attr(n)]


def _container_in(node: ast.AST) -> str | None:
    """The layer-container attribute ``node`` reads (``islice(self.layers, self.start_layer)``)."""
    attrs = [a for a in _self_attrs_in(node) if a in _LAYER_CONTAINERS]
    return attrs[0] if attrs else None


def _names_in(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


@dataclass(frozen=True)
class LayerLoop:
    """Where a backbone's forward calls its decoder layers."""

    owner: type  # the class whose source defines forward
    forward: ast.FunctionDef
    call: ast.Call  # the ``layer(...)`` call
    container: str  # the attribute holding the layers, e.g. "layers" (GPT-2: "h")


def layer_loop_call(cls: type) -> LayerLoop | None:
    """The ``layer(...)`` call in ``forward``'s loop over a module list of ``self``, if any.

    A backbone is recognised by this shape alone: ``for ... layer in ...self.<list>...:`` (or
    ``layer = self.<list>[i]`` inside an index loop) followed by a call of ``layer``.
    """
    for owner in cls.__mro__:
        fn = own_method(owner, "forward")
        if fn is None:
            continue
        loop = _layer_loop_in(owner, fn)
        if loop is not None:
            return loop
        # why: a subclass forward that only adds arguments (MistralModel) defers to super().
        if not any(_is_super_call(c, "forward") for c in ast.walk(fn) if isinstance(c, ast.Call)):
            return None
    return None


def _layer_loop_in(owner: type, fn: ast.FunctionDef) -> LayerLoop | None:
    loops: list[LayerLoop] = []
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        bound: dict[str, str] = {}  # loop-bound name -> self attribute it comes from
        if attr := _container_in(loop.iter):
            bound.update(dict.fromkeys(_names_in(loop.target), attr))
        # why: some backbones loop over indices and fetch ``layer = self.layers[i]`` inside.
        for stmt in ast.walk(loop):
            if isinstance(stmt, ast.Assign) and (attr := _container_in(stmt.value)):
                for target in stmt.targets:
                    bound.update(dict.fromkeys(_names_in(target), attr))
        for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id in bound:
                loops.append(LayerLoop(owner, fn, call, bound[call.func.id]))
                break
    rank = {name: i for i, name in enumerate(_LAYER_CONTAINERS)}
    loops.sort(key=lambda loop: rank[loop.container])
    return loops[0] if loops else None


# --------------------------------------------------------------------------- evaluating source

# Bindings for a function's parameters, as passed by its caller (evaluated lazily).
_Env = Mapping[str, Callable[[], Any]]


@dataclass(frozen=True)
class _Scope:
    cls: type  # the concrete class (what ``self`` is)
    owner: type  # the class whose source defines ``fn`` (its module is the namespace)
    fn: ast.FunctionDef
    env: _Env  # keyword arguments the caller passed to ``fn``


def _param_default(fn: ast.FunctionDef, name: str) -> ast.expr | None:
    args = fn.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(
        positional[len(positional) - len(args.defaults) :], args.defaults, strict=True
    ):
        if arg.arg == name:
            return default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if arg.arg == name:
            return kw_default
    return None


def _is_param(fn: ast.FunctionDef, name: str) -> bool:
    args = fn.args
    return any(a.arg == name for a in args.posonlyargs + args.args + args.kwonlyargs)


def _eval(scope: _Scope, expr: ast.expr | None) -> Any:
    """Statically evaluate a class-valued expression: a parameter, ``self.attr`` or a global."""
    if expr is None:
        return None
    if isinstance(expr, ast.Name):
        if expr.id in scope.env:
            return scope.env[expr.id]()
        if _is_param(scope.fn, expr.id):
            default = _param_default(scope.fn, expr.id)
            return _eval(_Scope(scope.cls, scope.owner, scope.fn, {}), default)
        return module_global(scope.owner, expr)
    if _is_self_attr(expr) and isinstance(expr, ast.Attribute):
        return getattr(scope.cls, expr.attr, None)
    if isinstance(expr, ast.Attribute):
        return module_global(scope.owner, expr)
    return None


def _call_env(scope: _Scope, call: ast.Call) -> _Env:
    def bind(value: ast.expr) -> Callable[[], Any]:
        return lambda: _eval(scope, value)

    return {kw.arg: bind(kw.value) for kw in call.keywords if kw.arg is not None}


def _is_super_call(call: ast.Call, method: str) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == method
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
    )


def _init_scopes(cls: type, env: _Env) -> Iterator[_Scope]:
    """Each ``__init__`` along the MRO, with the keywords its subclass passed to super().__init__."""
    for klass in cls.__mro__:
        # why: torch's own __init__s build no submodules of interest and are costly to parse.
        if klass.__module__.startswith(("torch", "builtins")):
            continue
        init = own_method(klass, "__init__")
        if init is None:
            continue  # why: a decorator (support_torch_compile) added __init__; read the base.
        scope = _Scope(cls, klass, init, env)
        yield scope
        supers = [
            c for c in ast.walk(init) if isinstance(c, ast.Call) and _is_super_call(c, "__init__")
        ]
        if not supers:
            return
        env = _call_env(scope, supers[0])


def _decoder_layer_cls(backbone: type, env: _Env) -> type | None:
    """The class the backbone's ``__init__`` builds its layers from (None if not static)."""
    for scope in _init_scopes(backbone, env):
        for call in (n for n in ast.walk(scope.fn) if isinstance(n, ast.Call)):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            factory: ast.expr | None = None
            if name == "make_layers" and len(call.args) >= 2:
                # make_layers(num_layers, lambda prefix: LayerCls(...), prefix=...)
                arg = call.args[1]
                if isinstance(arg, ast.Lambda) and isinstance(arg.body, ast.Call):
                    factory = arg.body.func
                elif isinstance(arg, ast.Name | ast.Attribute):
                    factory = arg
            elif name == "ModuleList" and call.args:
                # nn.ModuleList([LayerCls(...) for i in range(n)])
                comp = call.args[0]
                if isinstance(comp, ast.ListComp) and isinstance(comp.elt, ast.Call):
                    factory = comp.elt.func
            value = _eval(scope, factory)
            if inspect.isclass(value):
                return value
    return None


def decoder_layer_of(backbone: type) -> type | None:
    """The decoder-layer class ``backbone`` builds with its own defaults (None if not static)."""
    return _decoder_layer_cls(backbone, {})


# --------------------------------------------------------------------------- registry


def _registry() -> Any:
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry


def supported_architectures() -> list[str]:
    return sorted(_registry().get_supported_archs())


def _load_arch(arch: str) -> tuple[str, type]:
    """(module name, class) of a registered architecture; raises with close matches if unknown."""
    registry = _registry()
    entry = registry.models.get(arch)
    if entry is None:
        known = supported_architectures()
        close = difflib.get_close_matches(arch, known, n=3, cutoff=0.6)
        hint = f" Closest known: {', '.join(close)}." if close else ""
        raise ArchitectureResolutionError(
            f"Architecture {arch!r} is not in vLLM's model registry "
            f"({len(known)} architectures known).{hint}"
        )
    module_name = getattr(entry, "module_name", None)
    try:
        # why: load_model_cls only imports the module (lazy entries) or returns the class.
        cls = entry.load_model_cls()
    except Exception as exc:  # why: any import failure in a model module means "cannot resolve".
        raise ArchitectureResolutionError(
            f"Architecture {arch!r} is registered as {module_name}, but importing it failed: "
            f"{exc!r}"
        ) from exc
    return module_name or cls.__module__, cls


def wrapped_architecture_from_source(arch: str) -> str | None:
    """The text model a registered wrapper builds, read from its module's source without
    importing it (for a wrapper whose module does not import here, e.g. a vision tower's missing
    dependency): ``init_vllm_registered_model(..., architectures=["X"])`` or
    ``initialize_model(..., model_class=X)`` in its class body."""
    import importlib.util

    entry = _registry().models.get(arch)
    module_name = getattr(entry, "module_name", None)
    class_name = getattr(entry, "class_name", None) or arch
    if not module_name:
        return None
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        # self.language_model = Qwen3_5ForCausalLM(...) (Qwen3.5's wrappers build it directly)
        for assign in (n for n in ast.walk(node) if isinstance(n, ast.Assign)):
            target, value = assign.targets[0], assign.value
            if (
                _is_self_attr(target, "language_model")
                and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id in _registry().models  # a class, not a builder function
            ):
                return value.func.id
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            for kw in call.keywords:
                value = kw.value
                if (
                    name == "init_vllm_registered_model"
                    and kw.arg == "architectures"
                    and isinstance(value, ast.List | ast.Tuple)
                    and value.elts
                    and isinstance(value.elts[0], ast.Constant)
                    and isinstance(value.elts[0].value, str)
                ):
                    return value.elts[0].value
                if (
                    name == "initialize_model"
                    and kw.arg == "model_class"
                    and isinstance(value, ast.Name)
                ):
                    return value.id
    return None


@dataclass(frozen=True)
class _Built:
    via_arch: str | None  # set when built through init_vllm_registered_model(architectures=[...])
    cls: type
    env: _Env  # keyword arguments passed to its constructor


def _built_in(scope: _Scope, value: ast.expr, config: Mapping[str, Any]) -> Iterator[_Built]:
    """Classes an expression constructs: ``X(...)``, ``self.model_cls(...)``, ``self._m(...)``."""
    if not isinstance(value, ast.Call):
        return
    func = value.func
    if isinstance(func, ast.Name) and func.id == "init_vllm_registered_model":
        arch = _registered_arch_argument(value, config)
        if arch is not None:
            yield _Built(arch, _load_arch(arch)[1], {})
        return
    target = _eval(scope, func)
    if inspect.isclass(target):
        yield _Built(None, target, _call_env(scope, value))
    elif _is_self_attr(func) and isinstance(func, ast.Attribute) and callable(target):
        # self._init_model(...): read what the method returns
        found = method_def(scope.cls, func.attr)
        if found is not None:
            inner = _Scope(scope.cls, found[0], found[1], _call_env(scope, value))
            for ret in (n for n in ast.walk(inner.fn) if isinstance(n, ast.Return)):
                if ret.value is not None:
                    yield from _built_in(inner, ret.value, config)


def _registered_arch_argument(call: ast.Call, config: Mapping[str, Any]) -> str | None:
    for kw in call.keywords:
        if kw.arg == "architectures" and isinstance(kw.value, ast.List | ast.Tuple):
            names = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
            if names and isinstance(names[0], str):
                return names[0]
    # why: without an explicit list vLLM uses hf_config.architectures, i.e. text_config's.
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get("architectures"):
        return str(text["architectures"][0])
    return None


def _inner_models(cls: type, env: _Env, config: Mapping[str, Any]) -> Iterator[_Built]:
    """What ``cls.__init__`` (and its bases' __init__) build as ``self.<attr>``, likeliest first."""
    assigns: list[tuple[str, _Scope, ast.expr]] = []
    for scope in _init_scopes(cls, env):
        for node in ast.walk(scope.fn):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and _is_self_attr(target):
                        assigns.append((target.attr, scope, node.value))
    rank = {name: i for i, name in enumerate(_INNER_ATTRS)}
    # why: only attributes named like a language model; vision/audio towers also loop over layers.
    for _attr, scope, value in sorted(
        (a for a in assigns if a[0] in rank), key=lambda a: rank[a[0]]
    ):
        yield from _built_in(scope, value, config)


def _find_backbone(
    cls: type,
    env: _Env,
    config: Mapping[str, Any],
    chain: list[str],
    name: str,
    depth: int = 0,
) -> tuple[type, _Built, str] | None:
    """(language-model class, backbone, the language model's architecture name) under ``cls``
    (reached as ``name``), appending wrapped names to ``chain``."""
    if depth > _MAX_DEPTH:
        return None
    for built in _inner_models(cls, env, config):
        if layer_loop_call(built.cls) is not None:
            chain.append(built.cls.__name__)
            return cls, built, name
        inner_name = built.via_arch or built.cls.__name__
        sub_chain = [inner_name]
        found = _find_backbone(built.cls, built.env, config, sub_chain, inner_name, depth + 1)
        if found is not None:
            chain.extend(sub_chain)
            return found
    return None


def resolve_architecture(config: Mapping[str, Any]) -> ResolvedArchitecture:
    """Resolve ``config["architectures"][0]`` to vLLM classes, without weights or instances."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ArchitectureResolutionError(
            "config.json must list the model class in 'architectures' "
            f"(expected e.g. ['LlamaForCausalLM']); found {archs!r}"
        )
    arch = archs[0]
    module_name, model_cls = _load_arch(arch)
    chain = [arch, module_name]
    if model_cls.__name__ != arch:
        chain.append(model_cls.__name__)
    if layer_loop_call(model_cls) is not None:
        language_model_cls, built, language_arch = model_cls, _Built(None, model_cls, {}), arch
    else:
        found = _find_backbone(model_cls, {}, config, chain, arch)
        if found is None:
            raise ArchitectureResolutionError(
                f"{model_cls.__name__} ({module_name}) resolved, but no backbone was found: "
                "expected a class whose forward loops over self.layers; found none built in "
                f"its __init__ as self.{'/'.join(_INNER_ATTRS)}"
            )
        language_model_cls, built, language_arch = found
    return ResolvedArchitecture(
        architecture=arch,
        module_name=module_name,
        class_name=model_cls.__name__,
        model_cls=model_cls,
        language_model_cls=language_model_cls,
        backbone_cls=built.cls,
        decoder_layer_cls=_decoder_layer_cls(built.cls, built.env),
        chain=chain,
        language_architecture=language_arch,
    )


def _config_notes(config: Mapping[str, Any]) -> tuple[list[str], bool]:
    """Detail lines about remote code / model_type, and whether loading may need remote code."""
    notes: list[str] = []
    needs_remote = False
    if "auto_map" in config:
        notes.append("auto_map (remote code) present: ignored, resolved via 'architectures'")
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        from transformers import CONFIG_MAPPING

        try:
            from vllm.transformers_utils.config import _CONFIG_REGISTRY as VLLM_CONFIGS
        except ImportError:  # why: private name; its absence must not fail preflight.
            VLLM_CONFIGS = {}  # noqa: N806
        if model_type in VLLM_CONFIGS:
            notes.append(f"model_type {model_type!r}: config class from vLLM's config registry")
        elif model_type not in CONFIG_MAPPING:
            needs_remote = True
            notes.append(
                f"model_type {model_type!r} is unknown to transformers and to vLLM's config "
                "registry: the engine would need trust_remote_code to read config.json"
            )
    return notes, needs_remote


def resolve_text_model(config: Mapping[str, Any]) -> ResolvedArchitecture | None:
    """For a wrapper that does not resolve here (its module does not import), the text model
    it builds, resolved on its own: the checks of layer ids and captured layers still apply to
    it. None when the source names no text model or that one does not resolve either."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        return None
    inner = wrapped_architecture_from_source(archs[0])
    if inner is None or inner == archs[0]:
        return None
    try:
        return resolve_architecture({**config, "architectures": [inner]})
    except ArchitectureResolutionError:
        return None


def check_resolution(config: Mapping[str, Any]) -> CheckResult:
    """Preflight check: the architecture resolves to a vLLM class, backbone and decoder layer."""
    try:
        resolved = resolve_architecture(config)
    except ArchitectureResolutionError as exc:
        details: tuple[str, ...] = ()
        text_model = resolve_text_model(config)
        archs = config.get("architectures")
        inner = (
            wrapped_architecture_from_source(archs[0])
            if isinstance(archs, list) and archs and isinstance(archs[0], str)
            else None
        )
        if text_model is not None:
            details = (
                f"its source builds the text model {text_model.architecture} "
                f"({text_model.describe()}): the remaining checks use that one",
            )
        elif inner is not None:
            details = (
                f"its source builds the text model {inner}, which does not resolve here "
                "either: its layer ids and capture are not checked here",
            )
        hint = ""
        if "torchvision" in str(exc):
            hint = (
                " (vLLM's CPU build carries no torchvision: the CUDA-linked wheel pip brings "
                "breaks `from vllm import LLM`; the engine cannot build this class here)"
            )
        return CheckResult("resolve", Status.FAIL, f"{exc}{hint}", details)
    notes, needs_remote = _config_notes(config)
    layer = resolved.decoder_layer_cls
    if layer is None:
        notes.append(
            "decoder-layer class is chosen per layer at runtime: hooks on layers cannot be "
            "signature-checked (the extract_hidden_states path does not need them)"
        )
    details = (
        f"class: {resolved.module_name}.{resolved.class_name}",
        f"backbone: {resolved.backbone_cls.__module__}.{resolved.backbone_cls.__name__}",
        f"decoder layer: {f'{layer.__module__}.{layer.__name__}' if layer else 'not static'}",
        *notes,
    )
    status = Status.WARN if needs_remote or layer is None else Status.PASS
    return CheckResult("resolve", status, resolved.describe(), details)
