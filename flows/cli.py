"""The ``hsx`` command line. It sits above the flows (it builds the settings and starts them), so
hsx/ itself never imports prefect.

    hsx demo                      the main job on the bundled tiny model and dataset
    hsx extract --model DIR --dataset FILE --store URL [options]
    hsx regenerate --model DIR --dataset D --out OUT   the target rewrites the assistant turns
    hsx verify STORE_URL          exit 0 only when every planned chunk is committed and verifies
    hsx audit STORE_URL           what the states mean: next-token agreement, alignment, layers
    hsx export STORE --format F --out OUT   a store into a trainer's files (speculators, ...)
    hsx vocab STORE --draft-vocab-size N --out DIR   the draft vocabulary of a store
    hsx info STORE_URL            provenance, commits and runs of a store (the audit record)
    hsx preflight MODEL_DIR       checks that take seconds, before the long model load
    hsx serve MODEL_DIR           vLLM's server with extraction on: load once, many runs use it
    hsx make-tiny-models DIR      build the tiny Llama and DeepSeek-V3 models

This module only assembles the app; the commands live in extract_cli (extract, demo), store_cli
(verify, info), audit_cli (audit), export_cli (export, vocab), preflight_cli (preflight,
make-tiny-models), serve_cli and runs_cli, and what they share in cli_common.
"""

from __future__ import annotations

import os
import sys

import typer

# Set before prefect or vllm are imported: they read these once.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hsx")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NVLink multicast stays off in every engine hsx starts (tensor parallelism through NCCL): the
# lent multi-GPU hosts' docs ask for it, and a team's nodes are not different.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from flows.audit_cli import audit
from flows.cli_common import build_settings
from flows.export_cli import export, vocab
from flows.extract_cli import demo, extract
from flows.preflight_cli import make_tiny_models, preflight
from flows.regenerate_cli import regenerate
from flows.runs_cli import runs_app
from flows.serve_cli import serve
from flows.store_cli import info, verify

__all__ = ["app", "build_settings", "main"]  # build_settings: `from flows.cli import` keeps working

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Hidden-state extraction for EAGLE-3 training data.",
)
app.add_typer(runs_app, name="runs")
app.command()(serve)
app.command()(extract)
app.command()(demo)
app.command()(regenerate)
app.command()(verify)
app.command()(audit)
app.command()(export)
app.command()(vocab)
app.command()(info)
app.command()(preflight)
app.command("make-tiny-models")(make_tiny_models)


def main() -> None:
    from flows.allocator import reexec_with_tcmalloc

    reexec_with_tcmalloc()  # before anything is allocated in earnest; a no-op without tcmalloc
    from hsx.engine.platform import enable_fault_reports

    enable_fault_reports()  # SIGILL/SIGSEGV in a kernel: every thread's traceback, not a bare signal
    app()


if __name__ == "__main__":
    sys.exit(main())
