"""The capture contract: can vLLM's own forward hand hsx the hidden states it asks for?

hsx's primary path (DESIGN.md section 3) is vLLM's ``extract_hidden_states`` speculative method: the
model's own forward collects the aux layers named through ``set_aux_hidden_state_layers``. That
works only for classes implementing vLLM's EAGLE-3 interface, and only for layer ids the backbone's
collection code can serve. Both are checked here from source, in seconds.
"""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.model.config import text_config
from hsx.model.layer_structure import layer_structure
from hsx.model.layers import default_layer_ids
from hsx.preflight.report import CheckResult, Status
from hsx.preflight.resolve import ResolvedArchitecture, layer_loop_call

# Known-bad (architecture, vLLM version prefix) pairs: {(arch, "0.32."): "why and what to do"}.
# why a table: some breakages are only learnt from a failed run; record them here so the next
# preflight fails in seconds. Empty while no such pair is known for the pinned vLLM versions.
KNOWN_BAD: dict[tuple[str, str], str] = {}

_REFERENCE_PATH = (
    "use the HF transformers reference path (output_hidden_states=True), or a vLLM version "
    "whose class implements SupportsEagle3"
)


@dataclass(frozen=True)
class LayerIdRange:
    """The layer ids (vLLM convention) a backbone's own aux collection can serve."""

    low: int  # 0, or 1 where the residual entering layer 0 is None and the sum would crash
    high: int  # num_hidden_layers: the final pre-norm state
    reason: str  # where ``low`` comes from, for the report


