"""``hsx serve MODEL_DIR``: vLLM's own server with extraction on, kept up for many runs.

Preflight runs first (static checks, and the reduced-model probe unless --no-probe), then vLLM's
argument parser reads hsx's flags: a mistake surfaces in seconds, before the long model load.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from flows.cli_common import fail, parse_layer_ids, settings_errors

console = Console(stderr=False)


def _drop_unset(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def serve(
    model_dir: Annotated[
        Path | None,
        typer.Argument(
            help="Model folder (config.json, tokenizer, safetensors); default HSX_MODEL."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8100).")] = None,
    layer_ids: Annotated[
        str | None, typer.Option(help="Comma-separated layer ids; default EAGLE-3's.")
    ] = None,
    layer_convention: Annotated[
        str | None, typer.Option(help="'vllm' (default) or 'specforge' numbering.")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16, float16.")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="vLLM's max_model_len; default the model's limit.")
    ] = None,
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV cache size (GiB).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help="GPUs per engine.")] = None,
    load_format: Annotated[
        str | None, typer.Option(help="auto, safetensors or dummy (random weights).")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name in the OpenAI API; default the folder's name.")
    ] = None,
    probe: Annotated[
        bool | None,
        typer.Option("--probe/--no-probe", help="Run the reduced-model probe before the load."),
    ] = None,
    vllm_args: Annotated[
        str | None,
        typer.Option(help="More vLLM server flags, e.g. '--gpu-memory-utilization 0.45'."),
    ] = None,
) -> None:
    """Serve MODEL_DIR for extraction: vLLM's own server, loaded once for many runs."""
    from pydantic import ValidationError

    from settings import ServeSettings

    # Without MODEL_DIR, HSX_MODEL names it (a systemd unit's or compose service's environment).
    if model_dir is None and not os.environ.get("HSX_MODEL"):
        fail("hsx serve: expected MODEL_DIR or HSX_MODEL, found neither")
    model = {} if model_dir is None else {"model": model_dir}
    try:
        settings = ServeSettings(
            **model,
            engine=_drop_unset(
                {
                    "dtype": dtype,
                    "max_model_len": max_model_len,
                    "kv_cache_memory_gib": kv_cache_gib,
                    "tensor_parallel_size": tensor_parallel_size,
                    "load_format": load_format,
                }
            ),
            capture=_drop_unset(
                {"layer_ids": parse_layer_ids(layer_ids), "layer_convention": layer_convention}
            ),
            server=_drop_unset(
                {
                    "host": host,
                    "port": port,
                    "served_model_name": served_model_name,
                    "probe": probe,
                    "vllm_args": None if vllm_args is None else shlex.split(vllm_args),
                }
            ),
        )
    except ValidationError as exc:
        fail(f"invalid settings:\n{settings_errors(exc)}")
        return
    raise typer.Exit(run_server(settings))


def run_server(settings: Any) -> int:
    """Preflight, then the server until it stops; the exit code."""
    from hsx.errors import HsxError
    from hsx.serve.server import check_port_free, serve, serve_preflight

    try:
        check_port_free(settings.server.host, settings.server.port)  # seconds, not after the load
        report, plan = serve_preflight(settings)
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
        return 2
    report.render_table(console)
    if plan is None or not report.ok:
        console.print("[bold red]hsx serve: preflight failed; the model was not loaded[/]")
        return 1

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, highlight=False)

    try:
        return serve(plan, settings, say)
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
        return 2
