"""``hsx extract`` and ``hsx demo``: an extraction run (a Prefect flow run) and its summary, or
what a stopped run committed and how to resume it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from flows.cli_common import build_settings, console, fail, parse_layer_ids
from flows.run_guard import SignalStop, exit_code, guarded_run

REPO_ROOT = Path(__file__).resolve().parent.parent


def print_summary(summary: dict[str, Any], bytes_stored: int | None) -> None:
    table = Table(title="hsx extraction", show_header=False)
    labels = {
        "store": "store",
        "samples": "samples",
        "samples_truncated": "samples truncated to data.max_length",
        "samples_left_out": "samples left out (longer than data.max_length)",
        "tokens": "tokens",
        "chunks": "work chunks",
        "chunks_extracted_now": "chunks extracted by this run",
        "tokens_extracted_now": "tokens extracted by this run",
        "extract_tokens_per_s": "tokens/s (extraction: first chunk's start to last commit)",
        "wall_seconds": "wall seconds (preflight, plan, extraction, verify)",
        "verification": "verification",
        "audit": "audit (run.audit_positions rows through the model's own head)",
    }
    for key, label in labels.items():
        table.add_row(label, str(summary.get(key)))
    if bytes_stored is not None:
        table.add_row("bytes stored", f"{bytes_stored:,} ({bytes_stored / 2**20:.1f} MiB)")
    console.print(table)


def run_extraction(settings: Any) -> int:
    from hsx.errors import HsxError
    from hsx.preflight.inputs import validate_inputs

    try:
        # Seconds, before Prefect and the engine start: bad input never reaches the store.
        validate_inputs(settings)
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2

    prefect_home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    with guarded_run(prefect_home / "hsx-servers") as stop:
        code = _run_flow(settings, stop)
    if stop.signum is not None:
        # Exit at once: chunks still in flight hold nothing committed, and waiting for the
        # engine's shutdown is what made a Ctrl-C hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_flow(settings: Any, stop: SignalStop) -> int:
    # Imported only now: the flow imports prefect, which reads PREFECT_API_URL once.
    from prefect.exceptions import CancelledRun

    from flows.extract import ExtractionIncompleteError, extract_flow
    from hsx.errors import HsxError

    try:
        summary = extract_flow(settings)
    except ExtractionIncompleteError as exc:
        console.print(f"[bold red]extraction incomplete:[/] {exc}")
        return 1
    except CancelledRun as exc:  # stopped: the flow run ends Cancelled, not Crashed or Failed
        return report_stopped(settings, stop.signum, str(exc))
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    except BaseException as exc:
        if stop.signum is None:
            raise
        # Prefect turns SIGTERM into its own exception through the flow, then hands the
        # signal on to our handler: the stop was asked for all the same.
        return report_stopped(settings, stop.signum, repr(exc))
    print_summary(summary, stored_bytes(settings.store))
    return 0


def stored_bytes(store_url: str) -> int | None:
    from hsx.store.zarr_store import ExtractionStore

    try:
        return ExtractionStore.open(store_url).nbytes_stored()
    except Exception:
        return None


def report_stopped(settings: Any, signum: int | None, detail: str) -> int:
    """What a stopped run committed and how to resume it; the shell's exit code."""
    import shlex
    import signal

    from hsx.store.zarr_store import ExtractionStore

    try:
        store = ExtractionStore.open(settings.store)
        committed = f"{len(store.committed_chunks())}/{len(store.work_chunks)} work chunks"
    except Exception as exc:
        committed = f"unknown ({exc!r})"
    if signum is None:
        # Prefect's engine holds SIGTERM while the flow runs (its bridge raises in the flow,
        # which records the stop): the signal is named in the stop's reason.
        from hsx.interrupt import stop_reason

        reason = (stop_reason() or "").split(" ", 1)[0]
        signum = int(getattr(signal.Signals, reason, signal.SIGTERM))
    name = signal.Signals(signum).name
    console.print(
        f"[bold yellow]stopped[/] by {name} (flow run Cancelled): {detail}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        f"committed in {settings.store}: {committed} (each verified at its commit)", soft_wrap=True
    )
    console.print(f"resume with: {shlex.join(['hsx', *sys.argv[1:]])}", soft_wrap=True)
    return exit_code(signum)


