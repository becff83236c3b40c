"""``hsx regenerate``: the target model regenerates a dataset's assistant turns (a Prefect flow
run), into a dataset ``hsx extract --dataset OUT`` reads with the generated token ids."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.table import Table

from flows.cli_common import build_settings_of, console, fail, parse_layer_ids
from flows.run_guard import SignalStop, exit_code, guarded_run


def regenerate(
    model: Annotated[
        Path, typer.Option(help="Model folder (config.json, tokenizer with a chat template).")
    ],
    dataset: Annotated[str, typer.Option(help="Conversations, in any format `hsx extract` reads.")],
    out: Annotated[str, typer.Option(help="Where the regenerated dataset goes (path or URL).")],
    sampling: Annotated[
        str | None,
        typer.Option(help="vLLM sampling parameters as JSON: '{\"temperature\": 0.7}'."),
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Most tokens per turn.")] = None,
    turns: Annotated[str | None, typer.Option(help="all (default) or last.")] = None,
    on_length: Annotated[
        str | None, typer.Option(help="A turn cut by --max-tokens: keep, mark or drop.")
    ] = None,
    reasoning: Annotated[
        str | None, typer.Option(help="keep (default) or drop a turn's <think> part.")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Run seed (each turn's derives from it).")
    ] = None,
    chat_template_kwargs: Annotated[
        str | None, typer.Option(help="JSON for the chat template: '{\"enable_thinking\": false}'.")
    ] = None,
    conversations_per_chunk: Annotated[
        int | None, typer.Option(help="Conversations per retryable chunk.")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="Only the first N conversations.")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Engine dtype: auto, float32, bfloat16.")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="vLLM's max_model_len.")] = None,
    kv_cache_gib: Annotated[float | None, typer.Option(help="KV cache size (GiB).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help="GPUs per engine.")] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(
            help="vLLM OpenAI-compatible server URL(s), comma-separated (vllm serve; hsx "
            "serve with --store)."
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="Then extract the regenerated dataset into this store, with the model loaded "
            "once (through --engine-url's hsx serve, else one started for the run)."
        ),
    ] = None,
    layer_ids: Annotated[
        str | None, typer.Option(help="With --store: comma-separated layer ids to capture.")
    ] = None,
) -> None:
    """Regenerate the assistant turns of a dataset with the target model (a Prefect flow run)."""
    if layer_ids is not None and store is None:
        fail(
            "--layer-ids: expected with --store (the layers an extraction captures), found no --store"
        )
    settings = build_settings_of(
        _settings_class(),
        model=model,
        dataset=dataset,
        out=out,
        **{
            "generation.sampling": sampling,
            "generation.max_tokens": max_tokens,
            "generation.turns": turns,
            "generation.on_length": on_length,
            "generation.reasoning": reasoning,
            "generation.seed": seed,
            "generation.chat_template_kwargs": chat_template_kwargs,
            "generation.conversations_per_chunk": conversations_per_chunk,
            "data.max_samples": max_samples,
            "engine.dtype": dtype,
            "engine.max_model_len": max_model_len,
            "engine.kv_cache_memory_gib": kv_cache_gib,
            "engine.tensor_parallel_size": tensor_parallel_size,
            "engine.url": engine_url,
        },
    )
    extract = None
    if store is not None:
        extract = build_settings_of(
            _extraction_settings_class(),
            model=model,
            dataset=out,
            store=store,
            **{"capture.layer_ids": parse_layer_ids(layer_ids)},
        )
    raise typer.Exit(run_regeneration(settings, extract))


def _settings_class() -> Any:
    from settings.regenerate import RegenerateSettings

    return RegenerateSettings


def _extraction_settings_class() -> Any:
    from settings import HsxSettings

    return HsxSettings


def run_regeneration(settings: Any, extract: Any = None) -> int:
    """The regeneration (then, given ``extract``, the extraction of its output) as a flow run;
    the exit code."""
    from hsx.errors import HsxError
    from hsx.regeneration.generators import check_capture_engine_sampling
    from hsx.regeneration.run import load_tokenizer, plan_regeneration

    try:
        # Seconds, before Prefect and the engine start: a bad row, sampling parameter or model
        # fails here.
        plan = plan_regeneration(settings, load_tokenizer(settings.model))
        if extract is not None:
            check_capture_engine_sampling(plan.sampling, "hsx serve, for --store")
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
        return 2
    prefect_home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    with guarded_run(prefect_home / "hsx-servers") as stop:
        code = _run_flow(settings, extract, stop)
    if stop.signum is not None:
        sys.stdout.flush()
        os._exit(code)
    return code


def _run_flow(settings: Any, extract: Any, stop: SignalStop) -> int:
    from prefect.exceptions import CancelledRun

    from flows.extract import ExtractionIncompleteError
    from flows.regenerate import RegenerationIncompleteError, regenerate_flow
    from flows.regenerate_extract import regenerate_extract_flow
    from hsx.errors import HsxError

    try:
        if extract is None:
            summary = regenerate_flow(settings)
        else:
            summary = regenerate_extract_flow(settings, extract)
    except RegenerationIncompleteError as exc:
        console.print(f"[bold red]regeneration incomplete:[/] {exc}", soft_wrap=True)
        return 1
    except ExtractionIncompleteError as exc:
        console.print(f"[bold red]extraction incomplete:[/] {exc}", soft_wrap=True)
        return 1
    except CancelledRun as exc:  # stopped: the flow run ends Cancelled, not Crashed or Failed
        return _report_stopped(stop, str(exc))
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
        return 2
    except BaseException as exc:
        if stop.signum is None:
            raise
        return _report_stopped(stop, repr(exc))  # Prefect's SIGTERM bridge raised through it
    # A Cancelled end raises CancelledRun above: what comes back is the summary.
    summary = cast(dict[str, Any], summary)
    if extract is None:
        _print_summary("hsx regenerate", summary)
        console.print(
            f"extract it with: hsx extract --model {settings.model} --dataset {settings.out} ..."
        )
        return 0
    _print_summary("hsx regenerate", summary["regenerate"])
    _print_summary("hsx extract", summary["extract"])
    console.print(f"one engine served both: {summary['engine']}")
    return 0


def _print_summary(title: str, summary: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    for key, value in dict(summary).items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)


def _report_stopped(stop: SignalStop, detail: str) -> int:
    """What a stopped regeneration says, and the shell's exit code (130 for Ctrl-C, 143 for
    SIGTERM)."""
    import shlex
    import signal

    signum = stop.signum or signal.SIGTERM
    console.print(
        f"[bold yellow]stopped[/] by {signal.Signals(signum).name} (flow run Cancelled): {detail}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(f"resume with: {shlex.join(['hsx', *sys.argv[1:]])}", soft_wrap=True)
    return exit_code(signum)
