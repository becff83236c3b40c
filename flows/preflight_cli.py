"""``hsx preflight`` (checks that take seconds, before the long model load) and
``hsx make-tiny-models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli_common import console, fail, parse_layer_ids, settings_errors


def preflight(
    model_dir: Annotated[
        Path, typer.Argument(help="Model folder (config.json; weights optional).")
    ],
    layer_ids: Annotated[
        str | None, typer.Option(help="Comma-separated layer ids; default EAGLE-3's.")
    ] = None,
    layer_convention: Annotated[
        str | None, typer.Option(help="'vllm' (default) or 'specforge'.")
    ] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help="GPUs per engine.")] = None,
    store: Annotated[str | None, typer.Option(help="Store URL, for the free-space check.")] = None,
    probe: Annotated[
        bool, typer.Option("--probe/--no-probe", help="Run the reduced-model probe.")
    ] = True,
    rotary_custom_op: Annotated[
        str | None, typer.Option(help="auto, on or off (MLA on CPU).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="vLLM's max_model_len; default the model's limit.")
    ] = None,
    max_length: Annotated[
        int | None, typer.Option(help="Longest sample (tokens); below --max-model-len.")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16, float16.")] = None,
    attention_backend: Annotated[
        str | None, typer.Option(help="auto (hsx chooses) or a vLLM backend name.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Checks that take seconds, before the long model load; exit 1 when any check fails."""
    from pydantic import ValidationError

    from hsx.preflight.run import run_preflight
    from settings import PreflightSettings

    def given(values: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if v is not None}

    try:
        # HSX_ENGINE__* and HSX_CAPTURE__* apply as they would to a run; the options over them.
        settings = PreflightSettings(
            model=model_dir,
            capture=given(
                {"layer_ids": parse_layer_ids(layer_ids), "layer_convention": layer_convention}
            ),
            engine=given(
                {
                    "tensor_parallel_size": tensor_parallel_size,
                    "mla_rotary_custom_op": rotary_custom_op,
                    "max_model_len": max_model_len,
                    "dtype": dtype,
                    "attention_backend": attention_backend,
                }
            ),
        )
    except ValidationError as exc:
        fail(f"invalid settings:\n{settings_errors(exc)}")
        return
    capture, engine = settings.capture, settings.engine
    report = run_preflight(
        model_dir, capture, engine, probe=probe, store_url=store, max_length=max_length
    )
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        report.render_table(console)
    raise typer.Exit(0 if report.ok else 1)


def make_tiny_models(
    target: Annotated[Path, typer.Argument(help="Folder to build the models in.")],
    family: Annotated[
        list[str] | None,
        typer.Option(
            "--family",
            help="Also build this family's tiny float32 model (its real HF class), as "
            "tiny-FAMILY; repeat for several, 'all' for every one (hsx.data.tiny_families).",
        ),
    ] = None,
) -> None:
    """Build the tiny Llama and DeepSeek-V3 models (seeded random weights, local tokenizer)."""
    from hsx.data.tiny_families import TINY_FAMILY_NAMES, ensure_tiny_family
    from hsx.data.tiny_models import ensure_tiny_models

    wanted = list(TINY_FAMILY_NAMES) if family == ["all"] else list(family or [])
    unknown = [name for name in wanted if name not in TINY_FAMILY_NAMES]
    if unknown:
        console.print(
            f"[red]--family: expected one of {', '.join(TINY_FAMILY_NAMES)} or all, found "
            f"{', '.join(unknown)}[/]"
        )
        raise typer.Exit(2)
    for name, path in ensure_tiny_models(target).items():
        console.print(f"{name}: {path}")
    for name in wanted:
        console.print(f"tiny-{name}: {ensure_tiny_family(target, name)}")
