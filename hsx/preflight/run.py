"""Running every preflight check for one model folder, in seconds, before the long load.

Each check passes, warns or fails with one line; an exception inside a check becomes that
check's FAIL with ``repr(exc)`` (a preflight never dies with an empty message).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from hsx.model.config import read_config, text_config
from hsx.model.layers import convert_layer_ids, default_layer_ids
from hsx.preflight.report import CheckResult, PreflightReport, Status
from settings import CaptureSettings, EngineSettings

logger = logging.getLogger(__name__)

# Fields of vLLM's scheduler output that hsx's connector reads: a rename in a vLLM upgrade must
# fail here, in seconds, not in the first engine step after the load.
CONNECTOR_FIELDS = {
    "vllm.v1.core.sched.output.NewRequestData": (
        "req_id",
        "prompt_token_ids",
        "block_ids",
        "num_computed_tokens",
    ),
    "vllm.v1.core.sched.output.CachedRequestData": (
        "req_ids",
        "resumed_req_ids",
        "new_block_ids",
        "num_computed_tokens",
    ),
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
    ),
}


def _guarded(check: str, run: Callable[[], CheckResult]) -> CheckResult:
    try:
        return run()
    except Exception as exc:
        logger.error("preflight check %s raised %r", check, exc, exc_info=True)
        # A result, never a traceback: the first line of the error sums it up, the rest (a
        # pydantic error's lines, say) are details.
        first, *rest = (f"check raised {type(exc).__name__}: {exc}".strip()).splitlines()
        return CheckResult(check, Status.FAIL, first, tuple(line for line in rest if line.strip()))


def capture_layer_ids(capture: CaptureSettings, num_layers: int) -> tuple[int, ...]:
    if capture.layer_ids is None:
        return default_layer_ids(num_layers)
    return tuple(sorted(convert_layer_ids(capture.layer_ids, capture.layer_convention)))


def connector_field_problems() -> list[str]:
    import importlib

    problems = []
    for dotted, names in CONNECTOR_FIELDS.items():
        module, _, cls_name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        present = {f.name for f in fields(cls)}
        missing = [name for name in names if name not in present]
        if missing:
            problems.append(
                f"{dotted}: hsx's connector reads {missing}; found fields {sorted(present)}"
            )
    return problems


# Keyword arguments hsx passes to vllm.LLM (hsx.engine.options.engine_kwargs): each must be a
# field of the installed vLLM's EngineArgs, or engine start fails after the model load.
ENGINE_ARGUMENTS = (
    "model",
    "tokenizer",
    "dtype",
    "max_model_len",
    "enable_prefix_caching",
    "kv_cache_memory_bytes",
    "max_num_batched_tokens",
    "max_num_seqs",
    "tensor_parallel_size",
    "enforce_eager",
    "seed",
    "load_format",
    "speculative_config",
    "kv_transfer_config",
    "attention_backend",
    "compilation_config",
    "gpu_memory_utilization",
)


def engine_argument_problems() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    present = {f.name for f in fields(EngineArgs)}
    missing = [name for name in ENGINE_ARGUMENTS if name not in present]
    if not missing:
        return []
    return [f"vllm EngineArgs: hsx passes {missing}; found no such fields in this vLLM"]


def static_checks(
    model_dir: Path,
    capture: CaptureSettings,
    engine: EngineSettings,
    store_url: str | None = None,
    dataset_tokens: int | None = None,
    max_length: int | None = None,
    require_weights: bool | None = None,
    local_engine: bool = True,
    served: bool = False,
) -> tuple[list[CheckResult], dict[str, Any]]:
    """Every check that needs no engine. Returns (results, context for the probe).

    ``served``: the checks of `hsx serve`, whose engine is vLLM's server in a child process.

    ``local_engine`` False: the engine runs in `hsx serve` servers (engine.url), which own the
    devices; the weights-per-device check is theirs (`hsx serve` runs these checks at start).

    ``require_weights``: a folder without weights fails (else it warns: the probe runs on dummy
    weights). None = required when checking for an extraction into a store (``store_url``
    given) that loads real weights (engine.load_format not 'dummy')."""
    needs_weights = (
        store_url is not None and engine.load_format != "dummy"
        if require_weights is None
        else require_weights
    )
    from hsx.preflight.contract import capture_id_range, check_capture_contract, check_tokenizer
    from hsx.preflight.resolve import check_resolution, resolve_architecture, resolve_text_model
    from hsx.preflight.signatures import check_signatures, default_call_sites

    results: list[CheckResult] = []
    context: dict[str, Any] = {}
    try:
        config = read_config(model_dir)
    except Exception as exc:
        return [CheckResult("config", Status.FAIL, str(exc) or repr(exc))], context
    text = text_config(config)
    context.update(config=config, text=text)
    resolution = _guarded("resolve", lambda: check_resolution(config))
    results.append(resolution)

    def family() -> CheckResult:
        from hsx.engine.options import cuda_available
        from hsx.preflight.contract import check_family

        return check_family(config, on_gpu=cuda_available())

    # From config.json alone: it says why a family is refused even where nothing resolves.
    results.append(_guarded("family", family))
    # A wrapper that cannot be built here still has its text model's layers checked; where
    # neither resolves, the checks of config.json alone (memory, bytes per token) still run.
    resolved = (
        resolve_text_model(config)
        if resolution.status == Status.FAIL
        else resolve_architecture(config)
    )
    num_layers = int(text["num_hidden_layers"])
    if resolved is None:
        results.append(_guarded("tokenizer", lambda: check_tokenizer(model_dir)))
        return results + _config_checks(
            model_dir, config, engine, _ids_or_default(capture, num_layers), max_length,
            needs_weights, local_engine, store_url, dataset_tokens,
        ), context  # fmt: skip
    context["resolved"] = resolved

    def contract() -> CheckResult:
        ids = capture_layer_ids(capture, num_layers)
        context["layer_ids"] = ids
        context["lowest_layer_id"] = capture_id_range(resolved, num_layers).low
        elsewhere = [
            what
            for what, where in (
                ("engine.url (hsx serve servers)", not local_engine),
                ("hsx serve (vLLM's server in a child process)", served),
                ("engine.in_process false (a child process)", not engine.in_process),
                (
                    f"tensor_parallel_size {engine.tensor_parallel_size} (worker processes)",
                    engine.tensor_parallel_size > 1,
                ),
            )
            if where
        ]
        return check_capture_contract(
            resolved, config, ids, ", ".join(elsewhere) if elsewhere else None
        )

    results.append(_guarded("contract", contract))

    results.append(_guarded("tokenizer", lambda: check_tokenizer(model_dir)))

    def signatures() -> CheckResult:
        from hsx.engine.connector import HsxHiddenStatesConnector

        result = check_signatures(
            resolved, default_call_sites(), kv_connector=HsxHiddenStatesConnector
        )
        from hsx.engine.vllm_compat import connector_contract_problems

        extra = connector_field_problems()
        extra += connector_contract_problems(HsxHiddenStatesConnector)
        extra += engine_argument_problems()
        if extra:
            return CheckResult(
                "signatures", Status.FAIL, extra[0], tuple(extra[1:]) + result.details
            )
        return result

    results.append(_guarded("signatures", signatures))
    ids = context.get("layer_ids") or _ids_or_default(capture, num_layers)
    return results + _config_checks(
        model_dir, config, engine, ids, max_length, needs_weights, local_engine, store_url,
        dataset_tokens,
    ), context  # fmt: skip


def _ids_or_default(capture: CaptureSettings, num_layers: int) -> tuple[int, ...]:
    """The capture ids for sizing (bytes per token, KV), the default where they are invalid
    (the contract check names that)."""
    try:
        return capture_layer_ids(capture, num_layers)
    except ValueError:
        return default_layer_ids(num_layers)


def _config_checks(
    model_dir: Path,
    config: dict[str, Any],
    engine: EngineSettings,
    layer_ids: tuple[int, ...],
    max_length: int | None,
    needs_weights: bool,
    local_engine: bool,
    store_url: str | None,
    dataset_tokens: int | None,
) -> list[CheckResult]:
    """The checks of config.json and the folder alone: engine options (dtype, backend, KV and
    linear-attention state), weights, resources (weights per device, bytes per token)."""
    from hsx.preflight.engine_check import check_engine_options
    from hsx.preflight.resources import check_resources
    from hsx.preflight.weights import check_weights

    text = text_config(config)
    captured = len(layer_ids) or 4

    def resources() -> CheckResult:
        device_memory = None
        try:
            import torch

            if local_engine and torch.cuda.is_available():
                device_memory = int(torch.cuda.get_device_properties(0).total_memory)
        except Exception:  # no CUDA runtime: memory unknown, said so by the check
            device_memory = None
        bytes_per_token = captured * int(text["hidden_size"]) * 2 + 5  # bf16 states + id + mask
        return check_resources(
            config,
            engine.tensor_parallel_size,
            device_memory,
            bytes_per_token,
            dataset_tokens,
            store_url or "memory://",
        )

    return [
        _guarded(
            "engine",
            lambda: check_engine_options(model_dir, config, engine, captured, max_length),
        ),
        _guarded("weights", lambda: check_weights(model_dir, config, required=needs_weights)),
        _guarded("resources", resources),
    ]


def probe_check(context: dict[str, Any], engine: EngineSettings) -> CheckResult:
    from hsx.preflight.probe import run_probe

    if "layer_ids" not in context:
        return CheckResult(
            "probe", Status.FAIL, "not run: the model did not resolve or its layer ids are invalid"
        )
    return _guarded(
        "probe",
        lambda: run_probe(
            context["config"],
            context["text"],
            context["layer_ids"],
            context["lowest_layer_id"],
            engine,
            language_architecture=text_architecture(context["config"], context["resolved"]),
        ),
    )


def text_architecture(config: dict[str, Any], resolved: Any) -> str:
    """The class of a wrapper's text model as HF names it, which the probe builds and compares:
    the text config's own ``architectures`` (Kimi-K2.5: DeepseekV3ForCausalLM), else the
    family's (hsx.model.families), else the class vLLM builds inside the wrapper (vLLM's names
    can differ from HF's: Kimi-K2.5's is DeepseekV2ForCausalLM, whose HF class has no
    noaux_tc routing)."""
    from hsx.model.families import family_of

    text = text_config(config)
    archs = text.get("architectures") if text is not config else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    family = family_of(config)
    if family is not None and family.text_architecture is not None:
        return family.text_architecture
    return str(resolved.language_architecture)


def run_preflight(
    model_dir: Path,
    capture: CaptureSettings | None = None,
    engine: EngineSettings | None = None,
    probe: bool = True,
    store_url: str | None = None,
    dataset_tokens: int | None = None,
    max_length: int | None = None,
) -> PreflightReport:
    capture = capture or CaptureSettings()
    engine = engine or EngineSettings()
    results, context = static_checks(
        model_dir, capture, engine, store_url, dataset_tokens, max_length
    )
    if probe:
        results.append(probe_unless_blocked(results, context, engine))
    return PreflightReport(str(model_dir), results)


def probe_unless_blocked(
    results: list[CheckResult], context: dict[str, Any], engine: EngineSettings
) -> CheckResult:
    """The probe, unless a check it depends on failed (then a FAIL naming that check)."""
    blocking = [
        r
        for r in results
        if r.status == Status.FAIL
        and r.check in ("config", "resolve", "contract", "family", "engine")
    ]
    if blocking:
        return CheckResult("probe", Status.FAIL, f"not run: {blocking[0].check} failed")
    return probe_check(context, engine)
