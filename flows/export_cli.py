"""``hsx export`` (a store into a trainer's files, as a Prefect flow run), ``hsx vocab`` (the
draft vocabulary of a store) and the verification of an export (``hsx verify`` calls it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli_common import console, fail
from flows.run_guard import guarded_run


def export(
    store: Annotated[str, typer.Argument(help="Store URL (local path or fsspec URL).")],
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="speculators (safetensors + a save_to_disk dataset, pre-norm final state), "
            "specforge (.ckpt, post-norm), modelopt (.pt, pre-norm flagged).",
        ),
    ],
    out: Annotated[str, typer.Option(help="Where the export goes (local path or fsspec URL).")],
    model: Annotated[
        Path | None,
        typer.Option(help="Model folder for the final norm (default: the folder the store names)."),
    ] = None,
    samples: Annotated[
        str | None, typer.Option(help="START:END of sample indices (default: every one).")
    ] = None,
    writers: Annotated[int, typer.Option(help="Units written at once, 1..32.")] = 4,
    unit_samples: Annotated[
        int, typer.Option(help="Samples per unit (a retried task); 0 = one per work chunk.")
    ] = 0,
) -> None:
    """Export a store's committed samples to the files a trainer reads; a re-run resumes."""
    from hsx.errors import HsxError
    from hsx.trainers.export import plan_export

    try:
        # Seconds, before Prefect starts: a wrong format, store or model fails here.
        plan_export(store, out, format, str(model) if model else None, samples, unit_samples)
    except HsxError as exc:
        fail(str(exc))
    prefect_home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    with guarded_run(prefect_home / "hsx-servers") as stop:
        code = _run_export(store, out, format, model, samples, writers, unit_samples)
    if stop.signum is not None:
        sys.stdout.flush()
        os._exit(code)
    raise typer.Exit(code)


def _run_export(
    store: str,
    out: str,
    format_name: str,
    model: Path | None,
    samples: str | None,
    writers: int,
    unit_samples: int,
) -> int:
    from flows.export import ExportIncompleteError, export_flow
    from hsx.errors import HsxError

    try:
        summary = export_flow(
            store,
            out,
            format_name,  # type: ignore[arg-type]
            str(model) if model else None,
            samples,
            writers,
            unit_samples,
        )
    except ExportIncompleteError as exc:
        console.print(f"[bold red]export incomplete:[/] {exc}", soft_wrap=True)
        return 1
    except HsxError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        return 2
    table = Table(title="hsx export", show_header=False)
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)
    return 0


def vocab(
    store: Annotated[str, typer.Argument(help="Store URL.")],
    draft_vocab_size: Annotated[int, typer.Option(help="Draft vocabulary size N.")],
    out: Annotated[Path, typer.Option(help="Folder for token_freq.pt, vocab_mapping.pt, d2t/t2d.")],
    samples: Annotated[
        str | None, typer.Option(help="START:END of sample indices (default: every one).")
    ] = None,
) -> None:
    """Token frequencies over the loss-masked tokens of the committed samples, and the N most
    frequent as a draft vocabulary: speculators' token_freq.pt (and d2t.npy/t2d.npy for its
    --d2t-path/--t2d-path), SpecForge's vocab_mapping.pt."""
    import time

    import numpy as np

    from hsx.errors import HsxError
    from hsx.store.reader import HiddenStatesReader
    from hsx.store.storage_io import write_atomic
    from hsx.store.zarr_store import fs_and_root
    from hsx.trainers.export import parse_samples
    from hsx.trainers.vocab import draft_vocab, store_vocab_size, token_counts, vocab_mapping_file

    started = time.perf_counter()
    try:
        reader = HiddenStatesReader(store)
        start, end = parse_samples(samples)
        chosen = [int(i) for i in reader.available_samples if start <= i < (end or 1 << 62)]
        size = store_vocab_size(reader)
        counts = token_counts(reader, chosen, size)
        d2t, t2d = draft_vocab(counts, draft_vocab_size)
    except HsxError as exc:
        fail(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    fs, root = fs_and_root(str(out))
    from hsx.trainers.formats import torch_bytes

    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    files = {
        "token_freq.pt": torch_bytes(freq),  # type: ignore[arg-type]
        "vocab_mapping.pt": vocab_mapping_file(d2t, t2d).payload,
    }
    for name, payload in files.items():
        write_atomic(fs, f"{root}/{name}", payload, store=str(out))
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    covered = int(counts[t2d.numpy()].sum())
    console.print(
        f"{len(chosen)} samples, {int(counts.sum()):,} loss-masked tokens, {len(freq):,} distinct "
        f"ids of {size:,}; the {draft_vocab_size:,} most frequent cover "
        f"{covered / max(int(counts.sum()), 1):.1%} of them ({time.perf_counter() - started:.1f} s)",
        soft_wrap=True,
    )
    console.print(f"wrote {out}/token_freq.pt, vocab_mapping.pt, d2t.npy, t2d.npy")


def verify_export_cli(url: str) -> None:
    """``hsx verify`` of an export: exit 0 when every file verifies, 3 when it never finished,
    1 when a file is missing or differs."""
    from hsx.errors import HsxError
    from hsx.trainers.export import verify_export

    try:
        report = verify_export(url)
    except HsxError as exc:
        fail(str(exc))
    for name in report.missing[:50]:
        console.print(f"[red]missing[/]: {name}", soft_wrap=True)
    for message in report.mismatched[:50]:
        console.print(f"[red]differs[/]: {message}", soft_wrap=True, highlight=False)
    if report.missing_units:
        console.print(f"[yellow]units not written[/]: {report.missing_units[:50]}")
    colour = "[green]" if report.ok else "[yellow]" if not report.complete else "[red]"
    console.print(colour + report.summary())
    raise typer.Exit(0 if report.ok else 3 if not report.complete else 1)