def extract(
    model: Annotated[
        Path, typer.Option(help="Model folder (config.json, tokenizer, safetensors).")
    ],
    dataset: Annotated[
        str,
        typer.Option(
            help="Conversations: JSONL, JSON, Parquet, a save_to_disk folder, a folder or a "
            "glob; a path or an fsspec URL (s3://...)."
        ),
    ],
    store: Annotated[str, typer.Option(help="Zarr store URL: path, file://, memory://, s3://...")],
    layer_ids: Annotated[
        str | None,
        typer.Option(help="Comma-separated layer ids; default EAGLE-3's (2, L//2, L-3) + L."),
    ] = None,
    layer_convention: Annotated[
        str | None, typer.Option(help="'vllm' (default) or 'specforge' numbering.")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Engine dtype: auto, float32, bfloat16.")
    ] = None,
    store_dtype: Annotated[
        str | None,
        typer.Option(help="Stored dtype: auto, float32, bfloat16, fp8_e4m3 (with scales)."),
    ] = None,
    max_length: Annotated[
        int | None, typer.Option(help="Truncate samples to this many tokens.")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="Only the first N conversations.")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="vLLM's max_model_len; above --max-length.")
    ] = None,
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV cache size (GiB).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help="GPUs per engine.")] = None,
    rows_per_chunk: Annotated[int | None, typer.Option(help="Token rows per Zarr chunk.")] = None,
    work_chunk_tokens: Annotated[
        int | None, typer.Option(help="Tokens per work chunk (task).")
    ] = None,
    retries: Annotated[int | None, typer.Option(help="Retries of a failed work chunk.")] = None,
    preflight: Annotated[
        bool | None, typer.Option("--preflight/--no-preflight", help="Run preflight checks first.")
    ] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="`hsx serve` URL(s), comma-separated: use them, load no model here."),
    ] = None,
) -> None:
    """Extract hidden states of a dataset into a Zarr store (a Prefect flow run)."""
    settings = build_settings(
        model=model,
        dataset=dataset,
        store=store,
        **{
            "capture.layer_ids": parse_layer_ids(layer_ids),
            "capture.layer_convention": layer_convention,
            "capture.store_dtype": store_dtype,
            "engine.dtype": dtype,
            "data.max_length": max_length,
            "data.max_samples": max_samples,
            "engine.max_model_len": max_model_len,
            "engine.kv_cache_memory_gib": kv_cache_gib,
            "engine.tensor_parallel_size": tensor_parallel_size,
            "layout.rows_per_chunk": rows_per_chunk,
            "layout.work_chunk_tokens": work_chunk_tokens,
            "run.retries": retries,
            "run.preflight": preflight,
            "engine.url": engine_url,
        },
    )
    raise typer.Exit(run_extraction(settings))


def demo(
    store: Annotated[str, typer.Option(help="Where to write the demo store.")] = str(
        REPO_ROOT / "stores" / "demo"
    ),
    models_dir: Annotated[Path, typer.Option(help="Where the tiny models are built.")] = REPO_ROOT
    / "models",
    model: Annotated[str, typer.Option(help="tiny-llama or tiny-deepseek-v3.")] = "tiny-llama",
) -> None:
    """The main job on the embedded default: tiny bundled model, bundled dataset, no server."""
    from hsx.data.tiny_models import TINY_MODEL_NAMES, ensure_tiny_models

    if model not in TINY_MODEL_NAMES:
        fail(f"--model: expected one of {TINY_MODEL_NAMES}, found {model!r}")
    console.print(f"[bold]hsx demo[/]: tiny models in {models_dir} (built if missing)")
    built = ensure_tiny_models(models_dir)
    settings = build_settings(
        model=built[model],
        dataset=REPO_ROOT / "data" / "sample_conversations.jsonl",
        store=store,
        **{
            "engine.max_model_len": 2048,  # the tiny models' max_position_embeddings
            "engine.kv_cache_memory_gib": 0.5,
            "data.max_length": 2047,  # vLLM samples one token after the prompt
        },
    )
    raise typer.Exit(run_extraction(settings))
