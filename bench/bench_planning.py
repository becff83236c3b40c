"""Planning benchmark: how fast hsx reads and tokenizes a dataset into a plan and a store, per
format, and whether its memory grows with the dataset.

1. tokens/s of planning (read, check, chat template, tokenize, cut work chunks, write the
   store's token rows) of the same conversations as JSONL and as Parquet, each pass in a fresh
   child process, alternating the formats (--rounds); the median of Parquet/JSONL.
2. Peak RSS of planning the bundled dataset and ten times as many conversations (each format):
   it must not grow with the dataset (target: 10x / 1x within 1.1).

    .venv/bin/python bench/bench_planning.py [--model tiny-llama] [--rounds 3] [--copies 10]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def child(model: str, dataset: str) -> None:
    """One planning pass in this (fresh) process: tokens/s and peak RSS, as a JSON line."""
    from hsx.extraction.steps import plan_and_create_store
    from settings import HsxSettings

    with tempfile.TemporaryDirectory() as scratch:
        settings = HsxSettings(
            model=Path(model),
            dataset=dataset,
            store=str(Path(scratch) / "plan.zarr"),
            engine={"max_model_len": 2048},
            data={"max_length": 2047},
        )
        started = time.perf_counter()
        summary = plan_and_create_store(settings)
        seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": summary.tokens, "seconds": seconds, "peak_rss_mib": peak}))


def run_child(model: Path, dataset: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(model), str(dataset)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if out.returncode != 0:
        from hsx.engine.platform import exit_description

        raise RuntimeError(
            f"planning child failed ({exit_description(out.returncode)}):\n{out.stderr[-4000:]}"
        )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def write_forms(rows: list[dict[str, Any]], folder: Path, copies: int) -> dict[str, Path]:
    """The rows (with unique ids) as JSONL and Parquet, once and ``copies`` times."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    forms = {}
    for times in (1, copies):
        many = [dict(r, id=f"{r['id']}-{n}") for n in range(times) for r in rows]
        jsonl = folder / f"x{times}.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in many))
        parquet = folder / f"x{times}.parquet"
        pq.write_table(pa.Table.from_pylist(many), parquet, row_group_size=1000)
        forms[f"jsonl x{times}"], forms[f"parquet x{times}"] = jsonl, parquet
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=10)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from hsx.data.tiny_models import ensure_tiny_models

    model = ensure_tiny_models(ROOT / "models")[args.model]
    source = ROOT / "data" / "sample_conversations.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    print(f"CPU: {os.cpu_count()} cores; model {args.model}; {len(rows)} conversations")
    with tempfile.TemporaryDirectory() as scratch:
        forms = write_forms(rows, Path(scratch), args.copies)
        ratios = []
        for number in range(args.rounds):
            order = ["jsonl x1", "parquet x1"][:: 1 if number % 2 == 0 else -1]
            found = {name: run_child(model, forms[name]) for name in order}
            speed = {n: r["tokens"] / r["seconds"] for n, r in found.items()}
            ratios.append(speed["parquet x1"] / speed["jsonl x1"])
            print(
                f"  round {number}: jsonl {speed['jsonl x1']:,.0f} tok/s, parquet "
                f"{speed['parquet x1']:,.0f} tok/s -> parquet/jsonl {ratios[-1]:.3f}"
            )
        print(
            f"planning tokens/s, Parquet / JSONL (median of {len(ratios)}): "
            f"{statistics.median(ratios):.3f}"
        )
        for fmt in ("jsonl", "parquet"):
            small = run_child(model, forms[f"{fmt} x1"])
            large = run_child(model, forms[f"{fmt} x{args.copies}"])
            print(
                f"{fmt}: peak RSS {small['peak_rss_mib']:.0f} MiB (x1) -> "
                f"{large['peak_rss_mib']:.0f} MiB (x{args.copies}): ratio "
                f"{large['peak_rss_mib'] / small['peak_rss_mib']:.3f} (target <= 1.10); "
                f"x{args.copies} at {large['tokens'] / large['seconds']:,.0f} tok/s"
            )


if __name__ == "__main__":
    main()
