"""The ``hsx`` command line. It sits above the flows (it builds the settings and starts them), so
hsx/ itself never imports prefect.

    hsx demo                      the main job on the bundled tiny model and dataset
    hsx extract --model DIR --dataset FILE --store URL [options]
    hsx verify STORE_URL          exit 0 only when every planned chunk is committed and verifies
    hsx info STORE_URL            provenance, commits and runs of a store (the audit record)
    hsx preflight MODEL_DIR       checks that take seconds, before the long model load
    hsx serve MODEL_DIR           vLLM's server with extraction on: load once, many runs use it
    hsx make-tiny-models DIR      build the tiny Llama and DeepSeek-V3 models
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from flows.run_guard import SignalStop, exit_code, guarded_run

# Set before prefect or vllm are imported: they read these once.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hsx")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flows.runs_cli import runs_app
from flows.serve_cli import serve

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Hidden-state extraction for EAGLE-3 training data.",
)
console = Console(stderr=False)
REPO_ROOT = Path(__file__).resolve().parent.parent
app.add_typer(runs_app, name="runs")
app.command()(serve)


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # Escaped: messages quote values like [2, 4, 8] that rich would read as markup.
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def settings_errors(exc: Any) -> str:
    """A pydantic ValidationError as one line per bad setting: where, what, the value given."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def _layer_ids(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        _fail(f"--layer-ids: expected comma-separated integers like 2,16,29,32, found {value!r}")
    return None


def build_settings(**fields: Any) -> Any:
    """Settings from CLI values over HSX_ environment variables over defaults."""
    from pydantic import ValidationError

    from settings import HsxSettings

    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            sections.setdefault(section, {})[name] = value
        else:
            top[key] = value
    try:
        # One validation of everything together: pydantic-settings deep-merges these values over
        # HSX_* variables (a cross-field check must see the CLI's values, not the defaults).
        return HsxSettings(**top, **sections)
    except ValidationError as exc:
        _fail(f"invalid settings:\n{settings_errors(exc)}")


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


@app.command()
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
        str | None, typer.Option(help="Stored dtype: auto, float32, bfloat16.")
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
            "capture.layer_ids": _layer_ids(layer_ids),
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


@app.command()
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
        _fail(f"--model: expected one of {TINY_MODEL_NAMES}, found {model!r}")
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


def _older_store_layout(
    fs: Any, root: str, store_url: str, meta: dict[str, Any], upgrade: bool
) -> None:
    """A store written before hsx kept hsx-layout.json: its metadata documents cannot be
    checked. With --repair (and everything committed verifying), they are checked against what
    the store recorded and the copy is written."""
    from hsx.store.layout_copy import COPY_NAME, has_layout_copy, upgrade_layout_copy

    if has_layout_copy(fs, root, store_url):
        return
    if not upgrade:
        console.print(
            f"[yellow]metadata[/]: no {COPY_NAME} (a store of an older hsx): its metadata "
            "documents are not checked; `hsx verify --repair` checks them and writes it",
            soft_wrap=True,
        )
        return
    problems = upgrade_layout_copy(fs, root, store_url, meta)
    for problem in problems:
        console.print(f"[red]metadata[/]: {problem}", soft_wrap=True, highlight=False)
    if problems:
        _fail(f"store {store_url}: {COPY_NAME} not written: the documents differ from the store")
    console.print(
        f"[yellow]repair[/]: wrote {COPY_NAME} (every metadata document checked against the "
        "store's record of its layout)",
        soft_wrap=True,
    )


