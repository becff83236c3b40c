"""``hsx audit``: what a store's states mean (a Prefect flow run): next-token agreement through
the target's own final norm and LM head, alignment, layer statistics, the data's shape, plots.
Exit 0 when the audit finds no error, 1 when it does, 2 on bad input (refused before any state
is read)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from flows.cli_common import console, fail
from flows.run_guard import guarded_run

DEFAULT_POSITIONS = 65_536  # the audit flow's default too (flows/audit.py)


def audit(
    store: Annotated[str, typer.Argument(help="Store URL (local path or fsspec URL).")],
    model: Annotated[
        Path | None,
        typer.Option(help="Model folder: its final norm and LM head (default: the store's)."),
    ] = None,
    positions: Annotated[
        int,
        typer.Option(help="Rows whose states are read, spread over the chunks; 0 = every row."),
    ] = DEFAULT_POSITIONS,
    samples: Annotated[
        str | None, typer.Option(help="START:END of sample indices (default: every one).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    out: Annotated[
        str | None, typer.Option(help="Folder for report.json, report.md and the plots (PNG).")
    ] = None,
    device: Annotated[str, typer.Option(help="auto (a GPU when present), cpu or cuda.")] = "auto",
    draft_vocab_size: Annotated[
        int, typer.Option(help="Draft vocabulary size whose coverage is reported.")
    ] = 32_000,
    workers: Annotated[int, typer.Option(help="Chunks audited at once, 1..16.")] = 2,
) -> None:
    """Check what the states mean, not only their bytes: the final state must predict each
    next token as the target did; shift 0 must predict best; every layer is checked."""
    from hsx.audit.run import check_inputs
    from hsx.errors import HsxError

    try:
        # Seconds, before a Prefect server starts: another model, no head, nothing committed.
        check_inputs(store, model, positions, samples, device)
    except HsxError as exc:
        fail(str(exc))
    prefect_home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    with guarded_run(prefect_home / "hsx-servers") as stop:
        code = _run_audit(
            store, model, positions, samples, out, device, draft_vocab_size, workers, as_json
        )
    if stop.signum is not None:
        sys.stdout.flush()
        os._exit(code)
    raise typer.Exit(code)


def _run_audit(
    store: str,
    model: Path | None,
    positions: int,
    samples: str | None,
    out: str | None,
    device: str,
    draft_vocab_size: int,
    workers: int,
    as_json: bool,
) -> int:
    from flows.audit import StoreAuditFailedError, audit_flow
    from hsx.audit import AuditReport, finding_lines, summary_lines
    from hsx.errors import HsxError

    state = audit_flow(
        store,
        str(model) if model else None,
        positions,
        samples,
        out,
        device,
        draft_vocab_size,
        workers,
        return_state=True,
    )
    result = state.result(raise_on_failure=False)
    report = result.report if isinstance(result, StoreAuditFailedError) else result
    if not isinstance(report, AuditReport):
        console.print(f"[bold red]error:[/] {result!r}", soft_wrap=True, highlight=False)
        return 2 if isinstance(result, HsxError) else 1
    if as_json:
        print(json.dumps(report.to_json(), indent=1, default=str))
    else:
        for line in summary_lines(report) + finding_lines(report):
            console.print(line, soft_wrap=True, highlight=False, markup=False)
        if out:
            console.print(f"wrote report.json, report.md and the plots to {out}")
    return 0 if report.ok else 1
