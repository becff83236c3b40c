"""``hsx verify`` and ``hsx info``: a store's verification (and repair), and its audit record:
provenance, commit records and runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from flows.cli_common import build_settings, console, fail
from flows.extract_cli import run_extraction


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
        fail(f"store {store_url}: {COPY_NAME} not written: the documents differ from the store")
    console.print(
        f"[yellow]repair[/]: wrote {COPY_NAME} (every metadata document checked against the "
        "store's record of its layout)",
        soft_wrap=True,
    )


def verify(
    store_url: Annotated[str, typer.Argument(help="Store URL, or an export's folder.")],
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
    """Re-hash every committed chunk (or, for an export, every file its manifest lists); exit 0
    only when everything verifies, 3 when intact but unfinished, 1 when anything is corrupt."""
    from hsx.errors import HsxError
    from hsx.trainers.export import is_export

    if is_export(store_url):
        if repair:
            fail("--repair: expected a store, found an export (re-run `hsx export` to repair it)")
        from flows.export_cli import verify_export_cli

        verify_export_cli(store_url)
    from hsx.store.verify import repair_store, verify_store
    from hsx.store.zarr_store import ExtractionStore

    if (model is None) != (dataset is None) or (model is not None and not repair):
        fail("--model and --dataset: expected both, with --repair, or neither")
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
            fail(f"store {store_url}: {exc!r}; `hsx verify --repair` rewrites them", 1)
        if isinstance(exc, HsxError):
            fail(str(exc))
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


def info(
    store_url: Annotated[str, typer.Argument(help="Store URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write the store's throughput over time (tokens/s, from its commit records) as "
            "an SVG file: the plot a flow run's page shows.",
        ),
    ] = None,
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
        fail(str(exc))
        return
    meta = store.meta
    if plot is not None:
        from hsx.store.throughput import commits_of, throughput_series, throughput_svg

        series = throughput_series(commits_of(commits.values()))
        plot.write_text(throughput_svg(series, f"{store_url}: {len(commits)} chunks committed"))
        if not as_json:
            console.print(f"throughput plot: {plot}", highlight=False)
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
    stored = meta["logical_dtype"]
    if meta.get("state_encoding", "plain") != "plain":
        stored = f"{meta['state_encoding']} (read as {stored})"
    console.print(
        f"[bold]{store_url}[/]: {model['architectures']} ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}), layers {meta['layer_ids']} ({meta['layer_convention']}), {stored}"
    )
    console.print(
        f"{meta['num_samples']} samples, {meta['total_tokens']} tokens, {len(commits)}/{len(meta['work_chunks'])} chunks committed; code {meta['code_version']}"
    )
    console.print(_family_line(model), soft_wrap=True, highlight=False)
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


def _family_line(model: dict[str, Any]) -> str:
    """The store's model family and what is known of its parity with HF on vLLM's CPU build."""
    from hsx.model.families import family_of

    family = family_of(
        {"architectures": model.get("architectures") or [], "model_type": model.get("model_type")}
    )
    if family is None:
        return (
            f"family: {model.get('architectures')} is not among hsx's families: parity with HF "
            "rests on each run's preflight probe (see the runs below)"
        )
    return (
        f"family {family.name}: CPU parity with HF {family.cpu_parity.status} "
        f"({family.cpu_parity.detail})"
    )


def _run_line(run: dict[str, Any]) -> str:
    """One run record: which run and attempt, its outcome, when, and why it failed."""
    summary = run.get("summary") or {}
    done = (
        f", {summary.get('chunks_extracted_now')} chunks committed, "
        f"{len(summary.get('chunks_failed', []))} failed"
        if summary
        else ""
    )
    if summary.get("audit"):
        done += f", audit {summary['audit']}"
    why = f": {run['error']}" if run.get("error") else ""
    where = f" in {run['failed_in']}" if run.get("failed_in") else ""
    warning = (run.get("parity") or {}).get("warning")
    unchecked = f" [yellow]WARNING: {warning}[/]" if warning else ""
    return (
        f"run {run.get('run_id')} attempt {run.get('attempt', 1)}: {run.get('status')}{where}"
        f" ({run.get('started_at', '?')} .. {run.get('ended_at') or 'running'}{done}; "
        f"code {run.get('code_version')}){why}{unchecked}"
    )