@app.command()
def verify(
    store_url: Annotated[str, typer.Argument(help="Store URL.")],
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Drop the commit records of corrupt chunks; with --model and --dataset, "
            "extract exactly those again.",
        ),
    ] = False,
    model: Annotated[
        Path | None, typer.Option(help="With --repair: the model folder, to re-extract.")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="With --repair: the dataset (path or URL), to re-extract.")
    ] = None,
) -> None:
    """Re-hash every committed chunk; exit 0 only when every planned chunk verifies."""
    from hsx.errors import HsxError
    from hsx.store.verify import repair_store, verify_store
    from hsx.store.zarr_store import ExtractionStore

    if (model is None) != (dataset is None) or (model is not None and not repair):
        _fail("--model and --dataset: expected both, with --repair, or neither")
    from hsx.store.layout_copy import COPY_NAME, metadata_problems, repair_metadata
    from hsx.store.zarr_store import fs_and_root

    damaged: list[str] = []
    try:
        # The metadata documents first, before zarr reads them: a damaged one may not open.
        fs, root = fs_and_root(store_url)
        if repair:
            for name in repair_metadata(fs, root, store_url):
                console.print(f"[yellow]repair[/]: rewrote {name} from {COPY_NAME}")
        else:
            damaged = metadata_problems(fs, root, store_url)
        store = ExtractionStore.open(store_url, mode="r+" if repair else "r")
        report = verify_store(store)
    except Exception as exc:  # an hsx error, or zarr's on a damaged document
        for message in damaged:
            console.print(f"[red]metadata[/]: {message}", soft_wrap=True, highlight=False)
        if damaged:  # it does not open because of them: corrupt, as verify reports it
            _fail(f"store {store_url}: {exc!r}; `hsx verify --repair` rewrites them", 1)
        if isinstance(exc, HsxError):
            _fail(str(exc))
        raise
    for message in report.metadata_problems:
        console.print(f"[red]metadata[/]: {message}", soft_wrap=True, highlight=False)
    _older_store_layout(fs, root, store_url, store.meta, report.intact and repair)
    for problem in report.problems:
        console.print(f"[red]chunk {problem.chunk_index}[/]: {problem.message}")
    for message in report.index_problems:
        console.print(f"[red]sample index[/]: {message}")
    if report.missing:
        console.print(
            f"[yellow]uncommitted chunks[/]: {report.missing[:50]}{' ...' if len(report.missing) > 50 else ''}"
        )
    colour = {"OK": "[green]", "INCOMPLETE": "[yellow]"}.get(report.state, "[red]")
    console.print(colour + report.summary())
    if not repair or not (report.problems or report.index_problems):
        # 0 complete and intact, 3 intact but not finished (a resume completes it), 1 corrupt.
        raise typer.Exit({"OK": 0, "INCOMPLETE": 3}.get(report.state, 1))
    dropped = repair_store(store, report)
    if dropped:
        console.print(f"[yellow]repair[/]: dropped the commit records of chunks {sorted(dropped)}")
    if model is None or dataset is None:
        console.print(
            "re-extract exactly those with: hsx extract --model MODEL --dataset DATASET "
            f"--store {store_url} (or hsx verify {store_url} --repair --model ... --dataset ...)"
        )
        raise typer.Exit(1)
    # The store's own settings (it froze what changes the data), on this machine's paths.
    recorded = dict(store.meta["settings"])
    recorded.update(model=str(model), dataset=str(dataset), store=store_url)
    recorded.get("run", {})["preflight"] = False  # the store was written by this model already
    settings = build_settings(**recorded)
    raise typer.Exit(run_extraction(settings))