def _mentions_name(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _mentions_attr(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


def capture_id_range(resolved: ResolvedArchitecture, num_layers: int) -> LayerIdRange:
    """Read the backbone's forward to learn whether id 0 (the embeddings) can be captured.

    Llama-style backbones use EagleModelMixin._maybe_add_hidden_state, which adds the residual only
    when it is not None: id 0 works. DeepSeek-V2/V3 collect ``hidden_states + residual`` before
    layer ``idx`` unguarded; ``residual`` is None entering layer 0, so id 0 raises a TypeError
    inside the engine: the valid range starts at 1.
    """
    loop = layer_loop_call(resolved.backbone_cls)
    if loop is None:
        return LayerIdRange(0, num_layers, "backbone forward not found; id 0 not verified")
    owner, fn = loop.owner, loop.forward
    where = f"{owner.__name__}.forward ({inspect.getsourcefile(owner)}"
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "_maybe_add_hidden_state":
            return LayerIdRange(
                0, num_layers, f"{where}:{call.lineno}) skips the None residual at layer 0"
            )
    # why: only the collection inside the layer loop runs before layer 0; the one after the loop
    # (id L) always sees a real residual.
    layer_for = next(
        (f for f in ast.walk(fn) if isinstance(f, ast.For) and loop.call in ast.walk(f)), fn
    )
    for branch in (n for n in ast.walk(layer_for) if isinstance(n, ast.If)):
        if not _mentions_attr(branch.test, "aux_hidden_state_layers"):
            continue
        body = ast.Module(body=branch.body, type_ignores=[])
        guarded = any(
            isinstance(n, ast.Compare) and _mentions_name(n, "residual") for n in ast.walk(body)
        )
        for add in (n for n in ast.walk(body) if isinstance(n, ast.BinOp)):
            if isinstance(add.op, ast.Add) and _mentions_name(add, "residual") and not guarded:
                return LayerIdRange(
                    1,
                    num_layers,
                    f"{where}:{add.lineno}) adds hidden_states + residual unguarded, and "
                    "residual is None entering layer 0: id 0 would crash the engine",
                )
    return LayerIdRange(0, num_layers, f"{where}:{fn.lineno}) has no unguarded residual sum")


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "unknown"


def _hybrid_refusal(
    resolved: ResolvedArchitecture, text: Mapping[str, Any], version: str
) -> CheckResult | None:
    """A hybrid model (linear-attention or Mamba state beside attention KV) cannot be captured:
    vLLM's extract_hidden_states keeps the states in a cache-only attention layer, and vLLM
    0.32 cannot join that layer's KV cache spec with the hybrid's state specs. Measured on the
    tiny Qwen3-Next: engine start fails after the load ("Failed to promote local KV cache specs
    to one unified type."); vLLM PR #51328 saw 70%+ zeros and NaN states where it did start."""
    from vllm.model_executor.models.interfaces import is_hybrid

    structure = layer_structure(text)
    linear = structure.linear_attention_layers()
    if not linear and not is_hybrid(resolved.model_cls):
        return None
    layers = structure.num_layers
    kinds = (
        f"{len(linear)} of its {layers} layers linear attention"
        if linear
        else "a state-space (Mamba) state beside attention"
    )
    return CheckResult(
        "contract",
        Status.FAIL,
        f"{resolved.class_name} is a hybrid model ({kinds}): expected a KV cache of one kind "
        f"that vLLM {version}'s extract_hidden_states capture layer can join, found "
        "linear-attention state beside attention KV (the engine fails after the load: "
        '"Failed to promote local KV cache specs to one unified type."); hsx has no exact '
        "capture path for hybrids yet",
        (
            "linear-attention layers: "
            + ", ".join(str(i) for i in linear[:16])
            + (" ..." if len(linear) > 16 else ""),
        )
        if linear
        else (),
    )


def check_capture_contract(
    resolved: ResolvedArchitecture,
    config: Mapping[str, Any],
    layer_ids: Sequence[int],
    hsx_capture_here: str | None = None,
) -> CheckResult:
    """EAGLE-3 interface present (vLLM's, or hsx's own hooks for the architectures of
    hsx.engine.capture_models), layer ids (vLLM convention) unique and in range.

    ``hsx_capture_here``: None where hsx's hooks can be installed in the engine (built in this
    process), else why they cannot (they are registered in the process that builds it)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    from hsx.engine.capture_models import needs_hsx_capture

    name = resolved.class_name
    version = _vllm_version()
    for (arch, prefix), why in KNOWN_BAD.items():
        if arch == resolved.architecture and version.startswith(prefix):
            return CheckResult(
                "contract", Status.FAIL, f"{arch} is known broken with vLLM {version}: {why}"
            )
    captured_by_hsx = needs_hsx_capture([resolved.architecture])
    if captured_by_hsx and hsx_capture_here is not None:
        return CheckResult(
            "contract",
            Status.FAIL,
            f"{name} lacks vLLM's EAGLE-3 interface and is captured by hsx's own hooks, which "
            f"are installed where the engine is built: expected an engine in this process, "
            f"found {hsx_capture_here}",
        )
    if not captured_by_hsx and not supports_eagle3(resolved.model_cls):
        return CheckResult(
            "contract",
            Status.FAIL,
            f"{name} does not implement vLLM's EAGLE-3 aux-hidden-state interface "
            f"(expected SupportsEagle3 in vLLM {version}; found none): {_REFERENCE_PATH}",
            (f"class: {resolved.module_name}.{name}",),
        )
    text = text_config(config)
    num_layers = text.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        return CheckResult(
            "contract",
            Status.FAIL,
            f"config.json num_hidden_layers must be a positive integer; found {num_layers!r}",
        )
    hybrid = _hybrid_refusal(resolved, text, version)
    if hybrid is not None:
        return hybrid
    ids = [int(i) for i in layer_ids]
    if not ids:
        return CheckResult(
            "contract",
            Status.FAIL,
            f"No layer ids given; expected e.g. {default_layer_ids(num_layers)} "
            f"(vLLM convention) for {num_layers} layers",
        )
    dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dupes:
        return CheckResult(
            "contract",
            Status.FAIL,
            f"Layer ids must be unique; found duplicates {dupes} in {ids}",
        )
    span = capture_id_range(resolved, num_layers)
    bad = [i for i in ids if not span.low <= i <= span.high]
    if bad:
        return CheckResult(
            "contract",
            Status.FAIL,
            f"Layer ids {bad} out of range for {name} with {num_layers} layers: expected "
            f"{span.low}..{span.high} (vLLM convention: k = residual entering layer k, "
            f"{num_layers} = final pre-norm state); found {ids}",
            (span.reason,),
        )
    details = [span.reason]
    structure = layer_structure(text)
    if len(set(structure.kinds())) > 1:
        # Which kind of layer each captured state comes out of (id k: the output of layer k-1).
        details.append(
            "captured after: "
            + ", ".join(
                f"id {i} <- layer {i - 1} ({structure.kind(i - 1)})" for i in sorted(ids) if i
            )
        )
    if list(ids) != sorted(ids):
        # why: vLLM sorts aux layers; hsx must store them in the order the engine returns them.
        details.append(f"ids will be captured in ascending order {sorted(ids)}, not as given")
    how = "supports EAGLE-3 capture"
    if captured_by_hsx:
        how = "is captured by hsx's hooks (vLLM's class lacks EAGLE-3's interface)"
        details.append(
            "hsx.engine.capture_models: pre-hooks on the decoder layers and the final norm "
            "collect hidden_states + residual, as vLLM's own EAGLE-3 models do; eager mode"
        )
    return CheckResult(
        "contract",
        Status.PASS,
        f"{name} {how}; layer ids {tuple(ids)} valid in {span.low}..{span.high} (vLLM convention)",
        tuple(details),
    )


# --------------------------------------------------------------------------- tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def check_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> CheckResult:
    """The tokenizer loads from local files and carries a chat template."""
    model_dir = Path(model_dir)
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    if not any(f in present for f in _TOKENIZER_FILES):
        return CheckResult(
            "tokenizer",
            Status.FAIL,
            f"No tokenizer in {model_dir}: expected one of {', '.join(_TOKENIZER_FILES)}; "
            f"found {present or 'no files'}",
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # why: transformers raises many types; all mean "does not load".
        hint = ""
        if not trust_remote_code and "trust_remote_code" in str(exc):
            hint = " (its tokenizer_config.json auto_map needs trust_remote_code=True)"
        return CheckResult(
            "tokenizer",
            Status.FAIL,
            f"Tokenizer in {model_dir} does not load{hint}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else repr(exc)}",
        )
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return CheckResult(
            "tokenizer",
            Status.FAIL,
            f"Tokenizer {type(tokenizer).__name__} has no chat template: expected "
            f"'chat_template' in {model_dir / 'tokenizer_config.json'} or "
            f"{model_dir / 'chat_template.jinja'}; found neither",
        )
    size = len(tokenizer)
    return CheckResult(
        "tokenizer",
        Status.PASS,
        f"{type(tokenizer).__name__} loads ({size} tokens) and has a chat template",
    )


# --------------------------------------------------------------------------- family


def check_family(config: Mapping[str, Any], on_gpu: bool) -> CheckResult:
    """What hsx knows of this architecture family (hsx.model.families): on vLLM's CPU build a
    family refused there fails, naming why; one whose parity with HF is not established
    warns (the probe, when it runs, establishes it for this model)."""
    from hsx.model.families import family_of

    family = family_of(config)
    archs = list(config.get("architectures") or [])
    if family is None:
        return CheckResult(
            "family",
            Status.WARN,
            f"{archs} is not among hsx's families: parity with HF rests on the probe alone",
        )
    parity = family.cpu_parity
    where = "GPU" if on_gpu else "CPU"
    summary = f"family {family.name}: CPU parity with HF {parity.status}"
    if parity.status == "refused" and not on_gpu:
        return CheckResult(
            "family",
            Status.FAIL,
            f"family {family.name} cannot be captured correctly on vLLM's CPU build: "
            f"{parity.detail}",
            (f"real config: tests/fixtures/configs/{family.fixture}",),
        )
    status = Status.PASS if parity.status == "established" and not on_gpu else Status.WARN
    return CheckResult("family", status, f"{summary} ({where} here)", (parity.detail,))