@app.command()
def info(
    store_url: Annotated[str, typer.Argument(help="Store URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Provenance, commit records and runs of a store: which run wrote which chunk, how."""
    from dataclasses import asdict

    from hsx.errors import HsxError
    from hsx.store.run_records import records_beside
    from hsx.store.zarr_store import ExtractionStore, existing_store_meta

    try:
        beside = records_beside(store_url)
        if beside and existing_store_meta(store_url) is None:
            # Every run failed before the store was created: their records are all there is.
            for run in beside:
                console.print(_run_line(run), soft_wrap=True, highlight=False)
            raise typer.Exit(1)
        store = ExtractionStore.open(store_url)
        commits = store.committed_chunks()
        runs = sorted([*store.run_records(), *beside], key=lambda r: r.get("recorded_at", 0))
    except HsxError as exc:
        _fail(str(exc))
        return
    meta = store.meta
    if as_json:
        meta.pop("work_chunks", None)
        print(
            json.dumps(
                {"meta": meta, "commits": [asdict(c) for c in commits.values()], "runs": runs},
                indent=1,
                default=str,
            )
        )
        return
    model = meta["model"]
    console.print(
        f"[bold]{store_url}[/]: {model['architectures']} ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}), layers {meta['layer_ids']} ({meta['layer_convention']}), {meta['logical_dtype']}"
    )
    console.print(
        f"{meta['num_samples']} samples, {meta['total_tokens']} tokens, {len(commits)}/{len(meta['work_chunks'])} chunks committed; code {meta['code_version']}"
    )
    served = any((record.extra or {}).get("engine_server") for record in commits.values())
    table = Table(
        "chunk", "samples", "tokens", "skipped", "run", "run attempt", "chunk attempt",
        "seconds", "finished", *(["server (instance)"] if served else []),
    )  # fmt: skip
    for record in commits.values():
        server = (record.extra or {}).get("engine_server") or {}
        where = [f"{server.get('url', '-')} ({str(server.get('instance', '-'))[:8]})"]
        table.add_row(
            str(record.chunk_index),
            f"{record.sample_start}..{record.sample_end - 1}",
            str(record.tokens),
            str(len(record.skipped_samples)),
            record.run_id[:12],
            str((record.extra or {}).get("flow_run_attempt", "-")),
            str(record.attempt),
            f"{record.seconds:.2f}",
            record.finished_at,
            *(where if served else []),
        )
    console.print(table)
    skipped = [entry for record in commits.values() for entry in record.skipped_samples]
    for entry in skipped[:20]:
        console.print(f"[yellow]sample {entry['sample']} skipped[/]: {entry['reason']}")
    if len(skipped) > 20:
        console.print(f"... {len(skipped) - 20} more skipped samples (hsx info --json)")
    for run in runs:
        console.print(_run_line(run), soft_wrap=True, highlight=False)


def _run_line(run: dict[str, Any]) -> str:
    """One run record: which run and attempt, its outcome, when, and why it failed."""
    summary = run.get("summary") or {}
    done = (
        f", {summary.get('chunks_extracted_now')} chunks committed, "
        f"{len(summary.get('chunks_failed', []))} failed"
        if summary
        else ""
    )
    why = f": {run['error']}" if run.get("error") else ""
    where = f" in {run['failed_in']}" if run.get("failed_in") else ""
    return (
        f"run {run.get('run_id')} attempt {run.get('attempt', 1)}: {run.get('status')}{where}"
        f" ({run.get('started_at', '?')} .. {run.get('ended_at') or 'running'}{done}; "
        f"code {run.get('code_version')}){why}"
    )


@app.command()
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
                {"layer_ids": _layer_ids(layer_ids), "layer_convention": layer_convention}
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
        _fail(f"invalid settings:\n{settings_errors(exc)}")
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


@app.command("make-tiny-models")
def make_tiny_models(
    target: Annotated[Path, typer.Argument(help="Folder to build the models in.")],
) -> None:
    """Build the tiny Llama and DeepSeek-V3 models (seeded random weights, local tokenizer)."""
    from hsx.data.tiny_models import ensure_tiny_models

    for name, path in ensure_tiny_models(target).items():
        console.print(f"{name}: {path}")


def main() -> None:
    from flows.allocator import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # before anything is allocated in earnest; a no-op without tcmalloc
    from hsx.engine.platform import enable_fault_reports

    enable_fault_reports()  # SIGILL/SIGSEGV in a kernel: every thread's traceback, not a bare signal
    app()


if __name__ == "__main__":
    sys.exit(main())
